"""Shared fixtures: paths to ../shared (real models and text) and cached real models."""

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors under the interpreter; it must be chosen before Triton is
# imported (kvtool imports it only when the triton backend is used).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def shared_path(relative: str) -> Path:
    """A path under ../shared (a data slice suffix like ``[0:0.9]`` is kept).

    Where ../shared is missing the test is skipped with the reason, except under CI
    (``CI`` set), where a missing file fails the test: CI must never skip quality floors.
    """
    path = SHARED / relative
    on_disk = Path(str(path).split("[", 1)[0])
    if not on_disk.exists():
        message = f"{on_disk} not found: real-model tests need the shared/ folder beside the repository"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def kvref():
    from kvtool.models.loading import load_model

    return load_model(str(shared_path("models/kvref-5m")))


@pytest.fixture(scope="session")
def stories():
    from kvtool.models.loading import load_model

    return load_model(str(shared_path("models/stories260K")))


@pytest.fixture(scope="session")
def copy_model():
    """The induction ("copy") model of `kvtool.eval.copy_model`, trained once per session (seconds on a CPU)."""
    from kvtool.eval.copy_model import train_copy_model

    return train_copy_model(seed=0)
