"""Attach kvtool's compressed cache to an unmodified transformers model.

`CompressedRuntime` is the bridge from an artifact (or a bare recipe) to caches:
it validates the artifact against the model before anything runs, builds the
per-layer plans, and makes a fresh `CompressedCache` per generation. The model
is not changed: the cache is passed as ``past_key_values`` to ``forward`` or
``generate`` and the model's own attention runs over the K/V it returns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvtool.artifact import Artifact, check_model
from kvtool.calibration import build_quantizers, needs_fit
from kvtool.errors import RecipeError, RuntimeConfigError
from kvtool.models.adapter import ModelAdapter, adapter_for
from kvtool.recipe import Recipe, recipe_from_dict
from kvtool.runtime.cache import CompressedCache, LayerPlan
from kvtool.runtime.positions import PositionProbe, PositionTracker


def uncompressed_recipe(float_dtype: str = "model") -> Recipe:
    """The no-op recipe: keys and values stored as floats, nothing quantized (the baseline)."""
    base = Recipe(name="uncompressed").with_bits(16)
    return dataclasses.replace(base, name="uncompressed", cache=dataclasses.replace(base.cache, float_dtype=float_dtype))


@dataclass
class CompressedRuntime:
    """A model, its adapter, a validated recipe and per-layer fitted tensors."""

    model: object
    adapter: ModelAdapter
    recipe: Recipe
    layer_tensors: list[dict]
    probe: PositionProbe | None = None

    @classmethod
    def from_recipe(cls, model, recipe: Recipe, layer_tensors: list[dict] | None = None) -> "CompressedRuntime":
        adapter = adapter_for(model)
        geometry = adapter.geometry
        if layer_tensors is None and needs_fit(recipe):
            raise RecipeError(
                f"recipe '{recipe.name}' uses a method that learns from calibration data (nuq); "
                "run `kvtool calibrate` and `kvtool export`, then pass the artifact (--artifact)"
            )
        tensors = layer_tensors or [{} for _ in range(geometry.num_layers)]
        build_quantizers(recipe, geometry.head_dim, fitted=tensors[0])  # fails early if the recipe cannot fit the model
        return cls(model=model, adapter=adapter, recipe=recipe, layer_tensors=tensors)

    @classmethod
    def from_artifact(cls, model, artifact: Artifact) -> "CompressedRuntime":
        """Validate a deployable artifact against the model, then build the runtime."""
        adapter = adapter_for(model)
        check_model(artifact, adapter.fingerprint())
        recipe = recipe_from_dict(artifact.manifest["recipe"])
        tensors = [artifact.layer_tensors(i) for i in range(adapter.geometry.num_layers)]
        return cls.from_recipe(model, recipe, tensors)

    def new_cache(self) -> CompressedCache:
        """A fresh, empty compressed cache for one generate/forward session."""
        plans = [LayerPlan(self.recipe, fitted) for fitted in self.layer_tensors]
        tracker = None
        if self.recipe.keys.pre_rope:
            if self.probe is None:  # one hook per runtime, installed on first need
                self.probe = PositionProbe(self.adapter.rotary_emb)
            tracker = PositionTracker(self.probe, lambda pos: self.adapter.rope_cos_sin(pos, torch.float32))
        return CompressedCache(plans, tracker)

    def check_context(self, tokens: int) -> None:
        """Refuse contexts beyond the model's position limit."""
        check_context(self.adapter, tokens)


def check_context(adapter: ModelAdapter, tokens: int) -> None:
    """Refuse contexts beyond the model's position limit, with the fix."""
    limit = adapter.geometry.max_positions
    if tokens > limit:
        raise RuntimeConfigError(
            f"{tokens} tokens exceed the model's context limit of {limit} positions; "
            "shorten the prompt or lower --max-new-tokens / --seq-len"
        )
