"""Model access: adapters (generic, with a small registry of family overrides), per-layer attention specs, RoPE and loading."""

from kvtool.models.adapter import (
    ADAPTERS,
    TESTED_FAMILIES,
    ModelAdapter,
    ModelGeometry,
    adapter_for,
    compare_fingerprints,
)
from kvtool.models.layer_spec import LayerAttentionSpec
from kvtool.models.loading import DEFAULT_MODEL_DIR, load_model, load_tokenizer, resolve_model_path
from kvtool.models.rope import RopeSpec, apply_rope, rotate_half, unapply_rope

__all__ = [
    "ADAPTERS",
    "DEFAULT_MODEL_DIR",
    "LayerAttentionSpec",
    "ModelAdapter",
    "ModelGeometry",
    "RopeSpec",
    "TESTED_FAMILIES",
    "adapter_for",
    "apply_rope",
    "compare_fingerprints",
    "load_model",
    "load_tokenizer",
    "resolve_model_path",
    "rotate_half",
    "unapply_rope",
]
