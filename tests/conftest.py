"""Shared fixtures: paths to ../shared (real models and text), the real pretrained test models, cached real models."""

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors under the interpreter; it must be chosen before Triton is
# imported (kvtool imports it only when the triton backend is used).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter import skip_repatching_inside_launches

    skip_repatching_inside_launches()  # about 30% of an interpreted kernel test's time: tests/triton_interpreter.py

SHARED = Path(__file__).resolve().parents[1].parent / "shared"

MAX_TEST_WORKERS = 4  # `-n auto` (the README's test command): each worker loads its own real models (~1.5 GB)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core, at most MAX_TEST_WORKERS (memory), at least 1."""
    return max(1, min(MAX_TEST_WORKERS, _cores()))


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist each worker takes its share of the cores for torch (two workers x two threads on two cores
    would each run slower than one thread: oversubscription), so a timing or thread-count-dependent test sees the
    same machine as a serial run would give it per core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, _cores() // workers))


_share_the_cores_among_workers()


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


TEST_MODELS_ENV = "KVTOOL_TEST_MODELS"


def test_model_path(name: str) -> Path:
    """A real pretrained model folder under $KVTOOL_TEST_MODELS (default ~/.cache/kvtool-test-models).

    `python ../shared/models/fetch_pretrained.py --install-deps` materializes them (.ci/run does).
    Missing: skipped with the reason, except under CI (``CI`` set), where the test fails.
    """
    root = Path(os.environ.get(TEST_MODELS_ENV) or Path.home() / ".cache" / "kvtool-test-models")
    path = root / name
    if not (path / "model.safetensors").exists():
        message = (
            f"{path} not found: real-model tests need `python ../shared/models/fetch_pretrained.py --install-deps` "
            f"(into ${TEST_MODELS_ENV}, default ~/.cache/kvtool-test-models)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


test_model_path.__test__ = False  # a helper, not a test


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct (Llama, 30 layers, 9 q / 3 KV heads), float32 on CPU."""
    from kvtool.models.loading import load_model

    return load_model(str(test_model_path("smollm2-135m")))


@pytest.fixture(scope="session")
def gemma3():
    """(model, tokenizer) of Gemma 3 270M (18 layers: 15 sliding-window 512, 3 global; MQA, head_dim 256), float32 on CPU."""
    from kvtool.models.loading import load_model

    return load_model(str(test_model_path("gemma3-270m")))


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
