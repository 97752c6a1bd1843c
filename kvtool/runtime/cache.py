"""kvtool's KV cache: a transformers 5.x `Cache` whose storage really is small.

`KvtoolCache` holds one `KvtoolLayer` per decoder layer, each with a paged store
(`store.py`: float blocks for sinks, the recent window and unquantized recipes; body
blocks of packed codes or latents; a block table per (sequence, KV head) stream). Every
recipe goes through the same store: dense or evicting, quantized or low-rank or float.
Attention runs over the store itself (`paged_attention.py`); the model's attention
modules call kvtool's attention function, which the cache claims after each ``update``.

Accounting, checked from outside in tests (walking every tensor reachable from the cache):
``nbytes()`` = bytes of blocks in use + block tables and per-stream/per-sequence metadata;
``reserved_nbytes()`` = what is allocated (every pool row, used or free). Per-model
constants the cache reads but does not own (codebooks, Palu bases, a FastGen profile) are
``constant_nbytes()``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from kvtool.runtime.eviction import BudgetRule
from kvtool.runtime.memory import reachable_tensors, storage_nbytes
from kvtool.runtime.layer import PUNCT, SPECIAL, KvtoolLayer, LayerPlan, build_formats
from kvtool.runtime.positions import ForwardProbes, RopeTable, SequencePositions
from kvtool.runtime.store import take_rows


@dataclass
class CacheContext:
    """What the layers of one cache share: probes, RoPE, the policy and budgets, positions."""

    probes: ForwardProbes | None
    rope: RopeTable
    sliding_windows: tuple[int | None, ...] = ()
    policy: object | None = None  # EvictionPolicy
    budget: BudgetRule | None = None
    special_ids: torch.Tensor | None = None
    punct_ids: torch.Tensor | None = None
    needs_sequence_positions: bool = False
    backend: str = "torch"
    shared_formats: dict = field(default_factory=dict)  # (layer, head_dim, heads, dtype) -> formats, shared by a runtime's caches
    sequence_positions: SequencePositions | None = field(default=None, init=False)
    kernel_steps: int = field(default=0, init=False)  # layer decode steps a decode kernel ran (Triton or Numba)
    kernel_encodes: int = field(default=0, init=False)  # body blocks (keys and values counted apart) the encode kernel wrote
    sparse_read_tokens: int = field(default=0, init=False)  # stored tokens sparse decode steps read (whole groups)
    sparse_held_tokens: int = field(default=0, init=False)  # stored tokens those steps could have read
    # PyramidInfer's prefill (`prefill_shrink`): (true positions (B, t) of the rows this layer computes, tokens T of the
    # forward) while a layer computes only some of the prompt's tokens, else None
    shrink: tuple[torch.Tensor, int] | None = field(default=None, init=False)
    # (id of a forward's attention mask, t) -> (weak reference to that mask, every new token real): see `all_real`
    _all_real: dict = field(default_factory=dict, init=False, repr=False)
    # RoPE of one forward's body positions on the host: index of a layer's RoPE -> (positions, cos, sin); see
    # `body_cos_sin` (emptied when the forward's last layer is done, so no table outlives it)
    _cos_sin: dict = field(default_factory=dict, init=False, repr=False)
    # FastGen's token classes of one forward on the host: (B, t, sink tokens) -> (input ids, positions, classes); see
    # `token_classes` (emptied with `_cos_sin`)
    _classes: dict = field(default_factory=dict, init=False, repr=False)

    def all_real(self, attention_mask: torch.Tensor, t: int, real: torch.Tensor) -> bool:
        """``bool(real.all())`` for the real-token flags (B, t) read from ``attention_mask``, once per forward: every
        layer of a forward gets the same mask object, and on a GPU each reading is a host sync (one per forward
        instead of one per layer). Keyed on the mask's identity through a weak reference (a later mask that reuses
        the address is a different object) and holds no tensor."""
        key = (id(attention_mask), t)
        held = self._all_real.get(key)
        if held is not None and held[0]() is attention_mask:
            return held[1]
        value = bool(real.all())
        if len(self._all_real) >= 8:  # masks of finished forwards (Gemma 3 has two per forward)
            self._all_real.clear()
        self._all_real[key] = (weakref.ref(attention_mask), value)
        return value

    def count_sparse_reads(self, read: int, held: int) -> None:
        self.sparse_read_tokens += read
        self.sparse_held_tokens += held

    def formats(self, layer: int, plan: LayerPlan, head_dim: int, heads: int, dtype: torch.dtype):
        """(key format, value format, heads per stream) of a layer, built once per runtime."""
        key = (layer, head_dim, heads, dtype)
        if key not in self.shared_formats:
            self.shared_formats[key] = build_formats(plan.recipe, plan.fitted_for, head_dim, heads, dtype)
        return self.shared_formats[key]

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if layer < len(self.sliding_windows) else None

    # --- per forward ---------------------------------------------------------------------------
    def body_cos_sin(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (S, T, R) of layer ``layer``'s RoPE at body positions (S, T): on the host computed once per forward
        for every layer with the same RoPE and the same positions (every layer of a model that keeps no positions per
        slot: SmolLM2-135M computed 30 tables a step for one), else as `RopeTable.cos_sin`."""
        if positions.device.type != "cpu":  # (on a GPU the comparison would be a host sync per layer)
            return self.rope.cos_sin(layer, positions)
        kind = self.rope.kind(layer)
        held = self._cos_sin.get(kind)
        if held is not None and held[0].shape == positions.shape and torch.equal(held[0], positions):
            return held[1], held[2]
        cos, sin = self.rope.cos_sin(layer, positions)
        self._cos_sin[kind] = (positions, cos, sin)
        return cos, sin

    def end_layer(self, layer: int, failed: bool = False) -> None:
        """A layer's attention is done: after the forward's last layer, or a layer that raised (the forward stops
        there), drop what was shared within the forward."""
        if failed or layer == len(self.rope.ropes) - 1:
            self._cos_sin.clear()
            self._classes.clear()

    def begin(self, batch: int, device) -> None:
        if self.needs_sequence_positions and self.sequence_positions is None:
            self.sequence_positions = SequencePositions(batch, device)

    def positions(self, b: int, t: int, seen: int, device) -> torch.Tensor:
        """(B, t) int64 positions of the new tokens: the rows' own while a layer computes part of the prompt, the
        model's position_ids, else slots seen .. seen+t-1."""
        if self.shrink is not None and self.shrink[0].shape[-1] == t:
            return self.shrink[0].to(device=device, dtype=torch.int64).expand(b, t)
        last = None if self.probes is None else self.probes.positions
        if last is not None and last.shape[-1] == t:
            return last.to(device=device, dtype=torch.int64).expand(b, t)
        return torch.arange(seen, seen + t, device=device).expand(b, t)

    def token_classes(self, b: int, t: int, positions: torch.Tensor, sink_tokens: int) -> torch.Tensor:
        """(B, t) uint8 FastGen classes: SPECIAL (special id or a sink position) | PUNCT. On the host computed once per
        forward for every layer with the same positions (FastGen's decode steps on the CPU kernel ask in every layer)."""
        ids = None if self.probes is None else self.probes.input_ids
        if positions.device.type != "cpu":  # (on a GPU the comparison would be a host sync per layer)
            return self._token_classes(b, t, positions, sink_tokens, ids)
        key = (b, t, sink_tokens)
        held = self._classes.get(key)
        if held is not None and held[0] is ids and held[1].shape == positions.shape and torch.equal(held[1], positions):
            return held[2]
        classes = self._token_classes(b, t, positions, sink_tokens, ids)
        self._classes[key] = (ids, positions, classes)
        return classes

    def _token_classes(self, b: int, t: int, positions: torch.Tensor, sink_tokens: int, ids) -> torch.Tensor:
        special = positions < sink_tokens
        punct = torch.zeros_like(special)
        if ids is not None and ids.shape[-1] == t:
            ids = ids.to(positions.device).expand(b, t)
            if self.special_ids is not None:
                special |= torch.isin(ids, self.special_ids.to(ids.device))
            if self.punct_ids is not None:
                punct = torch.isin(ids, self.punct_ids.to(ids.device))
        return special.to(torch.uint8) * SPECIAL + punct.to(torch.uint8) * PUNCT

    def record(self, positions: torch.Tensor, counts: torch.Tensor) -> None:
        """Layer 0 adds the real new tokens' positions (B, t), real first, to each sequence."""
        if self.sequence_positions is not None:
            self.sequence_positions.append(positions, counts)

    def select(self, sequences: torch.Tensor) -> None:
        if self.sequence_positions is not None:
            self.sequence_positions.select(sequences)

    # --- positions of stored tokens --------------------------------------------------------------
    def float_positions_at(self, layer: KvtoolLayer, slot: torch.Tensor) -> torch.Tensor:
        """Positions (S, W) of float slots ``slot`` (S, W) of every stream of ``layer``."""
        store = layer.store
        if "pos" in store.layout.meta:
            return take_rows(store.float_flat("pos"), store.float_slot_ids(slot)).long()
        n_sink, body = store.lengths("n_sink")[:, None], store.lengths("body_len")[:, None] * store.bs
        return self._lookup(layer, torch.where(slot < n_sink, slot, slot + body))

    def float_block_positions(self, layer: KvtoolLayer, ids: torch.Tensor, c0: int) -> torch.Tensor:
        """Positions (S, nb * fbs) of float table columns [c0, c0 + nb) (block ids ``ids`` (S, nb))."""
        store = layer.store
        if "pos" in store.layout.meta:
            return store.read_blocks(store.float_pool, ("pos",), ids)["pos"].long()
        slot = torch.arange(c0 * store.fbs, (c0 + ids.shape[1]) * store.fbs, device=ids.device).expand(ids.shape[0], -1)
        return self.float_positions_at(layer, slot)

    def body_positions(self, layer: KvtoolLayer, c0: int, c1: int, ids: torch.Tensor) -> torch.Tensor:
        """Positions (S, nb * bs) of body table columns [c0, c1) (block ids ``ids`` (S, nb))."""
        store = layer.store
        if "pos" in store.layout.meta:
            return store.read_blocks(store.body_pool, ("pos",), ids)["pos"].long()
        token = store.lengths("n_sink")[:, None] + torch.arange(c0 * store.bs, c1 * store.bs, device=ids.device)
        return self._lookup(layer, token)

    def _lookup(self, layer: KvtoolLayer, token: torch.Tensor) -> torch.Tensor:
        if self.sequence_positions is None:
            return token  # no positions recorded: slots are positions (unpadded, no custom ids)
        sequence = torch.arange(layer.lengths.shape[0], device=token.device).repeat_interleave(layer.groups)
        return self.sequence_positions.lookup(sequence, token).long()

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.sequence_positions is None else self.sequence_positions.tensors()


