"""A compiled part of the engine whose build fails: what the tests of each one check."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfleet.engine import native


def warning_when_every_build_fails(load: Callable[[], object], monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture, tmp_path: Path) -> str:
    """Call `load` twice with no compiler: both return None, and one warning (no second build
    attempt) names the cause; returns that warning's text."""

    def no_compiler(**_: object) -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    monkeypatch.setattr(native, "_loaded", {})
    # An empty kernel cache: nothing built already can be loaded instead.
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert load() is None
        assert load() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "Ninja is required" in warnings[0]
    return warnings[0]
