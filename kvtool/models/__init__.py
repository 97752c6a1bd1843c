"""Model access: family adapters, RoPE math and loading."""

from kvtool.models.adapter import (
    ADAPTERS,
    ModelAdapter,
    ModelGeometry,
    adapter_for,
    compare_fingerprints,
)
from kvtool.models.loading import DEFAULT_MODEL_DIR, load_model, load_tokenizer, resolve_model_path
from kvtool.models.rope import apply_rope, rotate_half, unapply_rope

__all__ = [
    "ADAPTERS",
    "DEFAULT_MODEL_DIR",
    "ModelAdapter",
    "ModelGeometry",
    "adapter_for",
    "apply_rope",
    "compare_fingerprints",
    "load_model",
    "load_tokenizer",
    "resolve_model_path",
    "rotate_half",
    "unapply_rope",
]
