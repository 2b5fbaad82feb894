"""`kvfleet generate` errors that need no model: bad flags fail fast with exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.cli import main


def test_bad_sampling_flag_names_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--no-progress", "--top-p", "1.5", "hello"]) == 2
    assert "sampling_params.top_p" in capsys.readouterr().err


def test_missing_model_file_says_what_to_do(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.gguf"
    assert main(["generate", "--no-progress", "--model", str(missing), "hello"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no such file" in err


def test_generate_is_listed_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--max-tokens" in capsys.readouterr().out
