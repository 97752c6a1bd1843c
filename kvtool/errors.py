"""Errors a user can hit. Each says what was wrong, where, and what to do.

The CLI prints any `KvtoolError` without a traceback and exits with status 2.
"""


class KvtoolError(Exception):
    """Base class of every error kvtool raises on purpose."""


class RecipeError(KvtoolError):
    """A recipe file or value is invalid (names the field path)."""


class DataError(KvtoolError):
    """Calibration or evaluation data is missing, empty or too short."""


class ModelError(KvtoolError):
    """The model cannot be loaded or its architecture is not supported."""


class ArtifactError(KvtoolError):
    """An artifact file is missing, truncated, corrupt, of an unknown version, or for another model."""


class RuntimeConfigError(KvtoolError):
    """A runtime request cannot be served (context beyond the model's limit, bad batch, ...)."""
