"""What the cache learns about each forward besides K/V: true positions, token ids, RoPE.

* `ForwardProbes`: hooks on the model record the ``position_ids`` the model's rotary module
  saw (left padding and custom positions make them differ from slot numbers) and the input
  ids (FastGen keeps special and punctuation tokens). A hook on the model's forward drops
  both when the forward ends, so nothing pins the caller's tensors between calls.
* `RopeTable`: each layer's RoPE (`kvtool.models.rope.RopeSpec`, read by the adapter):
  cos/sin for any positions from the frequencies and ``attention_scaling`` without calling
  the rotary module, so the cache's own rotations never overwrite the recorded positions.
* `SequencePositions`: the positions of the real tokens of each sequence, shared by all
  layers of a cache that does not evict (keys stored before RoPE are re-rotated at them).
"""

from __future__ import annotations

import torch

from kvtool.models.rope import KeyRotation, RopeSpec, apply_rope, unapply_rope


class ForwardProbes:
    """Position ids and input ids of the forward in progress (None outside a forward or when unknown)."""

    def __init__(self, model: torch.nn.Module, rotary_module: torch.nn.Module, record_ids: bool) -> None:
        self.positions: torch.Tensor | None = None  # (B, t) or (1, t) int64
        self.input_ids: torch.Tensor | None = None  # (B, t)
        self.handles = [rotary_module.register_forward_hook(self._record_positions, with_kwargs=True)]
        if record_ids:
            self.handles.append(model.get_input_embeddings().register_forward_pre_hook(self._record_ids))
        self.handles.append(model.register_forward_hook(self._clear))

    def _record_positions(self, module, args, kwargs, output) -> None:
        position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        self.positions = None if position_ids is None else position_ids.detach()

    def _record_ids(self, module, args) -> None:
        ids = args[0] if args else None
        self.input_ids = ids.detach() if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else None

    def _clear(self, *args) -> None:
        self.positions = self.input_ids = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class RopeTable:
    """Each layer's RoPE, as the model applies it: the adapter's `layer_spec(i).rope` (`RopeSpec`).

    Layers may differ (Gemma 3: base 10k on sliding layers, 1M on global ones) and so may the
    layout (Cohere rotates interleaved pairs); partial rotary leaves the last D - R dims alone.
    cos/sin come from the frequencies and attention scaling, never from a call of the rotary
    module, so the recorded positions stay those of the model's forward.
    """

    def __init__(self, ropes) -> None:
        self.ropes: tuple[RopeSpec, ...] = tuple(ropes)  # one per decoder layer
        kinds: list[int] = []  # per layer: the first layer whose RoPE gives the same cos/sin for every position
        for layer, spec in enumerate(self.ropes):
            kinds.append(next((kinds[i] for i in range(layer) if spec.same_as(self.ropes[i])), layer))
        self.kinds = tuple(kinds)

    @classmethod
    def from_adapter(cls, adapter) -> "RopeTable":
        return cls(adapter.layer_spec(i).rope for i in range(adapter.geometry.num_layers))

    def kind(self, layer: int) -> int:
        """The first layer whose RoPE is layer ``layer``'s (same cos/sin at every position)."""
        return self.kinds[layer]

    def cos_sin(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (..., T, R) float32 of layer ``layer`` for positions (..., T)."""
        return self.ropes[layer].cos_sin(positions)

    def key_rotation(self, layer: int, cos: torch.Tensor, sin: torch.Tensor) -> KeyRotation:
        """Layer ``layer``'s RoPE at cos, sin (S, T, R) as a function of keys (S, g, T, D) (`KeyRotation`)."""
        return KeyRotation(cos, sin, self.ropes[layer].interleaved)

    def rotate(self, layer: int, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """RoPE (or its exact inverse, scaling included) of keys (S, g, T, D) float32 with cos/sin (S, T, R)."""
        interleaved = self.ropes[layer].interleaved
        return unapply_rope(keys, cos, sin, interleaved) if inverse else apply_rope(keys, cos, sin, interleaved)


class SequencePositions:
    """Positions (B, capacity) int32 of each sequence's real tokens, in order; grows geometrically."""

    def __init__(self, batch: int, device) -> None:
        self.table = torch.zeros(batch, 0, dtype=torch.int32, device=device)
        self.count = torch.zeros(batch, dtype=torch.int64, device=device)

    def append(self, positions: torch.Tensor, counts: torch.Tensor) -> None:
        """Add the first counts[b] entries of positions (B, t) to each sequence."""
        end = self.count + counts
        need = int(end.max()) if end.numel() else 0
        if need > self.table.shape[1]:
            width = max(need, int(self.table.shape[1] * 1.25) + 1)
            self.table = torch.cat([self.table, self.table.new_zeros(self.table.shape[0], width - self.table.shape[1])], 1)
        j = torch.arange(positions.shape[1], device=positions.device)
        valid = j < counts[:, None]
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(valid)
        self.table[rows[valid], (self.count[:, None] + j)[valid]] = positions[valid].to(torch.int32)
        self.count = end

    def lookup(self, sequence: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """Positions of token_index (S, T) of sequence (S,)."""
        index = token_index.clamp(0, max(self.table.shape[1] - 1, 0))
        return self.table[sequence[:, None], index]

    def select(self, rows: torch.Tensor) -> None:
        self.table, self.count = self.table[rows], self.count[rows]

    def tensors(self) -> list[torch.Tensor]:
        return [self.table, self.count]
