"""Where layer-by-layer calibration keeps what it has finished: in memory, or in a checkpoint folder.

A checkpoint folder sits next to the output, ``<out>.ckpt/``:

    state.json              {"format": ..., "key": {...}, "state": {...}} (what run, how far it got)
    <name>.safetensors      named tensor groups (hidden states, one file per finished layer, ...)
    lock                    held (flock) while a process writes the folder

Every file is written atomically (temporary file, fsync, rename) and state.json is written
after the tensors it points to, so a process killed at any instant leaves a folder that
resumes from the last finished step. Tensors are safetensors, metadata JSON: never pickle.
``key`` says what the run computes (recipe, data windows, model, batch size); a resumed
run with another key is refused, naming what differs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from kvtool.errors import KvtoolError
from kvtool.fileio import atomic_write, write_json_atomic

FORMAT = "kvtool.calibration-checkpoint/1"


class CheckpointError(KvtoolError):
    """A calibration checkpoint cannot be used (another run's, locked by another process, unreadable)."""


def checkpoint_dir_for(out: str | Path) -> Path:
    """The checkpoint folder of an output file: ``model.safetensors`` -> ``model.safetensors.ckpt``."""
    out = Path(out)
    return out.parent / f"{out.name}.ckpt"


class MemoryStore:
    """Tensor groups and state in memory: layer-by-layer calibration without checkpoints."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, torch.Tensor]] = {}
        self.state: dict[str, Any] = {}

    def save(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self.groups[name] = {k: v.detach().cpu() for k, v in tensors.items()}

    def load(self, name: str) -> dict[str, torch.Tensor]:
        return dict(self.groups[name])

    def tensor(self, name: str, key: str) -> torch.Tensor | None:
        return self.groups[name].get(key)

    def has(self, name: str) -> bool:
        return name in self.groups

    def delete(self, name: str) -> None:
        self.groups.pop(name, None)

    def set_state(self, **fields: Any) -> None:
        self.state.update(fields)

    def close(self, remove: bool = False) -> None:
        self.groups.clear()


class CheckpointStore(MemoryStore):
    """Tensor groups as safetensors files and the state as JSON in a folder; see the module docstring."""

    def __init__(self, folder: str | Path, key: dict[str, Any], resume: bool) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.key = json.loads(json.dumps(key, default=str))
        self._lock = None
        self._acquire()
        self.state = self._resumed_state() if resume else {}
        if not self.state:
            self._clear()
            self._write_state()

    # --- locking and state ----------------------------------------------------------------------
    def _acquire(self) -> None:
        import fcntl

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle = open(self.folder / "lock", "a+")
        except OSError as exc:
            raise CheckpointError(f"cannot create the checkpoint folder '{self.folder}': {exc}") from exc
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise CheckpointError(
                f"another kvtool calibrate is writing '{self.folder}' (the same --out); "
                "wait for it to finish or write to another --out"
            ) from None
        self._lock = handle

    def _resumed_state(self) -> dict[str, Any]:
        path = self.folder / "state.json"
        if not path.is_file():
            return {}  # nothing to resume: start from the first layer
        try:
            saved = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"checkpoint '{path}' is unreadable ({exc}); delete '{self.folder}' and start over") from exc
        if not isinstance(saved, dict) or saved.get("format") != FORMAT or not isinstance(saved.get("state"), dict):
            raise CheckpointError(f"'{path}' is not a kvtool calibration checkpoint of this version; delete '{self.folder}'")
        differs = sorted(k for k in set(self.key) | set(saved.get("key", {})) if self.key.get(k) != saved["key"].get(k))
        if differs:
            raise CheckpointError(
                f"checkpoint '{self.folder}' belongs to another calibration ({', '.join(differs)} differ); "
                "run without --resume to start over, or resume with the same model, recipe, data and batch size"
            )
        return saved["state"]

    def _clear(self) -> None:
        for path in self.folder.iterdir():
            if path.name != "lock":
                path.unlink() if path.is_file() else shutil.rmtree(path)

    def _write_state(self) -> None:
        write_json_atomic(self.folder / "state.json", {"format": FORMAT, "key": self.key, "state": self.state})

    def set_state(self, **fields: Any) -> None:
        self.state.update(fields)
        self._write_state()

    # --- tensors --------------------------------------------------------------------------------
    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def save(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        atomic_write(self._path(name), lambda tmp: save_file(flat, tmp))

    def load(self, name: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        try:
            return load_file(str(self._path(name)))
        except Exception as exc:  # missing or corrupt file: safetensors raises its own types
            raise CheckpointError(f"checkpoint file '{self._path(name)}' is missing or corrupt ({exc}); "
                                  f"delete '{self.folder}' and start over") from exc

    def tensor(self, name: str, key: str) -> torch.Tensor | None:
        from safetensors import safe_open

        with safe_open(str(self._path(name)), framework="pt") as handle:
            return handle.get_tensor(key) if key in handle.keys() else None

    def has(self, name: str) -> bool:
        return self._path(name).is_file()

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            pass

    def close(self, remove: bool = False) -> None:
        """Release the lock; ``remove``: delete the folder (the run finished and its output is written)."""
        if remove:
            self._clear()
            os.unlink(self.folder / "lock")
            self.folder.rmdir()
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def remove_checkpoint(folder: str | Path) -> None:
    """Delete a finished run's checkpoint folder (its output is written); missing is fine."""
    shutil.rmtree(folder, ignore_errors=True)
