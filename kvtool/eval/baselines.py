"""The one baseline every command reports against, and the model-dtype cache beside it.

Bytes, speed and quality deltas in `kvtool run`, `generate`, `eval ppl` and `eval retrieval`
are all relative to `BASELINE`, the **16-bit cache**: keys and values stored as float16,
nothing compressed (what a deployment holds). Where the model computes in another dtype
(float32 on CPU), a plain transformers cache holds that dtype instead; reports show it as
an extra row or figure (``model_dtype_*`` keys), never as the baseline.
"""

from __future__ import annotations

import dataclasses

import torch

from kvtool.recipe import Recipe
from kvtool.runtime.attach import uncompressed_recipe

BASELINE = "16-bit cache"


def sixteen_bit_recipe() -> Recipe:
    """Keys and values stored as float16, nothing compressed: the baseline of every report."""
    return dataclasses.replace(uncompressed_recipe("float16"), name=BASELINE)


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def model_dtype_name(model) -> str:
    return str(model_dtype(model)).replace("torch.", "")


def model_dtype_differs(model) -> bool:
    """True when the model's own cache would not be 16-bit (e.g. float32 on CPU)."""
    return model_dtype(model).itemsize != 2


def model_dtype_recipe(model) -> Recipe:
    """Keys and values stored in the model's dtype, nothing compressed (a plain transformers cache)."""
    return dataclasses.replace(uncompressed_recipe("model"), name=f"{model_dtype_name(model)} cache (model dtype)")


def is_model_dtype_cache(recipe: Recipe) -> bool:
    """True for a recipe that stores everything uncompressed in the model's dtype."""
    return recipe.is_noop and recipe.cache.float_dtype == "model" and not recipe.sparse_attention.enabled


def model_dtype_fields(model, fp16_cache_bytes: float) -> dict:
    """``baseline`` plus, where the model's dtype is not 16-bit, ``model_dtype`` and ``model_dtype_cache_bytes``."""
    fields = {"baseline": BASELINE}
    if model_dtype_differs(model):
        fields.update(model_dtype=model_dtype_name(model),
                      model_dtype_cache_bytes=fp16_cache_bytes * model_dtype(model).itemsize / 2)
    return fields
