"""Attach kvtool's cache to an unmodified transformers model.

`CompressedRuntime` is the bridge from an artifact (or a bare recipe) to caches:
it validates the artifact against the model before anything runs, builds the
per-layer plans, resolves the backend once, and makes a fresh `KvtoolCache` per
generation. The model's weights are not changed: the cache is passed as
``cache`` (``past_key_values`` before transformers 5.24, `kvtool.models.cache_argument`) to
``forward`` or ``generate``; the model is switched to kvtool's
attention function (plain SDPA for any other cache), through which the cache computes
attention over its compressed storage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from kvtool.artifact import Artifact, check_model
from kvtool.calibration import build_quantizers, needs_fit
from kvtool.errors import RecipeError, RuntimeConfigError
from kvtool.models.adapter import ModelAdapter, adapter_for
from kvtool.recipe import EvictionSpec, Recipe, recipe_from_dict
from kvtool.recipe_layers import check_layer_count, check_sliding_overrides, resolve_layer_kinds
from kvtool.methods.budget.pyramid import layer_budgets
from kvtool.methods.evict.base import EvictionPolicy, policy_class
from kvtool.methods.evict.fastgen import choose_policies
from kvtool.models.attention_hook import install
from kvtool.runtime.backend import resolve_backend
from kvtool.runtime.cache import CacheContext, KvtoolCache
from kvtool.runtime.eviction import BudgetRule
from kvtool.runtime.layer import LayerPlan
from kvtool.runtime.prefill_shrink import PrefillShrink
from kvtool.runtime.positions import ForwardProbes, RopeTable


def uncompressed_recipe(float_dtype: str = "model") -> Recipe:
    """The no-op recipe: keys and values stored as floats, nothing quantized (the baseline)."""
    base = Recipe(name="uncompressed").with_bits(16)
    return dataclasses.replace(base, name="uncompressed", cache=dataclasses.replace(base.cache, float_dtype=float_dtype))


@dataclass
class CompressedRuntime:
    """A model, its adapter, a validated recipe, per-layer fitted tensors and the backend."""

    model: object
    adapter: ModelAdapter
    recipe: Recipe
    layer_tensors: list[dict]
    profile: dict[str, torch.Tensor] | None = None  # `kvtool profile` tensors (FastGen policies, layer budgets)
    backend: str = "torch"
    probes: ForwardProbes | None = None
    formats: dict = dataclasses.field(default_factory=dict)  # block formats per layer, shared by every cache

    @classmethod
    def from_recipe(
        cls,
        model,
        recipe: Recipe,
        layer_tensors: list[dict] | None = None,
        profile: dict[str, torch.Tensor] | None = None,
        backend: str = "auto",
    ) -> "CompressedRuntime":
        adapter = adapter_for(model)
        geometry = adapter.geometry
        if layer_tensors is None and needs_fit(recipe):
            raise RecipeError(
                f"recipe '{recipe.name}' uses a method that learns from calibration data (nuq, palu, static fp8 or int scales, "
                "turboquant channel_scale or calibrated outlier_channels); "
                "run `kvtool calibrate` and `kvtool export`, then pass the artifact (--artifact)"
            )
        tensors = layer_tensors or [{} for _ in range(geometry.num_layers)]
        recipe = resolve_layer_kinds(recipe, geometry.sliding_windows)  # layers: sliding / full -> indices
        check_layer_count(recipe, geometry.num_layers)
        check_sliding_overrides(recipe, geometry.sliding_windows)
        # one recipe per distinct per-layer override (layer_overrides), each checked as the whole recipe would be
        layer_recipes: dict[Recipe, int] = {}  # resolved recipe -> its first layer
        for index in range(geometry.num_layers):
            layer_recipes.setdefault(recipe.for_layer(index), index)
        ropes = RopeTable.from_adapter(adapter).ropes if recipe.keys.pre_rope else ()  # the kernel rotates pre-RoPE keys
        device = next(model.parameters()).device
        backends = set()
        for layer_recipe, index in layer_recipes.items():
            quantizers = build_quantizers(layer_recipe, geometry.head_dim, fitted=tensors[index])  # fails early if it cannot fit
            if recipe.evicts and any(q.heads_per_block != 1 for q in quantizers):
                raise RecipeError(
                    f"recipe '{recipe.name}': eviction keeps different tokens per KV head, but palu group_heads > 1 stores "
                    "one latent for a group of heads; use group_heads: 1 with eviction"
                )
            backends.add(resolve_backend(backend, device, layer_recipe, quantizers, ropes))
        resolved = "torch" if "torch" in backends else backends.pop()  # the kernel only when it reads every layer
        runtime = cls(model=model, adapter=adapter, recipe=recipe, layer_tensors=tensors, profile=profile, backend=resolved)
        if recipe.evicts:
            runtime._eviction_parts()  # fails early on a missing or mismatched profile
        return runtime

    @classmethod
    def from_artifact(cls, model, artifact: Artifact, backend: str = "auto") -> "CompressedRuntime":
        """Validate a deployable artifact against the model, then build the runtime."""
        adapter = adapter_for(model)
        check_model(artifact, adapter.fingerprint())
        recipe = recipe_from_dict(artifact.manifest["recipe"])
        tensors = [artifact.layer_tensors(i) for i in range(adapter.geometry.num_layers)]
        profile = {k[len("profile.") :]: v for k, v in artifact.tensors.items() if k.startswith("profile.")}
        return cls.from_recipe(model, recipe, tensors, profile or None, backend=backend)

    def new_cache(self) -> KvtoolCache:
        """A fresh, empty cache for one generate/forward session (switches the model to kvtool attention)."""
        install(self.model)
        policy, budget = self._eviction_parts() if self.recipe.evicts else (None, None)
        if self.probes is None:  # one set of hooks per runtime, installed on first need
            self.probes = ForwardProbes(self.model, self.adapter.rotary_emb, record_ids=True)
        if self.recipe.eviction.compute_kept_only:  # PyramidInfer's prefill: deeper layers compute fewer tokens
            PrefillShrink.install(self.model, self.adapter.layers)
        profile = self.profile or {}
        context = CacheContext(
            probes=self.probes,
            rope=RopeTable.from_adapter(self.adapter),
            sliding_windows=tuple(self.adapter.geometry.sliding_windows),
            policy=policy,
            budget=budget,
            special_ids=profile.get("tokens.special"),
            punct_ids=profile.get("tokens.punctuation"),
            # (pre-RoPE keys of a layer without a policy: also the layers a `sliding_budget` recipe evicts nothing on)
            needs_sequence_positions=self.recipe.keys.pre_rope and (policy is None or self.recipe.eviction.sliding_budget is not None),
            backend=self.backend,
            shared_formats=self.formats,
        )
        plans = [LayerPlan(self.recipe.for_layer(i), fitted) for i, fitted in enumerate(self.layer_tensors)]
        return KvtoolCache(plans, context, self.recipe)

    def check_context(self, tokens: int, fix: str = "lower --seq-len") -> None:
        """Refuse contexts beyond the model's position limit; ``fix`` names the option to lower."""
        check_context(self.adapter, tokens, fix)

    # --- eviction -----------------------------------------------------------------------------
    def _eviction_parts(self) -> tuple[EvictionPolicy, Callable[[int, torch.Tensor], torch.Tensor]]:
        spec, profile = self.recipe.eviction, self.profile or {}
        geometry = self.adapter.geometry
        if spec.needs_profile and not profile:
            raise RecipeError(
                f"recipe '{self.recipe.name}' (eviction.policy {spec.policy}, layer_budgets {spec.layer_budgets}) "
                "needs a profile: run `kvtool profile` and pass it (--profile), or export it into the artifact"
            )
        if spec.fastgen_per_prompt:
            check_token_classes(self.recipe.name, profile)
        policies = profile.get("heads.policy")
        if spec.fastgen_offline and (policies is None or tuple(policies.shape) != (geometry.num_layers, geometry.num_kv_heads)):
            raise RecipeError(
                f"the profile's heads.policy has shape {None if policies is None else tuple(policies.shape)}, "
                f"expected ({geometry.num_layers}, {geometry.num_kv_heads}) for this model; profile this model again"
            )
        if spec.fastgen_offline:
            profile = {**profile, "heads.policy": fastgen_head_policies(spec, profile)}
        weights = layer_budgets(spec, geometry.num_layers, profile.get("layers.budget_weight"))
        policy = policy_class(spec.policy)(spec, profile)
        sliding = frozenset(i for i, window in enumerate(geometry.sliding_windows) if window)  # `sliding_budget`'s layers
        per_layer = {i: self.recipe.for_layer(i).eviction.sliding_budget for i in sliding}  # layer_overrides' shares
        rule = BudgetRule(spec.budget, spec.budget_tokens, policy.layer_weights(weights), sliding, spec.sliding_budget, per_layer)
        # (PyramidInfer: its own pyramid)
        # CAKE: budgets from the preferences it measures
        return policy, policy.budget_rule(rule, geometry.num_layers, tuple(geometry.sliding_windows))


