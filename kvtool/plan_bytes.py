"""The bytes kvtool's cache holds at a context and batch, predicted from the recipe (what `kvtool plan` ranks by).

Everything follows the rules the paged store (`kvtool.runtime.store`) and eviction
(`kvtool.runtime.eviction`) follow; block sizes come from empty stores built as the runtime
builds them (`BlockQuantizer.block_nbytes`, fitted ranks included, the per-slot metadata of
the policy). Per layer and stream (one sequence x KV head group):

* **nothing evicted**: every token; sinks and the recent window in float blocks of 16
  tokens, the rest in encoded body blocks of ``cache.block_size`` (`stream_split`). A
  sliding-window layer holds its window (and a position per token) once the context is
  past the rule's limit.
* **evicted, budgeted policies** (StreamingLLM, H2O, SnapKV, TOVA, VATP, KNorm, ChunkKV,
  PyramidInfer, PyramidKV budgets): the worst case the runtime can hold at context C. A
  stream is cut back to its budget b_l(C) (the runtime's own budget rule: fraction of the
  sequence or absolute tokens, per-layer weights) once it holds ``interval`` tokens more,
  so between cuts it holds up to b_l(C) + interval - 1 tokens (never more than C); every
  length in between is reached by some prefill length followed by decoding. On a
  sliding-window layer the budget is the share of the window (`WindowedBudget`) and the
  window's rule frees what no query sees once a stream holds its limit + interval - 1
  tokens, so a stream holds at most the smaller of the two. A float store
  holds ceil(n / 16) blocks. A quantized store (the kept tokens also quantized): kept body
  blocks are freed whole and the kept float tokens are flushed into body blocks once
  ``recent + block`` of them wait, so which split of n tokens into float and body the
  policy leaves depends on the text; the prediction is the largest split that is possible
  (at most sinks + recent + block - 1 float tokens), an upper bound.
* AdaKV (``head_budgets: adaptive``): a sequence's streams share their summed budget, so
  one stream may hold more than another; the sequence never holds more tokens than the
  uniform split, and at most one partly filled float block per stream more (an upper bound).

Not predicted (`unpredictable_reason` says why): FastGen (no budget: what each head keeps
depends on the text's token classes), CAKE (per-layer budgets from the attention it
measures on the prompt, and larger cascade shares until the first decoded token), budgets
from a profile, and AdaKV on quantized blocks.
"""

from __future__ import annotations

import torch

from kvtool.errors import RecipeError
from kvtool.recipe import Recipe
from kvtool.runtime.eviction import SlidingWindowRule, WindowedBudget, layer_policy
from kvtool.runtime.layer import build_formats, summary_tokens, slot_meta, storage_dtype, token_sum_layout
from kvtool.runtime.store import LayerStore, StoreLayout

INDEX_BYTES = 4  # int32 block-table entries
LENGTH_BYTES = 8  # int64 lengths


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def unpredictable_reason(recipe: Recipe) -> str | None:
    """Why the plan cannot predict the bytes of ``recipe`` honestly, or None when it can."""
    spec = recipe.eviction
    if not recipe.evicts:
        return None
    if spec.policy == "fastgen":
        return ("FastGen has no budget: each KV head keeps the special tokens, punctuation and local/frequent fractions "
                "its rule names (profiled, or chosen from each prompt), so how many tokens stay depends on the text")
    if spec.policy == "rocketkv":
        return ("RocketKV cuts the prompt once and then keeps every generated token, so the bytes depend on how much of "
                "the context is prompt")
    if spec.policy == "cake":
        return ("CAKE splits the budget among layers by the attention preferences it measures on each prompt and holds "
                "its larger cascade shares until the first decoded token, so the bytes depend on the text")
    if spec.layer_budgets == "profile":
        return "its per-layer budgets come from a `kvtool profile` run, which the plan does not take (use uniform or pyramid)"
    if spec.head_budgets == "adaptive" and any(_quantized(recipe.for_override(o)) for o in recipe.layer_overrides):
        return "AdaKV shares each sequence's budget unevenly among its heads; with quantized layers (layer_overrides) the bytes are not bounded tightly"
    if spec.head_budgets == "adaptive" and _quantized(recipe):
        return ("AdaKV shares each sequence's budget unevenly among its heads, and on quantized blocks the bytes of an "
                "uneven split are not bounded tightly (use head_budgets: uniform)")
    return None


