"""One decoder layer of kvtool's cache: transformers' contract, attention over the store, storing.

Each forward, for one layer:

1. ``update`` (called by the attention module with the new K/V after RoPE) keeps them for
   the attention call that follows and claims that call (`claim_next_attention`);
2. kvtool's attention function hands the call to `KvtoolLayer.attend`, which computes the
   attention of the new queries over the tokens the store holds (read in their storage
   format, chunk by chunk, never rebuilt as a float cache) and over the new tokens
   themselves, in float, as in a real prefill; a forward of many new tokens reads each
   chunk decoded once into a bounded float temporary and runs fused attention over it
   (`prefill_attention.py`);
3. when the recipe evicts, the policy decides per stream what stays (new tokens included);
4. the kept new tokens are written into the store (padding never is), where full blocks
   beyond the recent window are encoded once.

Shapes: B sequences, H KV heads of head_dim D in S = B x H/g streams of g heads, H_q =
G x H query heads; a stream's query rows are R = G x t (its G query heads x t new tokens).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from kvtool.errors import RuntimeConfigError
from kvtool.methods.evict.base import EvictionPolicy, StreamView
from kvtool.methods.sparse.rocketkv import Selection, select_groups, unread_blocks_term, unread_term
from kvtool.methods.registry import quantizer_class
from kvtool.models.attention_hook import claim_next_attention
from kvtool.recipe import Recipe
from kvtool.runtime import prefill_attention
from kvtool.runtime.eviction import SlidingWindowRule, SlotTable, WindowedBudget, choose, layer_policy, quiet_steps
from kvtool.runtime.formats import lift_format
from kvtool.runtime.paged_attention import (
    CHUNK_ELEMENTS, REUSE_ELEMENTS, Chunk, LayerOptions, Received, attend, attend_scored, attend_stored, chunk_tokens,
)
from kvtool.runtime.store import (
    BYTE_SLOT_DTYPES, INT8_SLOTS, LayerStore, StoreLayout, round_trip_float_slots, wide_float_dtype,
)
from kvtool.runtime.staging import to_device

SPECIAL, PUNCT = 1, 2  # bits of the FastGen token-class byte


@dataclass(frozen=True)
class LayerPlan:
    """What one layer's cache stores: the recipe plus this layer's fitted tensors (keys./values. prefixed)."""

    recipe: Recipe
    fitted: dict[str, torch.Tensor] = field(default_factory=dict)

    def fitted_for(self, part: str) -> dict[str, torch.Tensor]:
        prefix = f"{part}."
        return {k[len(prefix) :]: v for k, v in self.fitted.items() if k.startswith(prefix)}


FLOAT_DTYPE_NAMES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float8_e4m3": torch.float8_e4m3fn, "int8": INT8_SLOTS,
}


def storage_dtype(recipe: Recipe, model_dtype: torch.dtype) -> torch.dtype:
    """The float dtype of the cache's float blocks (``cache.float_dtype``; ``model`` = the model's own)."""
    name = recipe.cache.float_dtype
    return model_dtype if name == "model" else FLOAT_DTYPE_NAMES[name]


def build_formats(recipe: Recipe, fitted_for, head_dim: int, num_kv_heads: int, dtype: torch.dtype):
    """(key format, value format, heads per stream g) for one layer, both lifted to g heads per block. ``dtype``: the
    float blocks' (`storage_dtype`); the formats' floats (``none`` bodies, decoded blocks) are float16 beside float8
    float blocks."""
    dtype = wide_float_dtype(dtype)
    formats = []
    for spec, part in ((recipe.keys, "keys"), (recipe.values, "values")):
        quantizer = quantizer_class(spec.method)(spec, head_dim, recipe.cache.block_size, dtype, fitted_for(part))
        quantizer.check_kv_heads(num_kv_heads)
        formats.append(quantizer)
    g = math.lcm(*(f.heads_per_block for f in formats))
    return lift_format(formats[0], g), lift_format(formats[1], g), g


def slot_meta(policy) -> tuple[str, ...]:
    """Per-slot metadata a store keeps for an eviction policy or sliding-window rule (None: nothing)."""
    if policy is None:
        return ()
    meta = ["pos"]  # evicting: the original position of every kept token
    if policy.uses_attention:
        meta.append("score")
    if policy.uses_feature:
        meta.append("feature")
    if policy.uses_token_classes:
        meta.append("cls")
    return tuple(meta)


def summary_tokens(recipe: Recipe) -> int:
    """Slots per key summary the float blocks keep (sparse attention reads them; float-only recipes), 0 for none."""
    sparse = recipe.sparse_attention
    return sparse.summary_tokens if sparse.enabled and not (recipe.quantizes or recipe.keys.pre_rope) else 0


def token_sum_layout(recipe: Recipe, window: int | None) -> dict[str, bool]:
    """`StoreLayout`'s ``token_sums`` / ``key_squares`` for a layer: the float blocks keep the sums of their keys and
    values when sparse attention estimates what it does not read or ranks channels by the keys' spread, and of their
    squared keys for the latter; a sliding-window layer (``window``) reads its window whole and keeps none."""
    sparse = recipe.sparse_attention
    sums = bool(summary_tokens(recipe)) and not window and (sparse.unread != "drop" or sparse.channel_score == "query_key")
    return {"token_sums": sums, "key_squares": sums and sparse.channel_score == "query_key"}


def new_token_mask(attention_mask: torch.Tensor | None, b: int, t: int, device, all_real=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """((B, t, t) bool: which new tokens each new query may see, (B, t) bool real tokens or None = all).

    kvtool's cache asks transformers for a mask over the new tokens only (`get_mask_sizes`);
    padding tokens see nothing, not even themselves, so the diagonal marks the real ones.
    ``all_real(attention_mask, t, real)``: how to read whether every token is real (`CacheContext.all_real`, once
    per forward); default ``bool(real.all())``.
    """
    if attention_mask is None:
        return _causal(t, device).expand(b, t, t), None
    mask = attention_mask[:, 0, :, -t:]
    if mask.dtype != torch.bool:  # additive float mask
        mask = mask == 0
    mask = mask.expand(b, t, t)
    real = mask.diagonal(dim1=1, dim2=2)
    every = all_real(attention_mask, t, real) if all_real is not None else bool(real.all())
    return mask, (None if every else real)


_CAUSAL: dict[tuple[int, torch.device], torch.Tensor] = {}


def _causal(t: int, device) -> torch.Tensor:
    """(t, t) bool lower-triangular mask, read only; kept for short forwards (every decode step of every layer asks)."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    held = _CAUSAL.get((t, device))
    if held is None:
        held = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        if t <= 64:
            _CAUSAL[(t, device)] = held
    return held


