"""The evicting cache: every (sequence, KV head) stream keeps its own tokens and frees the rest.

A transformers 5.x `Cache` whose layers hold a `TokenStream` per (sequence, KV
head): ragged by construction (no padding to the longest stream, no masks over
stored tokens). Each forward:

1. ``update`` (called by the attention module with the new K/V after RoPE) decodes
   every stream's kept tokens, lays them out for this one call (see
   `ragged_attention`) and claims the attention call that follows;
2. kvtool's attention function hands that call to `EvictingLayer.attend`, which
   computes attention over the ragged layout and the attention each kept and new
   token received;
3. the layer then lets the eviction policy decide, per stream, what stays (new
   tokens included: at prefill selection is token-exact, before anything is
   quantized) and stores only that: kept tokens are quantized as in
   `CompressedCache` when the recipe quantizes.

Positions are the ones the model used (recorded by a hook on the rotary module),
kept per token, so RoPE stays right after eviction (keys are stored after RoPE, or
before it and re-rotated at their true positions). ``get_seq_length`` is the
logical length (tokens seen, for position ids and the 2-D mask); padding tokens of
left-padded batches are recognised from the mask and never stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtool.methods.evict.base import EvictionPolicy, StreamView, ratio_budget
from kvtool.methods.registry import quantizer_class
from kvtool.models.attention_hook import claim_next_attention
from kvtool.models.rope import apply_rope, unapply_rope
from kvtool.runtime.cache import LayerPlan, storage_dtype
from kvtool.runtime.ragged_attention import ragged_attention
from kvtool.runtime.stream import PUNCT, SPECIAL, StreamCodec, TokenStream


@dataclass
class ForwardInfo:
    """Per-forward facts shared by all layers: probes of positions and token ids, the token classes."""

    position_probe: object | None  # PositionProbe
    token_probe: object | None  # TokenProbe
    rope_cos_sin: Callable  # positions (1, n) long -> cos, sin (1, n, R)
    special_ids: torch.Tensor | None = None  # (S,) int64
    punct_ids: torch.Tensor | None = None  # (P,) int64

    def positions(self, batch: int, t: int, seen: int, device) -> torch.Tensor:
        """(B, t) positions of the new tokens: the model's position_ids, else slots seen..seen+t-1."""
        last = None if self.position_probe is None else self.position_probe.last
        if last is not None and last.shape[-1] == t:
            return last.to(device=device, dtype=torch.int32).expand(batch, -1)
        return torch.arange(seen, seen + t, device=device, dtype=torch.int32).expand(batch, -1)

    def classes(self, batch: int, t: int, positions: torch.Tensor, sink_tokens: int) -> torch.Tensor:
        """(B, t) uint8 FastGen classes: SPECIAL (special id or a sink position) | PUNCT."""
        special = positions < sink_tokens
        punct = torch.zeros_like(special)
        ids = None if self.token_probe is None else self.token_probe.last
        if ids is not None and ids.shape[-1] == t:
            ids = ids.to(positions.device).expand(batch, -1)
            if self.special_ids is not None:
                special |= torch.isin(ids, self.special_ids.to(ids.device))
            if self.punct_ids is not None:
                punct = torch.isin(ids, self.punct_ids.to(ids.device))
        return special.to(torch.uint8) * SPECIAL + punct.to(torch.uint8) * PUNCT


class BudgetRule:
    """Tokens a stream of ``layer`` may keep when its sequence has seen ``length`` tokens."""

    def __init__(self, ratio: float, tokens: int | None, layer_weights: torch.Tensor) -> None:
        self.ratio, self.tokens, self.weights = ratio, tokens, layer_weights.double()
        self.fractions = layer_fractions(ratio, self.weights)  # (L,) per-layer fraction kept, mean = ratio

    def __call__(self, layer: int, length: int) -> int:
        if self.tokens is not None:
            return max(1, round(self.tokens * float(self.weights[layer])))
        return ratio_budget(float(self.fractions[layer]), length)