def check_token_classes(recipe_name: str, profile: dict[str, torch.Tensor]) -> None:
    """FastGen chosen per prompt needs the tokenizer's special and punctuation ids (``tokens.*``), not a profile."""
    if "tokens.special" not in profile or "tokens.punctuation" not in profile:
        raise RecipeError(
            f"recipe '{recipe_name}' (FastGen, profile_source prompt) needs the tokenizer's special and punctuation "
            "token ids: pass profile=fastgen_token_classes(tokenizer) (kvtool.methods.evict.fastgen) to "
            "CompressedRuntime.from_recipe, or load through kvtool's CLI / kvtool.load, which do it"
        )


def fastgen_settings(spec: EvictionSpec) -> torch.Tensor:
    """The FastGen settings a profile was measured with: [threshold, local_ratio, frequent_ratio, sink_tokens]."""
    return torch.tensor([spec.threshold, spec.local_ratio, spec.frequent_ratio, spec.sink_tokens], dtype=torch.float64)


def fastgen_head_policies(spec: EvictionSpec, profile: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-(layer, KV head) policies for the recipe's threshold, re-chosen from the profiled attention mass.

    The mass was measured with the profile's local/frequent ratios and sink tokens; a recipe with
    other values would apply policies the profile never measured, so it is refused.
    """
    settings = profile.get("fastgen.settings")
    if settings is not None:
        measured = {"local_ratio": float(settings[1]), "frequent_ratio": float(settings[2]), "sink_tokens": int(settings[3])}
        for name, value in measured.items():
            if abs(getattr(spec, name) - value) > 1e-9:
                raise RecipeError(
                    f"recipe field 'eviction.{name}' is {getattr(spec, name)} but the profile was measured with {value}; "
                    f"profile again with this recipe (`kvtool profile --recipe ...`) or set eviction.{name}: {value}"
                )
    if "heads.mass" in profile:
        return choose_policies(profile["heads.mass"], spec.threshold)
    return profile["heads.policy"]


def check_context(adapter: ModelAdapter, tokens: int, fix: str = "lower --seq-len") -> None:
    """Refuse contexts beyond the model's position limit; ``fix`` names the option to lower."""
    limit = adapter.geometry.max_positions
    if tokens > limit:
        raise RuntimeConfigError(f"{tokens} tokens exceed the model's context limit of {limit} positions; {fix}")
