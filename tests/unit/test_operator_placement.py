"""Which line of a container's termination message the pool shows as the reason."""

from __future__ import annotations

import pytest

from kvfleet.operator.placement import reason_line


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("sha256 mismatch for model-00001\n", "sha256 mismatch for model-00001"),
        (
            'Traceback (most recent call last):\n  File "x.py", line 1\n'
            "OSError: /models/a.gguf: no such file\n\n",
            "OSError: /models/a.gguf: no such file",
        ),
        (
            '{"level":"error","msg":"engine failed to start: bad sha256"}',
            "engine failed to start: bad sha256",
        ),
        ('{"level":"error","message":"no msg key"}', '{"level":"error","message":"no msg key"}'),
        ("[1, 2]", "[1, 2]"),
        ("  \n\n", ""),
    ],
)
def test_reason_is_the_last_non_empty_line_and_a_json_records_msg(
    message: str, expected: str
) -> None:
    assert reason_line(message) == expected