def layer_fractions(ratio: float, weights: torch.Tensor) -> torch.Tensor:
    """Per-layer fractions ratio x w_l capped at 1, the excess of capped layers handed to the others.

    Keeps the mean at ``ratio`` (the uniform allocation's) whenever that is possible (ratio <= 1).
    """
    fractions = (ratio * weights).clamp(max=1.0)
    for _ in range(len(weights)):
        missing = ratio * len(weights) - float(fractions.sum())
        open_layers = fractions < 1.0
        if missing <= 1e-12 or not bool(open_layers.any()):
            break
        share = weights * open_layers / float((weights * open_layers).sum())
        fractions = (fractions + missing * share).clamp(max=1.0)
    return fractions


class EvictingLayer(CacheLayerMixin):
    """One decoder layer of the evicting cache (see the module docstring)."""

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, index: int, plan: LayerPlan, policy: EvictionPolicy, budget: BudgetRule, info: ForwardInfo):
        super().__init__()
        self.index, self.plan, self.policy, self.budget, self.info = index, plan, policy, budget, info
        self.seen = 0  # token slots seen (pads included): transformers' logical length
        self._pending = None

    # --- transformers' CacheLayerMixin contract -------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        recipe, (b, h, _, d) = self.plan.recipe, key_states.shape
        block, store = recipe.cache.block_size, storage_dtype(recipe, key_states.dtype)
        quantizers = [
            quantizer_class(spec.method)(spec, d, block, store, self.plan.fitted_for(part))
            for spec, part in ((recipe.keys, "keys"), (recipe.values, "values"))
        ]
        self.codec = StreamCodec(
            key_quantizer=quantizers[0], value_quantizer=quantizers[1], quantized=recipe.quantizes,
            head_tokens=recipe.cache.sink_tokens, recent_tokens=recipe.cache.recent_tokens, block=block,
            store_dtype=store, compute_dtype=key_states.dtype,
            to_stored_keys=self._to_stored_keys, from_stored_keys=self._from_stored_keys,
        )
        scores, classes = self.policy.uses_attention, self.policy.uses_token_classes
        self.streams = [[TokenStream.empty(d, store, self.device, scores, classes) for _ in range(h)] for _ in range(b)]
        self.lengths = [0] * b  # real (non-pad) tokens each sequence has seen
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """New K/V (B, H, t, D) -> the ragged layout (B, H, N + t, D) for the attention call that follows."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, t, d = key_states.shape
        old = [[stream.materialize(self.codec) for stream in row] for row in self.streams]  # (n_bh, D) each
        flat_k = [k for row in old for k, _ in row]
        flat_v = [v for row in old for _, v in row]
        lengths = torch.tensor([k.shape[0] for k in flat_k], device=key_states.device)
        n_max = int(lengths.max())
        pad = torch.nn.utils.rnn.pad_sequence
        old_k = pad(flat_k, batch_first=True).reshape(b, h, n_max, d)  # (B, H, N, D), zero beyond each stream
        old_v = pad(flat_v, batch_first=True).reshape(b, h, n_max, d)
        old_valid = (torch.arange(n_max, device=key_states.device) < lengths[:, None]).reshape(b, h, n_max)
        positions = self.info.positions(b, t, self.seen, key_states.device)
        self._pending = (key_states, value_states, old, old_valid, positions)
        self.seen += t
        claim_next_attention(self)
        return torch.cat([old_k, key_states], dim=2), torch.cat([old_v, value_states], dim=2)

    def attend(self, module, query, key, value, attention_mask, scaling: float) -> torch.Tensor:
        """Attention over the ragged layout, then eviction; returns (B, t, H_q, D)."""
        new_k, new_v, old, old_valid, positions = self._pending
        self._pending = None
        b, t = query.shape[0], query.shape[2]
        new_mask = _new_token_mask(attention_mask, b, t, query.device)  # (B, t, t)
        spec = self.policy.spec
        out, received, received_window = ragged_attention(query, key, value, old_valid, new_mask, scaling, spec.window)
        classes = self.info.classes(b, t, positions, spec.sink_tokens)  # (B, t)
        n_max = old_valid.shape[2]
        for i in range(b):
            real = new_mask[i, -1]  # (t,) new tokens that are not padding (the last query sees every real one)
            new = _NewTokens(
                keys=new_k[i][:, real], values=new_v[i][:, real], positions=positions[i][real],
                classes=classes[i][real], received=received[i, :, n_max:][:, real],
                received_window=received_window[i, :, n_max:][:, real] if t > 1 else None,
            )
            self._commit_sequence(i, new, old[i], received[i, :, :n_max], received_window[i, :, :n_max] if t > 1 else None)
        return out

    def _commit_sequence(self, i: int, new: "_NewTokens", old: list, received, received_window) -> None:
        """Score, select and store the streams of sequence i."""
        self.lengths[i] += new.keys.shape[1]
        budget = self.budget(self.index, self.lengths[i])
        for j, stream in enumerate(self.streams[i]):
            n = stream.n
            stream.add_attention(received[j, :n])
            if n + new.keys.shape[1] <= budget and self.policy.budgeted:
                stream.append(new.keys[j], new.values[j], new.positions, new.received[j], new.classes, self.codec)
                continue
            window = None if received_window is None else torch.cat([received_window[j, :n], new.received_window[j]])
            view = self._view(i, j, stream, old[j], new, window)
            keep = self.policy.keep(view, budget)  # (n + t',)
            if self.codec.quantized:
                keep = _whole_units(keep, view.units)
            stream.keep(keep[:n], self.codec.block)
            kept = keep[n:]
            stream.append(
                new.keys[j][kept], new.values[j][kept], new.positions[kept], new.received[j][kept],
                new.classes[kept], self.codec,
            )

    def _view(self, i: int, head: int, stream: TokenStream, old_kv, new: "_NewTokens", window) -> StreamView:
        n, t_new = stream.n, new.keys.shape[1]
        units = stream.units(self.codec.block)
        first_new = int(units[-1]) + 1 if n else 0
        attention = stream.attention if stream.attention is not None else torch.zeros(n, device=self.device)
        old_classes = stream.classes if stream.classes is not None else torch.zeros(n, dtype=torch.uint8, device=self.device)
        classes = torch.cat([old_classes, new.classes.to(torch.uint8)])
        return StreamView(
            positions=torch.cat([stream.positions, new.positions.to(torch.int32)]),
            length=self.lengths[i],
            attention=torch.cat([attention, new.received[head].float()]),
            window_attention=window,
            keys=torch.cat([old_kv[0], new.keys[head]]) if self.policy.uses_keys else None,
            values=torch.cat([old_kv[1], new.values[head]]) if self.policy.uses_values else None,
            is_special=(classes & SPECIAL) > 0,
            is_punct=(classes & PUNCT) > 0,
            units=torch.cat([units.to(self.device), first_new + torch.arange(t_new, device=self.device)]),
            layer=self.index,
            head=head,
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.seen = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_batch(torch.arange(len(self.streams))[indices].tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_batch([i for i in range(len(self.streams)) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvtool's evicting cache cannot be cropped (assisted decoding is not supported)")

    def _select_batch(self, rows: list[int]) -> None:
        if not self.is_initialized:
            return
        self.streams = [[stream.copy() for stream in self.streams[r]] for r in rows]
        self.lengths = [self.lengths[r] for r in rows]

    # --- pre-RoPE keys ------------------------------------------------------------------------
    def _to_stored_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys (n, D) at ``positions`` -> the body's domain (pre-RoPE when the recipe asks)."""
        if not self.plan.recipe.keys.pre_rope:
            return keys
        cos, sin = self.info.rope_cos_sin(positions[None].long())  # (1, n, R)
        return unapply_rope(keys.float()[None, None], cos, sin)[0, 0]

    def _from_stored_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.plan.recipe.keys.pre_rope:
            return keys
        cos, sin = self.info.rope_cos_sin(positions[None].long())
        return apply_rope(keys.float()[None, None], cos, sin)[0, 0].to(keys.dtype)

    # --- accounting ---------------------------------------------------------------------------
    def all_streams(self) -> list[TokenStream]:
        return [stream for row in self.streams for stream in row] if self.is_initialized else []

    def nbytes(self) -> int:
        """Bytes of storage actually held by every stream (K/V, codes, scales, positions, scores)."""
        return sum(stream.nbytes() for stream in self.all_streams())

    def kept_tokens(self) -> int:
        return sum(stream.n for stream in self.all_streams())

    def expected_nbytes(self) -> int:
        """Analytic size of what the streams hold, from their token counts and the quantizers' block sizes."""
        total = 0
        for stream in self.all_streams():
            d = stream.tail_k.shape[-1]
            blocks = stream.body_blocks()
            floats = stream.n - blocks * self.codec.block
            meta = 4 + (4 if stream.attention is not None else 0) + (1 if stream.classes is not None else 0)
            total += 2 * floats * d * stream.tail_k.element_size() + stream.n * meta
            total += blocks * (self.codec.key_quantizer.block_nbytes() + self.codec.value_quantizer.block_nbytes())
        return total

    def fp16_nbytes(self) -> int:
        """Bytes a 16-bit cache would hold for every token seen (nothing evicted), K and V."""
        if not self.is_initialized:
            return 0
        h, d = len(self.streams[0]), self.streams[0][0].tail_k.shape[-1]
        return 2 * h * d * 2 * sum(self.lengths)