def check_predictable(recipe: Recipe) -> None:
    reason = unpredictable_reason(recipe)
    if reason is not None:
        raise RecipeError(f"kvtool plan cannot predict the cache bytes of recipe '{recipe.name}': {reason}; leave it out of --recipe")


def _quantized(recipe: Recipe) -> bool:
    return recipe.quantizes or recipe.keys.pre_rope


def stream_split(recipe: Recipe, tokens: int) -> tuple[int, int]:
    """(float tokens, body blocks) one stream holds after ``tokens`` tokens, as `LayerStore.append` leaves them."""
    if not _quantized(recipe):
        return tokens, 0
    sinks = min(recipe.cache.sink_tokens, tokens)
    rest = tokens - sinks
    body = max(rest - recipe.cache.recent_tokens, 0) // recipe.cache.block_size
    return sinks + rest - body * recipe.cache.block_size, body


def _split_bytes(store: LayerStore, float_tokens: int, body_blocks: int) -> int:
    """Bytes of one stream's blocks and block-table entries."""
    float_blocks = _ceil_div(float_tokens, store.fbs)
    total = float_blocks * store.float_pool.block_nbytes() + (float_blocks + body_blocks) * INDEX_BYTES
    if store.body_pool is not None:
        total += body_blocks * store.body_pool.block_nbytes()
    return total


