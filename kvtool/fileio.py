"""Atomic file writes (temporary file in the same folder, fsync, rename) and output-path checks."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from kvtool.errors import KvtoolError


def check_output_path(path: str | Path) -> Path:
    """Fail before any work if ``path`` cannot be written as a file (a folder, or under a file)."""
    path = Path(path)
    if path.is_dir():
        raise KvtoolError(f"output '{path}' is a folder; give a file path, e.g. {path / 'out'}")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise KvtoolError(f"cannot write '{path}': '{parent}' is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise KvtoolError(f"cannot write '{path}': no write permission in '{parent}'")
    return path


def _umask() -> int:
    """The process umask (read by setting it and putting it back: there is no getter before Python 3.13's os)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write) -> Path:
    """Call ``write(temp_path)`` then rename the temp file over ``path``; OSErrors become KvtoolError."""
    path = check_output_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as exc:
        raise KvtoolError(f"cannot write '{path}': {exc}") from exc
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600: give the file the mode open() would
        os.replace(tmp, path)
    except OSError as exc:
        raise KvtoolError(f"cannot write '{path}': {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_json_atomic(path: str | Path, payload: dict | list) -> Path:
    """Write ``payload`` as indented JSON; a crash mid-write leaves any old file intact."""

    def write(tmp: str) -> None:
        with open(tmp, "w") as handle:
            json.dump(payload, handle, indent=2, default=str)

    return atomic_write(path, write)