class KvtoolCache(Cache):
    """A `transformers.Cache` of `KvtoolLayer`s; build it with `CompressedRuntime.new_cache()`."""

    def __init__(self, plans: list[LayerPlan], context: CacheContext, recipe=None) -> None:
        super().__init__(layers=[KvtoolLayer(i, plan, context) for i, plan in enumerate(plans)])
        # the runtime's recipe (layer_overrides included); each layer stores with its plan's resolved one
        self.recipe, self.context = recipe or plans[0].recipe, context
        self.plans = plans

    @property
    def policy(self):
        return self.context.policy

    @property
    def backend(self) -> str:
        return self.context.backend

    def _live(self) -> list[KvtoolLayer]:
        return [layer for layer in self.layers if layer.is_initialized]

    # --- accounting ------------------------------------------------------------------------------
    def _extra_nbytes(self) -> int:
        tensors = self.context.tensors() + [t for layer in self._live() for t in (layer.lengths, layer.group_of_stream, *layer.stream_tensors())]
        return sum(t.numel() * t.element_size() for t in tensors)

    def nbytes(self) -> int:
        """Bytes held: blocks in use, block tables, positions and per-stream metadata."""
        return sum(layer.store.used_nbytes() for layer in self._live()) + self._extra_nbytes()

    def reserved_nbytes(self) -> int:
        """Bytes allocated by the pools (used or free) plus tables and metadata."""
        return sum(layer.store.reserved_nbytes() for layer in self._live()) + self._extra_nbytes()

    def expected_nbytes(self) -> int:
        """Analytic bytes from token counts: whole float blocks, body blocks, tables (what the recipe promises)."""
        return sum(layer.store.expected_nbytes() for layer in self._live()) + self._extra_nbytes()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache owns between forwards (for measurements from outside)."""
        return [t for layer in self._live() for t in layer.tensors()] + self.context.tensors()

    def constant_roots(self) -> list:
        """Per-model objects the cache reads but does not own: plans (fitted tensors), the runtime's
        formats (codebooks, bases), the policy (profile), FastGen token ids, each layer's RoPE frequencies."""
        context = self.context
        return [self.plans, context.shared_formats, context.policy, context.budget, context.special_ids, context.punct_ids,
                context.rope]

    def constant_nbytes(self) -> int:
        """Bytes of the per-model tensors the cache reads (shared by every cache of a runtime)."""
        return storage_nbytes(reachable_tensors(self.constant_roots()))

    def kept_tokens(self) -> int:
        """Tokens held, summed over layers, sequences and KV heads."""
        return sum(int(layer.store.tokens().sum()) * layer.g for layer in self._live())

    def seen_tokens(self) -> int:
        """Real tokens seen, summed over layers, sequences and KV heads."""
        return sum(int(layer.lengths.sum()) * layer.heads for layer in self._live())

    def kept_fraction(self) -> float:
        seen = self.seen_tokens()
        return self.kept_tokens() / seen if seen else 1.0

    def fp16_nbytes(self) -> int:
        """Bytes transformers' own cache would hold in 16 bits for the real tokens seen (K and V): every token, but a
        sliding-window layer of window W only its last W - 1 per sequence (`DynamicSlidingWindowLayer`)."""
        total = 0
        for layer in self._live():
            window = self.context.sliding_window(layer.index)
            lengths = layer.lengths.clamp(max=window - 1) if window else layer.lengths
            total += 2 * int(lengths.sum()) * layer.heads * layer.store.layout.head_dim * 2
        return total

    def memory_report(self) -> dict:
        """Bytes held and allocated vs the 16-bit cache for the same tokens."""
        held, fp16 = self.nbytes(), self.fp16_nbytes()
        elements = fp16 // 2
        live = self._live()
        report = {
            "tokens": self.get_seq_length(),
            "batch": live[0].lengths.shape[0] if live else 0,
            "cache_bytes": held,
            "reserved_bytes": self.reserved_nbytes(),
            "expected_cache_bytes": self.expected_nbytes(),
            "fp16_cache_bytes": fp16,
            "compression_ratio": fp16 / held if held else 0.0,
            "bits_per_element": 8 * held / elements if elements else 0.0,
            "kept_tokens": self.kept_tokens(),
            "kept_fraction": self.kept_fraction(),
            "backend": self.backend,
            "kernel_steps": self.context.kernel_steps,
            "kernel_encodes": self.context.kernel_encodes,
        }
        if any(layer.store.layout.summary_tokens for layer in live):  # sparse attention: its bytes and its reads
            report["key_summary_bytes"] = sum(layer.store.summary_nbytes() for layer in live)
            if any(layer.store.layout.token_sums for layer in live):
                report["token_sum_bytes"] = sum(layer.store.summary_nbytes(("ksum", "vsum", "k2sum")) for layer in live)
            held_tokens = self.context.sparse_held_tokens
            report["sparse_read_fraction"] = self.context.sparse_read_tokens / held_tokens if held_tokens else 1.0
        if self.policy is not None:
            report["policy"] = self.policy.name
        return report