def _largest_split(recipe: Recipe, store: LayerStore, tokens: int) -> int:
    """Most bytes a quantized evicting stream of at most ``tokens`` tokens can hold (any reachable float/body split)."""
    bs = recipe.cache.block_size
    most_float = min(tokens, recipe.cache.sink_tokens + recipe.cache.recent_tokens + bs - 1)
    return max(_split_bytes(store, f, (tokens - f) // bs) for f in range(most_float + 1))


def _empty_store(recipe: Recipe, fitted: dict, geometry, dtype: torch.dtype, policy, window: int | None = None) -> LayerStore:
    """A store with no streams, laid out as the runtime lays out this layer's (its pools give the block sizes)."""
    prefix = lambda part: {k[len(part) + 1 :]: v for k, v in fitted.items() if k.startswith(f"{part}.")}  # noqa: E731
    key_format, value_format, g = build_formats(recipe, prefix, geometry.head_dim, geometry.num_kv_heads, dtype)
    layout = StoreLayout(block_size=recipe.cache.block_size, heads_per_stream=g, head_dim=geometry.head_dim,
                         float_dtype=dtype, quantized=_quantized(recipe), sink_tokens=recipe.cache.sink_tokens,
                         recent_tokens=recipe.cache.recent_tokens, meta=slot_meta(policy),
                         summary_tokens=summary_tokens(recipe), float_block=recipe.cache.float_block_size,
                         **token_sum_layout(recipe, window))
    return LayerStore(layout, key_format, value_format, 0, "cpu")


def _kept_bytes(recipe: Recipe, store: LayerStore, tokens: int) -> int:
    """Bytes of one stream holding ``tokens`` it did not evict (in token order)."""
    return _split_bytes(store, *stream_split(recipe, tokens))


def _evicting_sequence_bytes(recipe: Recipe, store: LayerStore, budget: int, context: int, streams: int,
                             most: int | None = None) -> int:
    """Worst-case bytes of one sequence's ``streams`` streams of an evicting layer with budget ``budget`` at ``context``
    (``most``: tokens a sliding-window layer's rule lets a stream hold, or None)."""
    tokens = min(context, budget + recipe.eviction.interval - 1)  # most a stream holds between two cuts
    if most is not None:
        tokens = min(tokens, most)
    if recipe.eviction.head_budgets == "adaptive":  # a float store (see unpredictable_reason): blocks of the shared total
        fbs = store.fbs
        blocks = min((streams * tokens + streams * (fbs - 1)) // fbs, streams * _ceil_div(context, fbs))
        return blocks * (store.float_pool.block_nbytes() + INDEX_BYTES)
    if _quantized(recipe):
        return streams * _largest_split(recipe, store, tokens)
    return streams * _kept_bytes(recipe, store, tokens)


def predict_layer_bytes(runtime, context: int, batch: int, dtype: torch.dtype | None = None) -> list[int]:
    """Per layer, the bytes its store and lengths hold at ``context`` tokens of ``batch`` unpadded sequences.

    Recipes that evict: the worst case between two cuts (module docstring). Each layer is predicted with
    its own resolved recipe (`Recipe.for_layer`: ``layer_overrides`` applied). runtime: a
    `CompressedRuntime` (its recipe, fitted tensors, eviction policy and budget rule); dtype: the
    K/V dtype the model produces (default: the model's parameter dtype).
    """
    recipe = runtime.recipe
    check_predictable(recipe)
    geometry = runtime.adapter.geometry
    store_dtype = storage_dtype(recipe, dtype or next(runtime.model.parameters()).dtype)
    policy, budget_rule = runtime._eviction_parts() if recipe.evicts else (None, None)
    windows = tuple(geometry.sliding_windows)
    out = []
    for index, fitted in enumerate(runtime.layer_tensors):
        layer = recipe.for_layer(index)  # its layer_overrides applied
        window = windows[index] if index < len(windows) else None
        rule = SlidingWindowRule(window, layer.cache.block_size if _quantized(layer) else 0) if window else None
        evicting, layer_rule = layer_policy(policy, budget_rule, index)  # none where a layer keeps everything
        store = _empty_store(layer, fitted, geometry, store_dtype, evicting or rule, window)
        per_sequence = geometry.num_kv_heads // store.layout.heads_per_stream  # streams of one sequence
        if evicting is not None:  # budgeted (check_predictable); on a sliding-window layer a share of the window
            layer_budget = WindowedBudget(layer_rule, window) if rule is not None else layer_rule
            budget = int(layer_budget(index, torch.tensor([context]))[0])
            most = rule.limit + rule.spec.interval - 1 if rule is not None else None
            total = batch * _evicting_sequence_bytes(layer, store, budget, context, per_sequence, most)
        else:
            tokens = window if rule is not None and context > rule.limit else context  # past the limit: the window
            total = batch * per_sequence * _kept_bytes(layer, store, tokens)
        streams = batch * per_sequence
        total += streams * 3 * LENGTH_BYTES + (batch + streams) * LENGTH_BYTES  # store lengths, layer lengths
        out.append(total)
    return out


def predict_cache_bytes(runtime, context: int, batch: int, dtype: torch.dtype | None = None) -> int:
    """Bytes the runtime's cache holds at ``context`` tokens of ``batch`` unpadded sequences (see `predict_layer_bytes`)."""
    total = sum(predict_layer_bytes(runtime, context, batch, dtype))
    recipe = runtime.recipe
    if recipe.keys.pre_rope and (not recipe.evicts or recipe.eviction.sliding_budget is not None):  # positions of each
        # sequence's tokens (layers without a policy read their pre-RoPE keys' positions there)
        total += batch * context * 4 + batch * LENGTH_BYTES
    return total


def fp16_cache_bytes(geometry, context: int, batch: int) -> int:
    """transformers' own 16-bit K and V cache for the same tokens: every token of a global layer, the last W - 1
    of a sliding-window layer of window W (as `KvtoolCache.fp16_nbytes`)."""
    windows = tuple(geometry.sliding_windows) + (None,) * geometry.num_layers
    tokens = sum(min(context, w - 1) if w else context for w in windows[: geometry.num_layers])
    return 2 * geometry.num_kv_heads * geometry.head_dim * 2 * tokens * batch