@dataclass
class _NewTokens:
    """The real (non-pad) new tokens of one sequence in one forward; per-head tensors lead with H."""

    keys: torch.Tensor  # (H, t', D)
    values: torch.Tensor  # (H, t', D)
    positions: torch.Tensor  # (t',) int32
    classes: torch.Tensor  # (t',) uint8
    received: torch.Tensor  # (H, t') attention received in this forward
    received_window: torch.Tensor | None  # (H, t') from the last `window` queries (prefill only)


def _new_token_mask(attention_mask: torch.Tensor | None, b: int, t: int, device) -> torch.Tensor:
    """(B, t, t) bool: which new tokens each new query may see (causal + padding), from transformers' mask."""
    if attention_mask is None:
        return torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(b, t, t)
    mask = attention_mask[:, 0, :, -t:]
    if mask.dtype != torch.bool:  # additive float mask
        mask = mask == 0
    return mask.expand(b, t, t)


def _whole_units(keep: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """Make a keep mask uniform per unit (quantized blocks): a block stays if most of its tokens stay."""
    n_units = int(units[-1]) + 1
    kept = torch.zeros(n_units, device=keep.device).index_add_(0, units, keep.float())
    size = torch.zeros(n_units, device=keep.device).index_add_(0, units, torch.ones_like(keep, dtype=torch.float))
    return (kept * 2 >= size)[units]


class EvictingCache(Cache):
    """A `transformers.Cache` of `EvictingLayer`s; build it with `CompressedRuntime.new_cache()`."""

    def __init__(self, plans: list[LayerPlan], policy: EvictionPolicy, budget: BudgetRule, info: ForwardInfo) -> None:
        layers = [EvictingLayer(i, plan, policy, budget, info) for i, plan in enumerate(plans)]
        super().__init__(layers=layers)
        self.recipe, self.policy, self.info = plans[0].recipe, policy, info

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def expected_nbytes(self) -> int:
        return sum(layer.expected_nbytes() for layer in self.layers)

    def fp16_nbytes(self) -> int:
        return sum(layer.fp16_nbytes() for layer in self.layers)

    def kept_tokens(self) -> int:
        """Tokens held, summed over layers, sequences and KV heads."""
        return sum(layer.kept_tokens() for layer in self.layers)

    def kept_fraction(self) -> float:
        """Kept tokens / tokens seen, over every (layer, sequence, KV head) stream."""
        seen = sum(sum(layer.lengths) * len(layer.streams[0]) for layer in self.layers if layer.is_initialized)
        return self.kept_tokens() / seen if seen else 1.0

    def memory_report(self) -> dict:
        held, fp16 = self.nbytes(), self.fp16_nbytes()
        layer0 = self.layers[0]
        elements = fp16 // 2
        return {
            "tokens": self.get_seq_length(),
            "batch": len(layer0.streams) if layer0.is_initialized else 0,
            "cache_bytes": held,
            "expected_cache_bytes": self.expected_nbytes(),
            "fp16_cache_bytes": fp16,
            "compression_ratio": fp16 / held if held else 0.0,
            "bits_per_element": 8 * held / elements if elements else 0.0,
            "kept_tokens": self.kept_tokens(),
            "kept_fraction": self.kept_fraction(),
            "policy": self.policy.name,
        }
