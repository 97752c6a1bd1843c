"""Shared fixtures: paths to ../shared (real models and text) and cached real models."""

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def shared_path(relative: str) -> Path:
    """A path under ../shared; the test is skipped (with the reason) where ../shared is not present."""
    path = SHARED / relative
    if not path.exists():
        pytest.skip(f"{path} not found: real-model tests need the shared/ folder beside the repository")
    return path


@pytest.fixture(scope="session")
def kvref():
    from kvtool.models.loading import load_model

    return load_model(str(shared_path("models/kvref-5m")))


@pytest.fixture(scope="session")
def stories():
    from kvtool.models.loading import load_model

    return load_model(str(shared_path("models/stories260K")))
