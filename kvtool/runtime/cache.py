"""The compressed KV cache: a transformers 5.x `Cache` whose storage really is small.

Per layer, each (sequence, KV head) stream of T tokens is held in three parts,
in token order:

    [ sinks: first ``sink_tokens`` tokens, model float dtype          ]
    [ body:  N blocks of ``block_size`` tokens, stored by a quantizer  ]  <- packed codes + fp16 scales
    [ recent: the last tokens, model float dtype (KIVI residual)      ]

New tokens enter ``recent``; whenever ``recent`` holds at least
``recent_tokens + block_size`` tokens, its oldest full blocks are encoded into the
body and the float copies are dropped. So after T tokens the body holds
``max(0, (T - sinks - recent_tokens) // block_size)`` blocks.

Storage tensors (H = KV heads, never expanded to query heads):
  sinks/recent: (B, H, t, D); body: ``{name: (B, H, N, ...)}`` as the quantizer defines.

`update()` returns float keys/values for attention: previously cached tokens
decoded from storage, the tokens of the current forward as they came in (so
tokens of one forward see each other uncompressed, as in a real prefill). The
decoded tensors are temporaries of one attention call; only the compact
storage persists. `nbytes()` sums the bytes of the storage actually held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtool.methods.registry import quantizer_class
from kvtool.models.rope import apply_rope, unapply_rope
from kvtool.recipe import Recipe
from kvtool.runtime.positions import PositionTracker


@dataclass(frozen=True)
class LayerPlan:
    """What one layer's cache stores: the recipe plus this layer's fitted tensors (keys./values. prefixed)."""

    recipe: Recipe
    fitted: dict[str, torch.Tensor] = field(default_factory=dict)

    def fitted_for(self, part: str) -> dict[str, torch.Tensor]:
        prefix = f"{part}."
        return {k[len(prefix) :]: v for k, v in self.fitted.items() if k.startswith(prefix)}


def storage_dtype(recipe: Recipe, model_dtype: torch.dtype) -> torch.dtype:
    """The float dtype the cache stores (``cache.float_dtype``; ``model`` = the model's own)."""
    name = recipe.cache.float_dtype
    return model_dtype if name == "model" else getattr(torch, name)


def _cat_storage(old: dict | None, new: dict) -> dict:
    if old is None:
        return new
    return {k: torch.cat([old[k], new[k]], dim=2) for k in new}


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class CompressedLayer(CacheLayerMixin):
    """One decoder layer's compressed cache (see the module docstring for the layout)."""

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, plan: LayerPlan, tracker: PositionTracker | None = None, commits_positions: bool = False) -> None:
        super().__init__()
        self.plan = plan
        self.tracker = tracker  # set when keys are stored before RoPE (shared by all layers)
        self.commits_positions = commits_positions  # layer 0 records each forward's positions
        self.length = 0  # logical tokens held (= physical: this layer evicts nothing)

    # --- transformers' CacheLayerMixin contract -------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        recipe, head_dim = self.plan.recipe, key_states.shape[-1]
        block, store = recipe.cache.block_size, storage_dtype(recipe, key_states.dtype)
        self.key_quantizer = quantizer_class(recipe.keys.method)(
            recipe.keys, head_dim, block, store, self.plan.fitted_for("keys")
        )
        self.value_quantizer = quantizer_class(recipe.values.method)(
            recipe.values, head_dim, block, store, self.plan.fitted_for("values")
        )
        self.sink_k = key_states[:, :, :0].to(store)  # (B, H, 0, D)
        self.sink_v = value_states[:, :, :0].to(store)
        self.recent_k, self.recent_v = self.sink_k.clone(), self.sink_v.clone()
        self.body_k: dict[str, torch.Tensor] | None = None
        self.body_v: dict[str, torch.Tensor] | None = None
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new K/V (B, H, t, D); return (B, H, T_old + t, D) float K/V for attention."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.tracker is not None and self.commits_positions:
            self.tracker.commit(key_states.shape[0], key_states.shape[2], key_states.device)
        old_k, old_v = self.materialize()
        self._append(key_states, value_states)
        return torch.cat([old_k, key_states], dim=-2), torch.cat([old_v, value_states], dim=-2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvtool's compressed cache cannot be cropped (assisted decoding is not supported)")

    # --- storage ------------------------------------------------------------------------
    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        spec = self.plan.recipe.cache
        n_sink = min(max(spec.sink_tokens - self.sink_k.shape[2], 0), k.shape[2])
        if n_sink:
            self.sink_k = torch.cat([self.sink_k, k[:, :, :n_sink].to(self.sink_k.dtype)], dim=2)
            self.sink_v = torch.cat([self.sink_v, v[:, :, :n_sink].to(self.sink_v.dtype)], dim=2)
        self.recent_k = torch.cat([self.recent_k, k[:, :, n_sink:].to(self.recent_k.dtype)], dim=2)
        self.recent_v = torch.cat([self.recent_v, v[:, :, n_sink:].to(self.recent_v.dtype)], dim=2)
        self.length += k.shape[2]
        self._flush(spec.recent_tokens, spec.block_size)

    def _flush(self, recent_tokens: int, block: int) -> None:
        """Encode the oldest full blocks of ``recent`` beyond the recent window into the body."""
        n_blocks = max(0, (self.recent_k.shape[2] - recent_tokens) // block)
        if n_blocks == 0:
            return
        cut = n_blocks * block
        b, h, _, d = self.recent_k.shape
        start = self.sink_k.shape[2] + self.body_blocks() * block  # slot of the first flushed token
        k_blocks = self._to_stored_keys(self.recent_k[:, :, :cut], start).reshape(b, h, n_blocks, block, d)  # (B, H, N, S, D)
        v_blocks = self.recent_v[:, :, :cut].reshape(b, h, n_blocks, block, d)
        self.body_k = _cat_storage(self.body_k, self.key_quantizer.encode(k_blocks))
        self.body_v = _cat_storage(self.body_v, self.value_quantizer.encode(v_blocks))
        self.recent_k = self.recent_k[:, :, cut:].clone()  # clone: release the flushed float tokens
        self.recent_v = self.recent_v[:, :, cut:].clone()

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode everything held into float K/V (B, H, T, D) in token order (reference path)."""
        if not self.is_initialized:
            raise RuntimeError("cache layer is empty")
        parts_k, parts_v = [self.sink_k], [self.sink_v]
        if self.body_k is not None:
            b, h = self.sink_k.shape[:2]
            d = self.sink_k.shape[-1]
            body_k = self.key_quantizer.decode(self.body_k).reshape(b, h, -1, d)  # (B, H, N*S, D)
            parts_k.append(self._from_stored_keys(body_k, self.sink_k.shape[2]))
            parts_v.append(self.value_quantizer.decode(self.body_v).reshape(b, h, -1, d))
        parts_k.append(self.recent_k)
        parts_v.append(self.recent_v)
        return torch.cat(parts_k, dim=2).to(self.dtype), torch.cat(parts_v, dim=2).to(self.dtype)

    def _to_stored_keys(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        """Post-RoPE keys (B, H, t, D) of slots [start, start+t) -> the domain the body stores (pre-RoPE if asked)."""
        if not self.plan.recipe.keys.pre_rope:
            return keys
        cos, sin = self.tracker.cos_sin(start, start + keys.shape[2])  # (B, t, R)
        return unapply_rope(keys.float(), cos, sin)

    def _from_stored_keys(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        """Inverse of `_to_stored_keys`: rotate decoded pre-RoPE keys at their true positions."""
        if not self.plan.recipe.keys.pre_rope:
            return keys
        cos, sin = self.tracker.cos_sin(start, start + keys.shape[2])
        return apply_rope(keys.float(), cos, sin).to(keys.dtype)

    def _select_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.sink_k, self.sink_v = fn(self.sink_k), fn(self.sink_v)
        self.recent_k, self.recent_v = fn(self.recent_k), fn(self.recent_v)
        if self.body_k is not None:
            self.body_k = {k: fn(t) for k, t in self.body_k.items()}
            self.body_v = {k: fn(t) for k, t in self.body_v.items()}

    # --- accounting -----------------------------------------------------------------------
    def storage_tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds between forwards."""
        if not self.is_initialized:
            return []
        body = list((self.body_k or {}).values()) + list((self.body_v or {}).values())
        return [self.sink_k, self.sink_v, self.recent_k, self.recent_v, *body]

    def nbytes(self) -> int:
        """Bytes of storage actually held (sum over the tensors above)."""
        return sum(_tensor_bytes(t) for t in self.storage_tensors())

    def body_blocks(self) -> int:
        return 0 if self.body_k is None else next(iter(self.body_k.values())).shape[2]

    def expected_nbytes(self) -> int:
        """Analytic size for the tokens held, from the recipe and the quantizers' block sizes."""
        if not self.is_initialized:
            return 0
        spec = self.plan.recipe.cache
        b, h, _, d = self.sink_k.shape
        sinks = min(self.length, spec.sink_tokens)
        blocks = max(0, (self.length - sinks - spec.recent_tokens) // spec.block_size)
        floats = self.length - blocks * spec.block_size  # sinks + recent, K and V each
        float_bytes = 2 * b * h * floats * d * self.sink_k.element_size()
        block_bytes = b * h * blocks * (self.key_quantizer.block_nbytes() + self.value_quantizer.block_nbytes())
        return float_bytes + block_bytes

    def fp16_nbytes(self) -> int:
        """Bytes a 16-bit cache would hold for the same tokens (K and V)."""
        if not self.is_initialized:
            return 0
        b, h, _, d = self.sink_k.shape
        return 2 * b * h * self.length * d * 2


class CompressedCache(Cache):
    """A `transformers.Cache` of `CompressedLayer`s; pass it as ``past_key_values`` to forward or generate.

    ``tracker`` (required when the recipe stores keys before RoPE) keeps every slot's
    original position; `CompressedRuntime.new_cache` provides one wired to the model.
    """

    def __init__(self, plans: list[LayerPlan], tracker: PositionTracker | None = None) -> None:
        if plans[0].recipe.keys.pre_rope and tracker is None:
            raise ValueError("a recipe with keys.pre_rope needs a PositionTracker; use CompressedRuntime.new_cache()")
        super().__init__(layers=[CompressedLayer(plan, tracker, i == 0) for i, plan in enumerate(plans)])
        self.recipe, self.tracker = plans[0].recipe, tracker

    def _position_bytes(self) -> int:
        return 0 if self.tracker is None else self.tracker.nbytes()

    def nbytes(self) -> int:
        """Bytes of compressed storage held across all layers (and the positions, when tracked)."""
        return sum(layer.nbytes() for layer in self.layers) + self._position_bytes()

    def expected_nbytes(self) -> int:
        """Analytic bytes for the tokens held (what the artifact promises); positions are int32 per token."""
        layers = sum(layer.expected_nbytes() for layer in self.layers)
        if self.tracker is None or not self.layers[0].is_initialized:
            return layers
        return layers + 4 * self.layers[0].sink_k.shape[0] * self.get_seq_length()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.tracker is not None:
            self.tracker.select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.tracker is not None:
            self.tracker.select(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.tracker is not None:
            self.tracker.select(lambda t: t.repeat_interleave(repeats, dim=0))

    def fp16_nbytes(self) -> int:
        """Bytes a 16-bit cache would hold for the same tokens."""
        return sum(layer.fp16_nbytes() for layer in self.layers)

    def memory_report(self) -> dict:
        """Cache bytes held vs the 16-bit cache for the same tokens."""
        held, fp16 = self.nbytes(), self.fp16_nbytes()
        layer0 = self.layers[0]
        elements = fp16 // 2
        return {
            "tokens": self.get_seq_length(),
            "batch": layer0.sink_k.shape[0] if layer0.is_initialized else 0,
            "cache_bytes": held,
            "expected_cache_bytes": self.expected_nbytes(),
            "fp16_cache_bytes": fp16,
            "compression_ratio": fp16 / held if held else 0.0,
            "bits_per_element": 8 * held / elements if elements else 0.0,
        }
