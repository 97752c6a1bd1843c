"""Atomic writes (`kvtool.fileio`): files get the mode the user's umask gives, not mkstemp's 0600."""

from __future__ import annotations

import os
import stat

import pytest

from kvtool.fileio import atomic_write, write_json_atomic


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        json_path = write_json_atomic(tmp_path / "out.json", {"a": 1})
        binary = atomic_write(tmp_path / "blob.bin", lambda tmp: open(tmp, "wb").write(b"x"))
    finally:
        os.umask(old)
    for path in (json_path, binary):
        assert stat.S_IMODE(path.stat().st_mode) == mode, oct(path.stat().st_mode)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left
