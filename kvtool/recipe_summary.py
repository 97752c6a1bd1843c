"""What a recipe really does, in words a table can show: method and bits, float window, eviction.

Used by `kvtool recipes` and `kvtool inspect` instead of the raw recipe dict (which lists
fields that do not apply, e.g. a codebook for a uniform quantizer).
"""

from __future__ import annotations

from kvtool.recipe import QuantSpec, Recipe


def tensor_summary(spec: QuantSpec) -> str:
    """'uniform 4-bit per channel', 'nuq 3-bit ..., 1% outliers, pre-RoPE', 'palu 70% rank, 3-bit latents', 'not quantized'."""
    if spec.method == "none":
        return "not quantized"
    if spec.method == "palu":
        groups = {0: "all KV heads jointly", 1: "per KV head"}.get(spec.group_heads, f"groups of {spec.group_heads} KV heads")
        parts = [f"palu {spec.rank_fraction:.0%} rank {groups}"]
        parts.append("16-bit latents" if spec.bits == 16 else f"{spec.bits}-bit latents" + (" + Hadamard" if spec.hadamard else " + rotated basis" if spec.rotate_basis else ""))
        return ", ".join(parts)
    if spec.method == "turboquant":
        return turboquant_summary(spec)
    axis = "per channel" if spec.axis == "channel" else f"per token / {spec.group_size} ch"
    parts = [f"{spec.method} {spec.bits}-bit {axis}"]
    if spec.method == "nuq":
        parts.append(spec.codebook)
        if spec.outlier_fraction:
            parts.append(f"{spec.outlier_fraction:.0%} outliers")
        if spec.qnorm:
            parts.append("Q-Norm")
    if spec.pre_rope:
        parts.append("pre-RoPE")
    return ", ".join(parts)


def turboquant_summary(spec: QuantSpec) -> str:
    """'turboquant 2.5-bit, 25% outlier channels at 4-bit per block', 'turboquant 3-bit, QJL keys'."""
    parts = [f"turboquant {spec.bits + spec.extra_bits:g}-bit"]
    if spec.extra_bits:
        outlier_bits = spec.bits + round(spec.extra_bits / spec.outlier_channel_fraction)
        where = "calibrated per KV head" if spec.outlier_channels == "calibrated" else "per block"
        parts.append(f"{spec.outlier_channel_fraction:.1%} outlier channels at {outlier_bits}-bit {where}".replace(".0%", "%"))
    if spec.split_rotation == "kronecker":
        parts.append("Kronecker rotation")
    if spec.qjl:
        parts.append("1 bit QJL")
    if spec.channel_scale == "query":
        parts.append("channels scaled by the calibration queries")
    return ", ".join(parts)


def window_summary(recipe: Recipe) -> str:
    """The tokens kept as floats ahead of the compressed body, or that every token is a float."""
    cache = recipe.cache
    floats = "" if cache.float_block_size == 16 else f" (float blocks of {cache.float_block_size})"
    dtype = "int8 per token / 32 ch" if cache.float_dtype == "int8" else cache.float_dtype  # codes with their scales
    if not recipe.quantizes:
        return f"all tokens {dtype}{floats}"
    return f"{cache.sink_tokens} sink + {cache.recent_tokens} recent {dtype}{floats}, blocks of {cache.block_size}"


def eviction_summary(recipe: Recipe) -> str:
    """'h2o: keep 50%, 4 sink + 32 recent', 'fastgen T=0.95 (needs a profile)', or 'none'."""
    spec = recipe.eviction
    if not spec.enabled:
        return "none"
    if spec.policy == "fastgen":
        source = "head policies chosen from each prompt" if spec.fastgen_per_prompt else "needs a profile"
        return f"fastgen T={spec.threshold:g}, r_l={spec.local_ratio:g}, r_f={spec.frequent_ratio:g} ({source})"
    budget = f"{spec.budget_tokens} tokens" if spec.budget_tokens is not None else f"{spec.budget:.0%}"
    parts = [f"{spec.policy}: keep {budget}", f"{spec.sink_tokens} sink + {spec.window} recent"]
    if spec.sliding_budget is not None:
        parts[0] += f" ({spec.sliding_budget:.1%} of the window on sliding-window layers"
        for override in recipe.layer_overrides:
            if override.eviction:
                where = f"{override.kind} layers" if override.kind is not None else f"layers {list(override.layers)}"
                parts[0] += f"; {where}: {recipe.for_override(override).eviction.sliding_budget:.1%}"
        parts[0] += ")"
    from kvtool.methods.evict.base import policy_class

    if spec.window_share is not None and policy_class(spec.policy).observes_window:
        parts[-1] += f" (at prefill at most {spec.window_share:.1%} of the budget)"
    if spec.policy in ("snapkv", "rocketkv", "cake"):
        parts.append(f"{'mean' if spec.pools_by_mean else 'max'} pooling {spec.pooling}" if spec.pooling > 1 else "no pooling")
    if spec.policy == "rocketkv":
        parts[0] = f"rocketkv: keep {budget} of the prompt (generated tokens kept)"
    if spec.policy == "cake":
        parts.append(f"layer budgets from attention preferences (tau1 {spec.tau1:g}, tau2 {spec.tau2:g}, gamma {spec.gamma:g})")
    if spec.policy == "pyramidinfer":
        parts.append(f"budgets shrinking with depth (retention_decay {spec.retention_decay:g}; every layer still computed)")
    if spec.layer_budgets != "uniform":
        parts.append(f"{spec.layer_budgets} layer budgets")
    return ", ".join(parts)


def sparse_summary(recipe: Recipe) -> str:
    """'rocketkv: read 25% of the tokens per decode step, 2-token key summaries, 50% of channels'."""
    spec = recipe.sparse_attention
    text = (f"{spec.method}: read {spec.read_fraction:.0%} of the tokens per decode step (at least {spec.min_tokens}), "
            f"{spec.summary_tokens}-token key summaries, {spec.channels:.0%} of channels scored")
    extras = [f"{name} {value}" for name, value, paper in (
        ("channels by", spec.channel_score, "query"), ("unread", spec.unread, "drop"), ("budget", spec.read_budget, "per_head"),
    ) if value != paper]
    return text + (f" ({', '.join(extras)})" if extras else "")


def recipe_summary(recipe: Recipe) -> dict[str, str]:
    """{keys, values, float window, eviction}: what the recipe stores, drops (and, with sparse attention, reads)."""
    eviction = eviction_summary(recipe)
    if recipe.sparse_attention.enabled:
        eviction += f"; sparse attention {sparse_summary(recipe)}"
    return {
        "keys": _with_overrides(recipe, "keys"),
        "values": _with_overrides(recipe, "values"),
        "float window": window_summary(recipe),
        "eviction": eviction,
    }


def _with_overrides(recipe: Recipe, part: str) -> str:
    """'uniform 4-bit per channel; layers [0, 1]: uniform 2-bit per channel' (``layer_overrides`` of that part)."""
    text = tensor_summary(getattr(recipe, part))
    for override in recipe.layer_overrides:
        if getattr(override, part):
            where = f"{override.kind} layers" if override.kind is not None else f"layers {list(override.layers)}"
            text += f"; {where}: {tensor_summary(getattr(recipe.for_override(override), part))}"
    return text