def _stream_mask(mask: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """(B, t, t) per-sequence new-token mask -> (S, R, t): per stream, its R = ``heads`` x t rows (head-major)."""
    b, t, _ = mask.shape
    return mask[:, None].expand(b, heads, t, t).reshape(b, heads * t, t).repeat_interleave(groups, dim=0)


def _decoding_real_tokens(attention_mask: torch.Tensor | None, all_real=None) -> bool:
    """A one-token forward whose new token is real in every sequence (no padding column at the end); ``all_real`` as
    in `new_token_mask`."""
    if attention_mask is None:
        return True
    last = attention_mask[:, 0, 0, -1]
    real = last if last.dtype == torch.bool else last == 0  # (B,)
    return all_real(attention_mask, 1, real) if all_real is not None else bool(real.all())


class KvtoolLayer(CacheLayerMixin):
    """One decoder layer of `KvtoolCache` (see the module docstring)."""

    is_sliding = False
    is_croppable = False
    is_compileable = False
    supports_early_init = False

    def __init__(self, index: int, plan: LayerPlan, context) -> None:
        super().__init__()
        self.index, self.plan, self.context = index, plan, context
        self.seen = 0  # token slots seen, padding included: transformers' logical length
        self._pending = None
        self._quiet_steps = 0  # decode steps in which no stream can reach its eviction point
        self._trim_next = False  # the next decode step cuts down to the budget (a budget that may shrink, after a prompt)
        self.policy = None  # the recipe's eviction policy, or a sliding window's rule (set with the store)
        self.window_rule = None  # a sliding-window layer's rule beside the recipe's policy (frees what no query sees)
        self.budget = None  # (layer, length (S,)) -> (S,) tokens a stream may keep: the policy's budget rule
        self.store: LayerStore | None = None
        self.stream_state: torch.Tensor | None = None  # (S,) int64 the policy keeps per stream (`StreamView.stream_state`)

    # --- transformers' CacheLayerMixin contract -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        recipe, context = self.plan.recipe, self.context
        store_dtype = storage_dtype(recipe, key_states.dtype)
        self.key_format, self.value_format, self.g = context.formats(self.index, self.plan, d, h, store_dtype)
        self.__dict__.pop("_kernel_formats_held", None)  # `_kernel_formats` of the formats and device chosen here
        self.heads, self.groups = h, h // self.g
        policy, self.budget = layer_policy(context.policy, context.budget, self.index)  # (None where nothing is evicted)
        window = context.sliding_window(self.index)
        block = recipe.cache.block_size if (recipe.quantizes or recipe.keys.pre_rope) else 0
        if policy is None and window:  # a sliding-window layer frees what no later query can see
            policy = self.budget = SlidingWindowRule(window, block)
        elif window:  # ... and beside the recipe's policy; a budgeted one keeps a share of the window
            self.window_rule = SlidingWindowRule(window, block)
            if policy.budgeted and not policy.window_aware_budgets:
                self.budget = WindowedBudget(self.budget, window)
        self.policy = policy
        layout = StoreLayout(
            block_size=recipe.cache.block_size, heads_per_stream=self.g, head_dim=d, float_dtype=store_dtype,
            quantized=recipe.quantizes or recipe.keys.pre_rope, sink_tokens=recipe.cache.sink_tokens, recent_tokens=recipe.cache.recent_tokens,
            meta=slot_meta(policy), summary_tokens=summary_tokens(recipe), float_block=recipe.cache.float_block_size,
            **token_sum_layout(recipe, window),
        )
        self.store = LayerStore(layout, self.key_format, self.value_format, b * self.groups, self.device)
        self.lengths = torch.zeros(b, dtype=torch.int64, device=self.device)  # real tokens each sequence has seen
        self.group_of_stream = torch.arange(self.groups, device=self.device).repeat(b)
        context.begin(b, self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Keep the new K/V (B, H, t, D) for the attention call that follows; return them as they came."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._pending = (key_states, value_states, self.seen)
        shrink = self.context.shrink  # PyramidInfer's prefill: this layer computes t of the forward's T tokens
        self.seen += shrink[1] if shrink is not None else key_states.shape[2]
        claim_next_attention(self)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.seen  # a mask over the new tokens only: the store holds no padding

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.store is not None:
            self.store.reset(0)
        self.is_initialized = False
        self.seen = 0
        self._pending = None
        self._quiet_steps = 0
        self._trim_next = False
        self.stream_state = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(torch.arange(self.lengths.shape[0], device=self.device)[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(torch.arange(self.lengths.shape[0], device=self.device).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvtool's cache cannot be cropped (assisted decoding is not supported)")

    def _select(self, sequences: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        sequences = sequences.to(self.device).long()
        self._quiet_steps = 0
        streams = (sequences[:, None] * self.groups + torch.arange(self.groups, device=self.device)).flatten()
        self.store.select_streams(streams)
        self.store.shrink()
        self.lengths = self.lengths[sequences]
        if self.stream_state is not None:
            self.stream_state = self.stream_state[streams]
        self.group_of_stream = torch.arange(self.groups, device=self.device).repeat(sequences.shape[0])
        if self.index == 0:
            self.context.select(sequences)

    # --- attention ----------------------------------------------------------------------------------
    def attend(self, module, query, key, value, attention_mask, scaling: float, **kwargs) -> torch.Tensor:
        """Attention of the new queries (B, H_q, t, D) over the store and the new tokens; then store. (B, t, H_q, D)."""
        try:
            out = self._attend(query, attention_mask, scaling, kwargs)
        except BaseException:
            self.context.end_layer(self.index, failed=True)
            raise
        self.context.end_layer(self.index)
        return out

    def _attend(self, query, attention_mask, scaling: float, kwargs: dict) -> torch.Tensor:
        new_k, new_v, seen_before = self._pending
        self._pending = None
        if query.shape[2] == 1 and self.context.backend == "numba":
            out = self._cpu_kernel_step(query, new_k, new_v, attention_mask, scaling, kwargs, seen_before)
            if out is not None:
                return out
        b, hq, t, d = query.shape
        g, groups, G = self.g, self.groups, hq // self.heads
        s, r = b * groups, G * t
        positions = self.context.positions(b, t, seen_before, query.device)  # (B, t)
        options = LayerOptions(
            scaling=scaling, softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"),
            sliding_window=kwargs.get("sliding_window") or self.context.sliding_window(self.index),
        )
        policy = self.policy
        scoring = policy is not None and policy.uses_attention and (t > 1 or policy.evicts_while_decoding)
        nk = new_k.float().reshape(b, groups, g, t, d).reshape(s, g, t, d)
        nv = new_v.float().reshape(b, groups, g, t, d).reshape(s, g, t, d)
        if (
            t == 1 and not self._empty() and not self._kernel_covers(1, scoring, options, None)
            and self._stores_first(options, s * g * r) and _decoding_real_tokens(attention_mask, self.context.all_real)
        ):  # a decode step that evicts and encodes nothing: store the token, then attend over the store alone
            self._store_new(nk, nv, None, positions, None, 1)
            q = (query.float() * scaling).reshape(s, g, r, d)
            chunks = self._chunks(s, r, options, trim=True)
            out, chunks = attend_stored(q, chunks, options, self._sink_logits(options.sinks, b, 1), scoring)
            if scoring:
                self._accumulate(Received(chunks=chunks))
            return out.reshape(b, hq, 1, d).transpose(1, 2).to(query.dtype)
        mask, real = new_token_mask(attention_mask, b, t, query.device, self.context.all_real)
        received = None
        if self._empty() and not scoring and options.softcap is None and options.sinks is None:
            out = _sdpa(query, new_k, new_v, mask, scaling)
        elif self._kernel_covers(t, scoring, options, real):
            q = (query.float() * scaling).reshape(s, G, d)  # (S, R, D): g = 1, t = 1
            sink_logits = self._sink_logits(options.sinks, b, t)
            precision = "half" if query.dtype in (torch.float16, torch.bfloat16) else "exact"  # the model's own products
            writes = self._kernel_writes(real)
            out = self._kernel_decode(
                q, nk[:, 0, 0], nv[:, 0, 0], options, None if sink_logits is None else sink_logits[:, 0], precision, writes,
                positions[:, 0], scoring,
            )
            out = out.reshape(b, hq, 1, d).transpose(1, 2).to(query.dtype)
            if writes:  # (only an empty store's step that scores, soft-caps or has sinks: else `_cpu_kernel_step`)
                self._count_kernel_write(b, positions, nk[:, 0, 0], nv[:, 0, 0])
                return out
        else:
            q = (query.float() * scaling).reshape(b, groups, g, G, t, d).reshape(s, g, r, d)
            query_pos = positions[:, None].expand(b, G, t).reshape(b, r).repeat_interleave(groups, dim=0)
            sink_logits = self._sink_logits(options.sinks, b, t)
            if scoring:
                reads_window = t > 1 and "window" in policy.attention_from  # else the last queries' sums go unread
                window = self._observation_window(t, options.sliding_window, real) if t > 1 else None  # (S,) or int
                token = torch.arange(r, device=q.device) % t  # (R,) the query token of each row
                window_rows = (token >= t - (window if isinstance(window, int) else window[:, None])) if reads_window else None
                observer = policy.window_observer(t, window) if t > 1 else None  # CAKE, PyramidInfer: more window statistics
            if prefill_attention.covers(q, t, options):  # many rows: each chunk decoded once, fused attention
                new_mask = None if _plain_causal(mask) else mask
                chunks = lambda rows: self._chunks(s, rows, options)  # noqa: E731  chunks sized for `rows` query rows
                if scoring:
                    out, received = prefill_attention.attend_many_scored(
                        q, nk, nv, new_mask, _stream_mask(mask, G, groups), chunks, options, window_rows, query_pos, sink_logits,
                        observer, all_rows="all" in policy.attention_from,
                    )
                else:
                    out = prefill_attention.attend_many(q, nk, nv, new_mask, chunks, options, query_pos, sink_logits)
            elif scoring:
                out, received = attend_scored(
                    q, nk, nv, _stream_mask(mask, G, groups), lambda: self._chunks(s, r, options), options, window_rows, query_pos, sink_logits,
                    observer,
                )
            else:
                chunks = self._sparse_chunks(q, options) if self._sparse_step(t, options) else self._chunks(s, r, options)
                out = attend(q, nk, nv, _stream_mask(mask, G, groups), chunks, options, query_pos, sink_logits)
            out = out.reshape(b, groups, g, G, t, d).reshape(b, hq, t, d).transpose(1, 2).to(query.dtype)
        self._store_new(nk, nv, real, positions, received, t)
        return out

    def _cpu_kernel_step(self, query, new_k, new_v, attention_mask, scaling: float, kwargs: dict, seen_before: int):
        """A decode step the CPU kernel both runs and stores (`_kernel_covers` and `_kernel_writes`, every new token
        real), from the model's tensors to the output on host arrays: the general path's result with about a dozen
        fewer tensor operations per layer and step (at a few thousand held tokens those cost a third as much as the
        kernel's own work). None when the step is not such a one: the general path runs it."""
        if self.g != 1 or self._empty() or not _decoding_real_tokens(attention_mask, self.context.all_real):
            return None
        options = LayerOptions(
            scaling=scaling, softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"),
            sliding_window=kwargs.get("sliding_window") or self.context.sliding_window(self.index),
        )
        policy = self.policy
        scoring = policy is not None and policy.uses_attention and policy.evicts_while_decoding
        if not (self._kernel_covers(1, scoring, options, None) and self._kernel_writes(None)):
            return None
        b, hq, _, d = query.shape
        s = b * self.groups
        positions = None  # (B, 1): written with the token, a sliding window's query, layer 0's record
        if "pos" in self.store.layout.meta or options.sliding_window or (self.index == 0 and self.context.sequence_positions is not None):
            positions = self.context.positions(b, 1, seen_before, query.device)
        q = _host_rows(query, s) * np.float32(scaling)  # (S, R, D) float32, already scaled
        sink_logits = self._sink_logits(options.sinks, b, 1)
        token_k, token_v = _host_rows(new_k, s)[:, 0], _host_rows(new_v, s)[:, 0]  # (S, D) float32
        out = self._kernel_decode(
            q, token_k, token_v, options, None if sink_logits is None else sink_logits[:, 0], "exact", True,
            None if positions is None else positions[:, 0], scoring,
        )  # (S, R, D) float32: (B, H_q, D), which is (B, 1, H_q, D) for one token
        out = out.view(b, 1, hq, d)
        if query.dtype != torch.float32:
            out = out.to(query.dtype)
        self._count_kernel_write(b, positions, token_k, token_v)
        return out

    def _count_kernel_write(self, b: int, positions: torch.Tensor | None, new_k, new_v) -> None:
        """The CPU kernel stored this decode step's token (and its position and score): count it (``positions``
        (B, 1), which layer 0 records where the context keeps them) and write its feature where the policy keeps one
        (KNorm, VATP: from the token's key and value ``new_k`` / ``new_v`` (S, D) float32, as the torch path does). A
        policy that re-chooses by its rules after every token (FastGen, `_rules_after_write`) then evicts."""
        store = self.store
        store.appended_one()
        if "feature" in store.layout.meta:
            k, v = torch.as_tensor(new_k)[:, None], torch.as_tensor(new_v)[:, None]  # (S, 1, D)
            slots = store.float_slot_ids(to_device(store.float_len - 1, self.device)[:, None])[:, 0]  # (S,) the new slots
            store.float_flat("feature")[slots] = self.policy.token_feature(k, v)[:, 0].float()
        self.lengths = self.lengths + 1
        if self.index == 0 and positions is not None:
            self.context.record(positions, torch.ones(b, dtype=torch.int64, device=self.device))
        policy = self.policy
        if policy is None:
            return
        if not policy.budgeted:
            self._evict_by_rules(b, positions)
        elif policy.evicts_while_decoding or self.window_rule is not None:
            self._quiet_steps -= 1  # one of the steps no stream can be due in (`_evict` counts them the same way)

    def _evict_by_rules(self, b: int, positions: torch.Tensor) -> None:
        """FastGen's kept set after a token the CPU kernel wrote (its classes written here), chosen and compacted by
        `cpu_fastgen.fastgen_decode_evict` as the torch path's `_evict` does over the whole view."""
        from kvtool.runtime.kernels.cpu_fastgen import fastgen_decode_evict, fastgen_decode_evict_blocks

        store, spec = self.store, self.policy.spec
        pool, body = store.float_pool, store.body_pool
        classes = self.context.token_classes(b, 1, positions, spec.sink_tokens)  # (B, 1) uint8, once per forward
        slots = (pool.host_flat("pos"), pool.host_flat("score"), pool.host_flat("cls"),
                 tuple(pool.host_flat(name, as_bytes=True) for name in store.slot_names))
        policies = self.policy.decode_policies(self.index, self.group_of_stream, self.stream_state).numpy()  # (S,)
        rules = (classes.numpy(), self.groups, policies, self.lengths.numpy(), float(spec.local_ratio),
                 float(spec.frequent_ratio), self.window_rule.window if self.window_rule is not None else 0)
        if body is None:
            new_len = fastgen_decode_evict(store.float_table.numpy(), store.float_len, store.fbs, *slots, *rules)
            store.set_float_lengths(new_len)
            return
        lengths = np.empty((3, store.streams), np.int64)
        freed = np.empty(max(int(store.body_len.sum()), 1), np.int64)
        n_freed = fastgen_decode_evict_blocks(
            store.float_table.numpy(), store.float_len, store.n_sink, store.layout.sink_tokens, store.fbs, *slots,
            store.body_table.numpy(), store.body_len, store.bs, body.host_flat("pos"), body.host_flat("score"),
            body.host_flat("cls"), *rules, lengths, freed,
        )
        store.set_kept_lengths(lengths, freed[:n_freed])
        store.flush_held(self._float_positions_for_encode, self._encode)  # blocks now due, as `append` encodes them

    def _observation_window(self, t: int, sliding_window: int | None, real: torch.Tensor | None) -> torch.Tensor | int:
        """Query tokens of this forward of ``t`` whose attention scores the others, per stream (S,) int64, or one int
        when every stream has the same: the policy's recent window (`EvictionPolicy.recent_window`) at its sequence's
        length after the forward (real tokens only, so a padded batch observes what each sequence would alone)."""
        counts = torch.full_like(self.lengths, t) if real is None else real.sum(dim=1).to(self.lengths.dtype)  # (B,)
        visible = self.lengths + counts
        if sliding_window:
            visible = visible.clamp(max=sliding_window)
        window = self.policy.recent_window(visible)  # (B,)
        if bool((window == window[0]).all()):
            return int(window[0])
        return window.repeat_interleave(self.groups)  # (S,)

    def _kernel_covers(self, t: int, scoring: bool, options: LayerOptions, real) -> bool:
        """The Triton (CUDA) or Numba (CPU) decode kernel runs this step (see `backend.py` for what each covers). A
        scored step runs on the CPU kernel when it also stores the token (`_kernel_writes`): it adds the attention to
        the held slots' scores in the same pass."""
        backend = self.context.backend
        if backend == "torch" or t != 1 or self.g != 1 or not (real is None or bool(real.all())):
            return False
        if options.sliding_window and (backend != "numba" or "pos" not in self.store.layout.meta):
            return False  # the CPU kernel reads the window from the positions the store keeps per slot
        if backend == "triton":
            return not scoring
        return self._cpu_kernel_reads() and (not scoring or self._kernel_writes(real))

    def _kernel_writes(self, real) -> bool:
        """The CPU kernel also stores this decode step's token: a plain append (every token real, per-slot metadata no
        more than positions, scores and a feature) into float slots the streams have (the next float block allocated
        first where only that is missing: `LayerStore.can_append_one`), on a step where the policy cannot cut
        (`_policy_quiet`); or FastGen's token, which its rules then re-choose from (`_rules_after_write`: the sinks it
        makes and the blocks then due are handled after the write)."""
        store = self.store
        if self.context.backend != "numba" or real is not None or store.layout.token_sums or self.context.shrink is not None:
            return False
        if set(store.layout.meta) <= {"pos", "score", "feature"} and self._policy_quiet():
            return store.can_append_one()
        return self._rules_after_write() and store.can_append_one(makes_sinks=True, flushes=True)

    def _rules_after_write(self) -> bool:
        """A policy that re-chooses its kept set by rules after every token (FastGen: not budgeted): the store's float
        slots and body blocks, which `_evict_by_rules` compacts after the CPU kernel wrote the token."""
        policy = self.policy
        return policy is not None and not policy.budgeted and set(self.store.layout.meta) == {"pos", "score", "cls"}

    def _policy_quiet(self) -> bool:
        """This decode step only appends, as `_evict` decides it: no policy; one that never cuts while decoding (and
        no sliding-window rule); or a budgeted one within the steps no stream can be due in (`_quiet_steps`, which on a
        sliding-window layer also counts the window rule's schedule: `_evict`)."""
        policy = self.policy
        if policy is None:
            return True
        if self.window_rule is not None:
            return policy.budgeted and self._quiet_steps > 0
        return not policy.evicts_while_decoding or (policy.budgeted and self._quiet_steps > 0)

    def _cpu_kernel_reads(self) -> bool:
        """The CPU kernel reads this layer's store (its float dtype and formats; fixed for the layer's life)."""
        held = self.__dict__.get("_cpu_kernel_held")
        if held is None:
            from kvtool.runtime.kernels.cpu_decode import covers

            store = self.store
            formats = self._kernel_formats()[0] if store.layout.quantized else None
            held = self._cpu_kernel_held = (
                covers(formats, store.layout.float_dtype, store.layout.head_dim) is None and not store.layout.summary_tokens
            )
        return held

    def _stores_first(self, options: LayerOptions, rows: int) -> bool:
        """This decode step may write its token into the store before attending (`attend_stored`): no eviction
        is due, no block is encoded, no sink is made, no sliding window or sparse read, the logits of every row
        over every held token stay under CHUNK_ELEMENTS and the values they weigh under REUSE_ELEMENTS. The
        result is the same attention; the new token is read back from its storage dtype, as in later steps."""
        policy, store = self.policy, self.store
        if options.sliding_window or self._sparse_step(1, options):
            return False
        if policy is not None and policy.evicts_while_decoding and not (policy.budgeted and self._quiet_steps > 0):
            return False  # the policy may cut this step: it chooses among stored and new tokens
        tokens = int(store.tokens().max()) + 1
        if rows * tokens > CHUNK_ELEMENTS or store.streams * self.g * store.layout.head_dim * tokens > REUSE_ELEMENTS:
            return False  # long or wide: the general path's bounded chunks and online softmax
        return store.appends_in_float(1)

    def _sparse_step(self, t: int, options: LayerOptions) -> bool:
        """This decode step reads only the best-scored summary groups (RocketKV's stage 2)."""
        return bool(self.store.layout.summary_tokens) and t == 1 and not options.sliding_window and self.store.float_pool.used > 0

    def _select_groups(self, q: torch.Tensor, options: LayerOptions, sums=None) -> Selection:
        """The summary groups `select_groups` ranks for the rows q (S, g, R, D) (sums: the store's `token_sums`, for
        ``channel_score: query_key``)."""
        kmax, kmin = self.store.key_summaries()  # (S, N, g, D) x 2
        held = self.store.lengths("float_len")  # (S,)
        spec = self.plan.recipe.sparse_attention
        key_scale = None
        if spec.channel_score == "query_key":  # the spread of the held keys per channel
            n = held.clamp(min=1)[:, None, None].to(sums[0].dtype)
            key_scale = (sums[2] / n - (sums[0] / n).square()).clamp(min=0.0).sqrt()  # (S, g, D) standard deviation
        return select_groups(spec, q, kmax, kmin, held, options.scaling, key_scale, streams_per_sequence=self.groups)

    def _group_slots(self, groups: torch.Tensor, count: torch.Tensor, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool slot ids (S, c), valid (S, c)) of ranked groups [c0, c1) (groups (S, K), count (S,) as selected)."""
        store = self.store
        n = store.layout.summary_tokens
        slots = (groups[:, c0:c1, None] * n + torch.arange(n, device=self.device)).flatten(1)  # (S, c) region slots
        read = (torch.arange(c0, c1, device=self.device)[None] < count[:, None]).repeat_interleave(n, dim=1)  # (S, c)
        valid = read & (slots < store.lengths("float_len")[:, None])
        return store.float_slot_ids(slots), valid

    def _stored_sums(self):
        """(the store's `block_sums`: ((S, F, g, D) x 2-3, tokens (S, F)), their totals per stream (S, g, D) x 2-3), or
        (None, None) when the store keeps no sums."""
        if not self.store.layout.token_sums:
            return None, None
        block_sums = self.store.block_sums()
        return block_sums, tuple(x.sum(dim=1) for x in block_sums[0])

    def _estimates_unread(self, options: LayerOptions) -> bool:
        """A sparse step estimates what it does not read (``sparse_attention.unread: estimate`` or ``estimate_blocks``)."""
        if not self.store.layout.token_sums or self.plan.recipe.sparse_attention.unread == "drop":
            return False
        if options.softcap:
            raise RuntimeConfigError(
                "sparse_attention.unread: estimate cannot estimate soft-capped logits (this model caps its attention "
                "logits, as Gemma 2 does); use unread: drop"
            )
        return True

    def _sparse_chunks(self, q: torch.Tensor, options: LayerOptions):
        """The float slots of the groups `select_groups` picks for the rows q (S, g, R, D), chunk by chunk; the
        other slots are not read."""
        store = self.store
        n, (s, g, r, d) = store.layout.summary_tokens, q.shape
        estimate = self._estimates_unread(options)
        by_blocks = estimate and self.plan.recipe.sparse_attention.unread == "estimate_blocks"
        block_sums, sums = self._stored_sums()
        selection = self._select_groups(q, options, sums)
        groups, count = selection.groups, selection.count  # (S, K), (S,)
        step = max(1, chunk_tokens(s, g, r, d, n) // n)
        read_tokens, read_sums = 0, None
        for c0 in range(0, groups.shape[1], step):
            flat, valid = self._group_slots(groups, count, c0, min(groups.shape[1], c0 + step))  # (S, c) pool slots
            k = store.read_float_values("k", flat, per_slot=True).float().transpose(1, 2)  # (S, g, c, D)
            v = store.read_float_values("v", flat, per_slot=True).float().transpose(1, 2)
            read_tokens += int(valid.sum())
            if estimate and not by_blocks:  # sums of the keys and values read, per stream (S, g, D) each
                weights = valid[:, None, None, :].to(v.dtype)  # (S, 1, 1, c)
                part = (torch.matmul(weights, k)[:, :, 0], torch.matmul(weights, v)[:, :, 0])
                read_sums = part if read_sums is None else (read_sums[0] + part[0], read_sums[1] + part[1])
            yield Chunk(
                scores=lambda q, k=k: torch.matmul(q, k.transpose(-1, -2)),
                values=lambda p, v=v: torch.matmul(p, v),
                valid=valid, positions=None, region="float", start=c0 * n,
            )
        self.context.count_sparse_reads(read_tokens, int(store.float_len.sum()))
        if estimate:  # the tokens not read, as one softmax term: their estimated mass and their values' mean
            if by_blocks:
                logit, value, unread = unread_blocks_term(selection, q, block_sums[0][:2], block_sums[1])
            else:
                if read_sums is None:
                    zeros = torch.zeros(s, g, d, device=q.device)
                    read_sums = (zeros, zeros)
                logit, mean, unread = unread_term(selection, q, sums[:2], read_sums)  # (S, g, R), (S, g, D), (S,)
                value = mean[:, :, None, :].expand(s, g, r, d)
            yield Chunk(
                scores=lambda q: logit[..., None],  # (S, g, R, 1)
                values=lambda p: p * value,  # (S, g, R, D)
                valid=(unread > 0)[:, None], positions=None, region="unread", start=0,
            )

    def _kernel_decode(
        self, q, new_k, new_v, options: LayerOptions, sink_logits, precision: str = "exact", write: bool = False,
        positions: torch.Tensor | None = None, scoring: bool = False,
    ) -> torch.Tensor:
        """(S, R, D) float32 attention of one decode step, by the Triton kernel reading the store in place
        (``precision`` "half" for float16 / bfloat16 models: float16 operands in the fast kernel's products), or by
        the CPU kernel, which with ``write`` also stores the token (its position: ``positions`` (B,), also the query's
        position a sliding window is measured from) and with ``scoring`` adds the step's attention to the held slots'
        scores."""
        from kvtool.runtime.kernels.decode_attention import paged_decode_attention

        float_dtype = self.store.layout.float_dtype
        if float_dtype in BYTE_SLOT_DTYPES:  # the token as its float slot holds it, as the torch path reads it back
            if isinstance(new_k, np.ndarray):  # host rows (`_cpu_kernel_step`)
                new_k, new_v = torch.from_numpy(new_k), torch.from_numpy(new_v)
            new_k, new_v = round_trip_float_slots(torch.stack((new_k, new_v)), float_dtype)
        if self._sparse_step(1, options):  # RocketKV's stage 2: the chosen slots only
            from kvtool.runtime.kernels.sparse_decode import sparse_decode_attention

            block_sums, sums = self._stored_sums()
            selection = self._select_groups(q[:, None], options, sums)  # q (S, R, D) as (S, 1, R, D)
            groups, count = selection.groups, selection.count
            slots, valid = self._group_slots(groups, count, 0, groups.shape[1])  # (S, K n) x 2
            self.context.count_sparse_reads(int(valid.sum()), int(self.store.float_len.sum()))
            self.context.kernel_steps += 1
            unread = None
            mode = self.plan.recipe.sparse_attention.unread if self._estimates_unread(options) else "drop"
            if mode == "estimate_blocks":
                logit, value, _ = unread_blocks_term(selection, q[:, None], block_sums[0][:2], block_sums[1])
                unread = (logit[:, 0], value[:, 0])  # (S, R), (S, R, D): known before the kernel reads anything
            elif mode == "estimate":  # from the sums of what the kernel read: (logit (S, R), value (S, D))
                def unread(read_k: torch.Tensor, read_v: torch.Tensor, selection=selection, held=sums[:2]):
                    logit, mean, _ = unread_term(selection, q[:, None], held, (read_k[:, None], read_v[:, None]))
                    return logit[:, 0], mean[:, 0]
            return sparse_decode_attention(
                q, new_k, new_v, self.store.float_flat("k")[:, 0], self.store.float_flat("v")[:, 0], slots, valid,
                options.softcap, sink_logits, unread=unread,
                float_scales=tuple(self.store.float_flat(n)[:, 0] for n in ("ks", "vs")) if self.store.scaled_slots else None,
            )

        store = self.store
        float_pool = store.float_pool.tensors
        if self.context.backend == "numba":
            from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention

            if write:  # the next float block of streams whose last one is full (`LayerStore.can_append_one`)
                store.reserve_one()
                float_pool = store.float_pool.tensors  # a grown pool has new tensors
            has_body = store.body_pool is not None and store.body_pool.used > 0  # (streams with none read no block)
            meta = store.layout.meta if write else ()  # written with the token: its position, its score
            scores = None
            if "score" in meta:
                scores = (float_pool["score"], store.body_pool.tensors["score"] if has_body else None)
            written_positions = (float_pool["pos"], positions.cpu().numpy()) if "pos" in meta else None  # per sequence
            self.context.kernel_steps += 1
            body = formats = None
            if has_body:  # the pool's block tensors and the formats' calibrated tables (int_static, static fp8)
                formats, constants = self._kernel_formats()
                body = ({**store.body_pool_side("k"), **constants[0]}, {**store.body_pool_side("v"), **constants[1]})
            rope = self._kernel_rope() if has_body and self.plan.recipe.keys.pre_rope else None
            window = None
            if options.sliding_window:  # (W, the query's position per stream, the slots' positions)
                query_pos = positions.cpu().numpy().repeat(self.groups)  # a sequence's streams are consecutive
                body_pos = store.body_pool.tensors["pos"] if has_body else None
                window = (int(options.sliding_window), query_pos, float_pool["pos"], body_pos)
            return cpu_decode_attention(
                q, new_k, new_v, float_pool["k"], float_pool["v"], store.float_table, store.float_len, body,
                store.body_table if has_body else None, store.body_len if has_body else None, formats,
                self.group_of_stream, store.bs, options.softcap, sink_logits, write, scores, scoring, written_positions,
                rope, window=window, float_scales=(float_pool["ks"], float_pool["vs"]) if store.scaled_slots else None,
            )
        body = formats = body_table = body_len = None
        if store.body_pool is not None and int(store.body_len.max()) > 0:
            formats, constants = self._kernel_formats()
            body = ({**store.body_pool_side("k"), **constants[0]}, {**store.body_pool_side("v"), **constants[1]})
            body_table, body_len = store.body_table, store.lengths("body_len")
        rope = self._kernel_rope() if body is not None and self.plan.recipe.keys.pre_rope else None
        self.context.kernel_steps += 1
        return paged_decode_attention(
            q, new_k, new_v, float_pool["k"][:, :, 0], float_pool["v"][:, :, 0], store.float_table, store.lengths("float_len"),
            body, body_table, body_len, formats, store.bs, options.softcap, sink_logits, stream_group=self.group_of_stream,
            rope=rope, precision=precision,
            float_scales=(float_pool["ks"][:, :, 0], float_pool["vs"][:, :, 0]) if store.scaled_slots else None,
        )

    def _kernel_formats(self):
        """((key, value) `BodyFormat`, (key, value) per-model constants on this device) the kernels read: fixed for the
        layer's life, built once (a decode step asks in every layer)."""
        held = self.__dict__.get("_kernel_formats_held")
        if held is None:
            held = self._kernel_formats_held = (
                (self.key_format.kernel_format(), self.value_format.kernel_format()),
                (self.key_format.kernel_tensors(self.device), self.value_format.kernel_tensors(self.device)),
            )
        return held

    def _kernel_rope(self):
        """This layer's RoPE and where the kernel reads the true positions of pre-RoPE body keys (`BodyRope`)."""
        from kvtool.runtime.kernels.body_rope import BodyRope

        store, context = self.store, self.context
        spec = context.rope.ropes[self.index]  # fixed frequencies: `backend.kernel_unsupported` refuses the others
        common = dict(
            inv_freq=spec.inv_freq.to(device=self.device, dtype=torch.float32), scaling=float(spec.attention_scaling),
            interleaved=spec.interleaved,
        )
        if "pos" in store.layout.meta:  # evicting: positions per body slot, read at the block id
            return BodyRope(**common, source="slots", positions=store.body_pool.tensors["pos"])
        n_sink = store.lengths("n_sink")
        if context.sequence_positions is not None:  # as `CacheContext.body_positions`: sequence s // groups
            table = context.sequence_positions.table
            return BodyRope(**common, source="sequence", positions=table, n_sink=n_sink, streams_per_sequence=self.groups)
        return BodyRope(**common, source="tokens", n_sink=n_sink)

    def _empty(self) -> bool:
        return not self.store.float_pool.used and (self.store.body_pool is None or not self.store.body_pool.used)

    def _sink_logits(self, sinks: torch.Tensor | None, b: int, t: int) -> torch.Tensor | None:
        """Learned per-query-head sink logits (H_q,) -> (S, g, R)."""
        if sinks is None:
            return None
        per_head = sinks.float().reshape(self.groups, self.g, -1)  # (H/g, g, G)
        rows = per_head[..., None].expand(-1, -1, -1, t).reshape(self.groups, self.g, -1)  # (H/g, g, G*t)
        return rows.repeat(b, 1, 1)

    def _chunks(self, s: int, r: int, options: LayerOptions, trim: bool = False):
        """The stored tokens of every stream, chunk by chunk (float blocks, then body blocks), whole blocks at a time.

        trim: when every stream's float region ends at the same slot, the last float chunk ends there too
        (no mask needed; its last block is then partial, which `_accumulate` handles)."""
        store, context = self.store, self.context
        fbs, bs = store.fbs, store.bs
        d, g = store.layout.head_dim, self.g
        per_chunk = chunk_tokens(s, g, r, d, bs)
        needs_pos = bool(options.sliding_window)
        float_blocks = int(store.float_blocks().max()) if s else 0
        shortest = int(store.float_len.min()) if s else 0
        even = trim and s and shortest == int(store.float_len.max())
        step = max(1, per_chunk // fbs)
        for c0 in range(0, float_blocks, step):
            c1 = min(float_blocks, c0 + step)
            ids = store.float_block_ids(c0, c1)  # (S, nb)
            kv = store.read_float_blocks(("k", "v"), ids)  # (S, nb*fbs, g, D)
            k, v = kv["k"], kv["v"]
            pos = context.float_block_positions(self, ids, c0) if needs_pos else None
            valid = None
            if c1 * fbs > shortest and even:  # every stream ends at slot `shortest`, inside this chunk
                k, v = k[:, : shortest - c0 * fbs], v[:, : shortest - c0 * fbs]
                pos = None if pos is None else pos[:, : shortest - c0 * fbs]
            elif c1 * fbs > shortest:  # some stream ends inside this chunk
                valid = torch.arange(c0 * fbs, c1 * fbs, device=self.device) < store.lengths("float_len")[:, None]
            k, v = k.float().transpose(1, 2), v.float().transpose(1, 2)  # (S, g, c, D)
            yield Chunk(
                scores=lambda q, k=k: torch.matmul(q, k.transpose(-1, -2)),
                values=lambda p, v=v: torch.matmul(p, v),
                valid=valid, positions=pos, region="float", start=c0 * fbs, floats=lambda k=k, v=v: (k, v),
            )
        if store.body_pool is None:
            return
        blocks = int(store.body_len.max()) if s else 0
        fewest = int(store.body_len.min()) if s else 0
        step = max(1, per_chunk // bs)
        pre_rope = self.plan.recipe.keys.pre_rope
        for c0 in range(0, blocks, step):
            c1 = min(blocks, c0 + step)
            ids = store.body_block_ids(c0, c1)  # (S, nb)
            kb, vb = store.read_body("k", ids), store.read_body("v", ids)
            valid = None
            if c1 > fewest:
                valid = (torch.arange(c0, c1, device=self.device) < store.lengths("body_len")[:, None]).repeat_interleave(bs, dim=1)
            pos = context.body_positions(self, c0, c1, ids) if (needs_pos or pre_rope) else None
            to_attention = None
            if pre_rope:
                to_attention = context.rope.key_rotation(self.index, *context.body_cos_sin(self.index, pos))  # (S, T, R)
            yield Chunk(
                scores=lambda q, kb=kb, fn=to_attention: self.key_format.chunk_scores(q, kb, self.group_of_stream, fn),
                values=lambda p, vb=vb: self.value_format.chunk_values(p, vb, self.group_of_stream),
                valid=valid, positions=pos, region="body", start=c0 * bs,
                floats=lambda kb=kb, vb=vb, fn=to_attention: self._body_floats(kb, vb, fn),
            )

    def _body_floats(self, kb, vb, to_attention) -> tuple[torch.Tensor, torch.Tensor]:
        """Body blocks {name: (S, nb, ...)} of both sides decoded once: keys (in the query's domain), values (S, g, nb*bs, D)."""
        keys = self.key_format.chunk_floats(kb, self.group_of_stream)
        if to_attention is not None:  # stored before RoPE: rotated at the tokens' true positions
            keys = to_attention(keys)
        return keys, self.value_format.chunk_floats(vb, self.group_of_stream)

    # --- storing ------------------------------------------------------------------------------------
    def _store_new(self, nk, nv, real, positions, received, t: int) -> None:
        """Accumulate scores, let the policy choose, then write the kept new tokens into the store."""
        b = self.lengths.shape[0]
        groups, store, context = self.groups, self.store, self.context
        policy = self.policy
        if real is None:
            counts = np.full(b, t, dtype=np.int64)
            order = None
            self.lengths = self.lengths + (t if context.shrink is None else context.shrink[1])  # tokens seen
        else:
            counts = real.sum(dim=1).cpu().numpy()
            order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices  # real tokens first, in order
            self.lengths = self.lengths + to_device(counts, self.device)
        stream_counts = np.repeat(counts, groups)
        stream_order = None if order is None else order.repeat_interleave(groups, dim=0)

        def compact(x):  # (S, t, ...) real tokens first
            if stream_order is None:
                return x
            return x[torch.arange(x.shape[0], device=x.device)[:, None], stream_order]

        data = {"k": compact(nk.transpose(1, 2)), "v": compact(nv.transpose(1, 2))}  # (S, t, g, D)
        stream_pos = compact(positions.repeat_interleave(groups, dim=0))  # (S, t)
        if "pos" in store.layout.meta:
            data["pos"] = stream_pos
        if received is None and "score" in store.layout.meta:  # not scored this forward (RocketKV decoding)
            data["score"] = torch.zeros(data["k"].shape[:2], device=self.device)
        if received is not None:
            self._accumulate(received)
            data["score"] = compact(received.new)
            if received.new_window is not None:
                received.new_window = compact(received.new_window)  # aligned with the compacted new tokens
            if received.observer is not None:
                received.observer.compact_new(compact)
        if policy is not None and policy.uses_feature:
            data["feature"] = policy.token_feature(data["k"][:, :, 0], data["v"][:, :, 0])
        if policy is not None and policy.uses_token_classes:
            data["cls"] = compact(context.token_classes(b, t, positions, policy.spec.sink_tokens).repeat_interleave(groups, dim=0))
        if policy is not None and self._evict(data, stream_counts, stream_pos, received):
            pass  # the policy placed the kept new tokens
        else:
            store.append(data, stream_counts, stream_pos, self._float_positions_for_encode, self._encode)
        if self.index == 0:
            context.record(positions if order is None else positions.gather(1, order), to_device(counts, self.device))

    def _accumulate(self, received) -> None:
        """Add the attention stored slots received this forward to their scores (whole blocks at a time)."""
        store = self.store
        for region, start, values in received.chunks:
            pool, tokens = (store.float_pool, store.fbs) if region == "float" else (store.body_pool, store.bs)
            c0, blocks = start // tokens, -(-values.shape[1] // tokens)
            if values.shape[1] < blocks * tokens:  # a trimmed chunk (`_chunks`): its last block is partial
                values = torch.nn.functional.pad(values, (0, blocks * tokens - values.shape[1]))
            ids = (store.float_block_ids if region == "float" else store.body_block_ids)(c0, c0 + blocks)
            # masked slots received exactly 0 and table entries past a stream's blocks are 0: adding is safe
            pool.tensors["score"].index_add_(0, ids.flatten(), values.reshape(-1, tokens))

    def _evict(self, data, counts: np.ndarray, positions, received) -> bool:
        """Let the policy choose among stored and new tokens and free what it drops.

        Returns True when it also stored the kept new tokens (a float store: they fill the
        freed slots), False when they still have to be appended (nothing to evict).
        """
        store, policy, rule = self.store, self.policy, self.window_rule
        decoding = positions.shape[1] == 1
        policy_cuts = not decoding or policy.evicts_while_decoding  # RocketKV: only multi-token forwards evict
        if not policy_cuts and rule is None:
            return False
        if policy.budgeted and decoding and self._quiet_steps > 0:  # no stream can be due yet (see below)
            self._quiet_steps -= 1
            return False
        self._quiet_steps = 0  # a forward of several tokens breaks the one-token-per-step count
        length = self.lengths.repeat_interleave(self.groups)  # (S,)
        budget = self.budget(self.index, length)
        if policy.budgeted:  # a stream is cut back to its budget once it holds ``interval`` tokens more
            slack = policy.spec.interval - 1 if decoding else 0  # prefill: always down to the budget
            if decoding and self._trim_next:  # a budget that shrank after the prompt (CAKE's final shares): cut now
                slack = 0
            self._trim_next = not decoding and not getattr(self.budget, "never_shrinks", False)
            held = to_device(store.tokens() + counts, self.device)  # (S,) after this forward
            room = (budget + slack - held).reshape(-1, self.groups)  # (B, H/g): a sequence's streams
            if policy.spec.head_budgets == "adaptive":  # heads share the sequence's budget
                due_sequences, steps = room.sum(dim=1) < 0, room.sum(dim=1) // self.groups
            else:
                due_sequences, steps = (room < 0).any(dim=1), room.amin(dim=1)
            if not policy_cuts:
                due_sequences, steps = torch.zeros_like(due_sequences), torch.full_like(steps, 1 << 30)
            window_due = torch.zeros_like(due_sequences)
            if rule is not None:  # a sliding-window layer also frees what no query can see, on the rule's own schedule
                window_room = (rule.limit + (rule.spec.interval - 1 if decoding else 0) - held).reshape(-1, self.groups)
                window_due, steps = (window_room < 0).any(dim=1), torch.minimum(steps, window_room.amin(dim=1))
            if not bool(due_sequences.any() | window_due.any()):
                # a decode step adds at most one token per stream and a plain budget never shrinks as the
                # sequence grows (a kept fraction grows with it): no sequence is due for `quiet_steps` steps
                if decoding and getattr(self.budget, "never_shrinks", False):
                    growth = self.budget.growth(self.index) if hasattr(self.budget, "growth") else 0.0
                    self._quiet_steps = quiet_steps(int(steps.min()), growth)
                return False
            # a sequence is cut back whole once one of its streams is due (the policy may share budgets
            # among its heads); sequences not due keep everything, as they would alone (but what their
            # sliding window hides)
            due = due_sequences.repeat_interleave(self.groups)  # (S,)
            budget = torch.where(due, budget, held)
        t = positions.shape[1]
        fbs = store.fbs
        table = SlotTable(int(store.float_blocks().max()) * fbs, int(store.body_len.max()) if store.body_pool else 0, store.bs, t)
        view = self._view(table, data, counts, positions, received, length)
        if isinstance(policy, EvictionPolicy) and policy.budgeted and not decoding:
            # a multi-token forward protects the queries that scored the rest (`recent_window`); a decode step the
            # recipe's whole window: its scores are attention summed over every query, which favours old tokens
            visible = length if rule is None else length.clamp(max=rule.window)
            view = dataclasses.replace(view, window=policy.recent_window(visible))
        if rule is not None and policy.budgeted:  # the policy chooses among what the window still shows
            view = dataclasses.replace(view, valid=rule.keep(view, budget))
        keep = choose(policy, view, budget)
        self.stream_state = view.stream_state
        if rule is not None and not policy.budgeted:  # FastGen's rules (sized on every token): then free what no query sees
            keep &= rule.keep(view, budget)
        keep_float, keep_body, keep_new = table.split(keep)
        if store.body_pool is None:
            store.fill_holes(keep_float, data, keep_new)
            return True
        store.keep(keep_float, keep_body)
        order = torch.sort((~keep_new).to(torch.int8), dim=1, stable=True).indices  # kept new tokens first
        rows = torch.arange(order.shape[0], device=self.device)[:, None]
        kept = {name: values[rows, order] for name, values in data.items()}
        store.append(kept, keep_new.sum(dim=1).cpu().numpy(), positions[rows, order], self._float_positions_for_encode, self._encode)
        return True

    def _view(self, table: SlotTable, data, counts: np.ndarray, positions, received, length) -> StreamView:
        store, bs, fbs = self.store, table.block_size, self.store.fbs
        s, f, bn, t = store.streams, table.float_width, table.body_blocks, table.new_width
        float_ids = store.float_block_ids(0, f // fbs)
        body_ids = store.body_block_ids(0, bn) if bn else None
        valid = torch.cat([
            torch.arange(f, device=self.device) < store.lengths("float_len")[:, None],
            (torch.arange(bn, device=self.device) < store.lengths("body_len")[:, None]).repeat_interleave(bs, dim=1),
            torch.arange(t, device=self.device) < to_device(counts, self.device)[:, None],
        ], dim=1)

        def gather(name, new):
            parts = [store.read_blocks(store.float_pool, (name,), float_ids)[name]]
            if bn:
                parts.append(store.read_blocks(store.body_pool, (name,), body_ids)[name])
            return torch.cat(parts + [new.to(parts[0].dtype)], dim=1)

        zeros = torch.zeros(s, table.width, device=self.device)
        classes = gather("cls", data["cls"]) if "cls" in data else torch.zeros_like(zeros, dtype=torch.uint8)
        units, unit_count = table.units(s, self.device)
        return StreamView(
            positions=gather("pos", positions).long(),
            valid=valid,
            length=length,
            attention=gather("score", data["score"]) if "score" in data else zeros,
            window_attention=self._window_attention(table, received, t) if received is not None else None,
            current_attention=self._current_attention(table, received, data, t) if received is not None else None,
            window_stats=None if received is None or received.observer is None else received.observer.placed(table),
            feature=gather("feature", data["feature"]) if "feature" in data else None,
            is_special=(classes & SPECIAL) > 0,
            is_punct=(classes & PUNCT) > 0,
            units=units,
            unit_count=unit_count,
            layer=self.index,
            heads=self.group_of_stream,
            stream_state=self.stream_state,
        )

    def _window_attention(self, table: SlotTable, received, t: int) -> torch.Tensor | None:
        """(S, N) attention from the last ``window`` query tokens (prefill only), in the view's order."""
        if received.new_window is None or t == 1:
            return None
        out = torch.zeros(self.store.streams, table.width, device=self.device)
        offsets = {"float": 0, "body": table.float_width}
        for region, start, values in received.chunks_window:
            lo = offsets[region] + start
            out[:, lo : lo + values.shape[1]] = values
        out[:, table.width - t :] = received.new_window
        return out

    def _current_attention(self, table: SlotTable, received, data, t: int) -> torch.Tensor | None:
        """(S, N) attention from this forward's newest queries: the last ``window`` at prefill, the one query when decoding (TOVA)."""
        if t > 1:
            return self._window_attention(table, received, t)
        out = torch.zeros(self.store.streams, table.width, device=self.device)
        offsets = {"float": 0, "body": table.float_width}
        for region, start, values in received.chunks:
            lo = offsets[region] + start
            out[:, lo : lo + values.shape[1]] = values
        out[:, table.width - t :] = data["score"]
        return out

    # --- encoding ------------------------------------------------------------------------------------
    def _encode(self, k, v, rows, positions, ids) -> dict[str, torch.Tensor]:
        """Blocks k, v (N, bs, g, D) of streams ``rows`` -> body storage (keys before RoPE when the recipe says).

        Under the triton backend a side whose format the encode kernel writes goes straight into the
        body pool rows ``ids`` (N,); the other side's storage is returned, ``{"k.codes": (N, ...), ...}``.
        """
        group = self.group_of_stream[rows]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (N, g, bs, D)
        if self.plan.recipe.keys.pre_rope:
            cos, sin = self.context.rope.cos_sin(self.index, positions)  # (N, bs, R)
            k = self.context.rope.rotate(self.index, k.float(), cos, sin, inverse=True)
        out = {}
        for part, fmt, x in (("k", self.key_format, k), ("v", self.value_format, v)):
            kernel_format = self._kernel_encode_format(fmt)
            if kernel_format is not None:
                self._kernel_encode(part, fmt, kernel_format, x[:, 0], ids, group)
            else:
                out.update({f"{part}.{n}": t for n, t in fmt.encode_blocks(x, group).items()})
        return out

    def _kernel_encode_format(self, fmt):
        """The `BodyFormat` the Triton encode kernel writes for ``fmt`` under this backend, or None (torch encode)."""
        if self.context.backend != "triton" or self.g != 1:  # g == 1: fmt is the quantizer itself, not a LiftedFormat
            return None
        return fmt.kernel_encode_format()

    def _kernel_encode(self, part: str, fmt, kernel_format, x, ids, group) -> None:
        """Encode blocks x (N, bs, D) of one side by the Triton kernel, into body pool rows ids (N,)."""
        from kvtool.runtime.kernels.encode_blocks import encode_body_blocks

        static = fmt.kernel_tensors(self.device).get("static_scale")
        encode_body_blocks(x, kernel_format, self.store.body_pool_side(part), ids, group, static)
        self.context.kernel_encodes += x.shape[0]

    def _float_positions_for_encode(self, start: np.ndarray, width: int) -> torch.Tensor:
        if width == 0 or not self.plan.recipe.keys.pre_rope:
            return torch.zeros(self.store.streams, width, dtype=torch.int64, device=self.device)
        slot = to_device(start, self.device)[:, None] + torch.arange(width, device=self.device)
        return self.context.float_positions_at(self, slot)

    # --- inspection (tests, debugging; attention never does this) ---------------------------------
    def decoded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every held token decoded to float, in token order (by position where the store keeps no
        order): keys (post-RoPE), values (B, H, T, D), positions and valid (B, H, T) (shorter streams padded)."""
        store, bs, fbs = self.store, self.store.bs, self.store.fbs
        s, g = store.streams, self.g
        fb = int(store.float_blocks().max()) if s else 0
        ids = store.float_block_ids(0, fb)
        flo = store.read_float_blocks(("k", "v"), ids)
        keys, values = [flo["k"].float().transpose(1, 2)], [flo["v"].float().transpose(1, 2)]  # (S, g, F, D)
        pos = [self.context.float_block_positions(self, ids, 0)]
        f = fb * fbs
        if store.body_pool is not None:
            bn = int(store.body_len.max())
            ids = store.body_block_ids(0, bn)
            if bn:
                keys.append(self.key_format._decode_chunk(store.read_body("k", ids), self.group_of_stream))
                values.append(self.value_format._decode_chunk(store.read_body("v", ids), self.group_of_stream))
                pos.append(self.context.body_positions(self, 0, bn, ids))
                if self.plan.recipe.keys.pre_rope:
                    keys[-1] = self.context.rope.rotate(self.index, keys[-1], *self.context.rope.cos_sin(self.index, pos[-1]))
        keys, values, pos = torch.cat(keys, 2), torch.cat(values, 2), torch.cat(pos, 1)
        total = to_device(store.tokens(), self.device)
        j = torch.arange(int(total.max()) if s else 0, device=self.device)[None]
        n_sink, body = store.lengths("n_sink")[:, None], (store.lengths("body_len") * bs)[:, None]
        column = torch.where(j < n_sink, j, torch.where(j < n_sink + body, f + j - n_sink, j - body))
        column = column.clamp(max=max(keys.shape[2] - 1, 0))
        valid = j < total[:, None]
        pos = pos.gather(1, column)
        if "pos" in store.layout.meta:  # unordered float slots: present by position
            column = column.gather(1, torch.sort(pos.masked_fill(~valid, torch.iinfo(torch.int64).max), dim=1, stable=True).indices)
            pos = pos.gather(1, torch.sort(pos.masked_fill(~valid, torch.iinfo(torch.int64).max), dim=1, stable=True).indices)
        rows = torch.arange(s, device=self.device)[:, None]
        keys = keys.transpose(1, 2)[rows, column].transpose(1, 2)
        values = values.transpose(1, 2)[rows, column].transpose(1, 2)
        shape = (self.lengths.shape[0], self.heads, column.shape[1])
        expand = lambda x: x.repeat_interleave(g, dim=0).reshape(shape)  # noqa: E731
        return keys.reshape(*shape, -1), values.reshape(*shape, -1), expand(pos), expand(valid)

    # --- accounting ---------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        if not self.is_initialized:
            return []
        return self.store.tensors() + [self.lengths, self.group_of_stream] + self.stream_tensors()

    def stream_tensors(self) -> list[torch.Tensor]:
        """Per-stream state a policy keeps between forwards (none for most policies)."""
        return [] if self.stream_state is None else [self.stream_state]


def _host_rows(x: torch.Tensor, streams: int) -> np.ndarray:
    """One token's (B, H, 1, D) CPU tensor as float32 rows per stream (S, H B / S, D) on the host (no copy when it is
    float32 in (B, H, D) order)."""
    if x.dtype != torch.float32:
        x = x.float()
    if x.requires_grad:
        x = x.detach()
    return x.numpy().reshape(streams, -1, x.shape[-1])


def _sdpa(query, key, value, mask, scaling) -> torch.Tensor:
    """Plain attention of the new tokens among themselves (empty store): (B, t, H_q, D)."""
    t = query.shape[2]
    causal = t > 1 and _plain_causal(mask)  # the kernel then skips the blocks above the diagonal
    attn_mask = None if t == 1 or causal else mask[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.to(query.dtype), value.to(query.dtype), attn_mask=attn_mask, is_causal=causal, scale=scaling, enable_gqa=True
    )
    return out.nan_to_num(0.0).transpose(1, 2)


def _plain_causal(mask: torch.Tensor) -> bool:
    """The new-token mask (B, t, t) is plain causal attention (no padding, no window)."""
    t = mask.shape[-1]
    return bool((mask == torch.ones(t, t, dtype=torch.bool, device=mask.device).tril()).all())
