"""The engine's router tokens follow their mounted Secret file: a rotation is accepted at once,
the replaced token for a grace period only, and a broken file changes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfleet.engine.router_token import CHECK_SECONDS, GRACE_SECONDS, RouterTokens

OLD, NEW, NEWER = "old-token-0123456789", "new-token-0123456789", "newer-token-0123456789"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def secret_volume(root: Path, token: str, version: int) -> Path:
    """A Secret volume as the kubelet writes it: `token` -> ..data/token, ..data a symlink
    swapped to a new timestamped folder on each update."""
    folder = root / f"..{version}"
    folder.mkdir()
    (folder / "token").write_text(token)
    tmp = root / "..data_tmp"
    tmp.symlink_to(folder.name)
    tmp.replace(root / "..data")
    if not (root / "token").is_symlink():
        (root / "token").symlink_to("..data/token")
    return root / "token"


def test_a_rotated_file_is_accepted_and_the_old_token_only_for_the_grace(tmp_path: Path) -> None:
    clock = Clock()
    path = secret_volume(tmp_path, OLD, 1)
    tokens = RouterTokens.from_file(path, clock)
    assert tokens.accepts(OLD) and not tokens.accepts(NEW)
    secret_volume(tmp_path, NEW, 2)
    assert tokens.accepts(OLD) and not tokens.accepts(NEW)  # not checked again yet
    clock.now += CHECK_SECONDS
    assert tokens.accepts(NEW) and tokens.accepts(OLD)
    clock.now += GRACE_SECONDS
    assert tokens.accepts(NEW) and not tokens.accepts(OLD)
    assert not tokens.accepts("") and not tokens.accepts(NEW + "x")


def test_a_second_rotation_within_the_grace_drops_the_oldest(tmp_path: Path) -> None:
    clock = Clock()
    path = secret_volume(tmp_path, OLD, 1)
    tokens = RouterTokens.from_file(path, clock)
    for version, token in ((2, NEW), (3, NEWER)):
        secret_volume(tmp_path, token, version)
        clock.now += CHECK_SECONDS
        assert tokens.accepts(token)
    assert tokens.accepts(NEW) and not tokens.accepts(OLD)


@pytest.mark.parametrize("broken", ["short", "", None])
def test_a_broken_file_keeps_the_current_token(tmp_path: Path, broken: str | None,
                                               caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    path = tmp_path / "token"
    path.write_text(OLD)
    tokens = RouterTokens.from_file(path, clock)
    if broken is None:
        path.unlink()
    else:
        path.write_text(broken)
        os.utime(path, ns=(1, 1))
    clock.now += CHECK_SECONDS
    assert tokens.accepts(OLD)
    if broken is not None:  # said, without a token
        assert "not reloaded" in caplog.text and OLD not in caplog.text


def test_an_unusable_file_at_start_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("short")
    with pytest.raises(ValueError, match=f"{path}: the router token needs at least 16"):
        RouterTokens.from_file(path)
