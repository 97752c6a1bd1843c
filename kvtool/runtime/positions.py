"""What the cache learns about each forward besides K/V: true positions, token ids, RoPE.

* `ForwardProbes`: hooks on the model record the ``position_ids`` the model's rotary module
  saw (left padding and custom positions make them differ from slot numbers) and the input
  ids (FastGen keeps special and punctuation tokens). A hook on the model's forward drops
  both when the forward ends, so nothing pins the caller's tensors between calls.
* `RopeTable`: cos/sin for any positions straight from the rotary module's ``inv_freq``
  and ``attention_scaling`` (what its forward computes), without calling the module, so
  the cache's own rotations never overwrite the recorded positions.
* `SequencePositions`: the positions of the real tokens of each sequence, shared by all
  layers of a cache that does not evict (keys stored before RoPE are re-rotated at them).
"""

from __future__ import annotations

import torch


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
    """cos, sin (..., T, R) for positions (..., T), as the model's rotary module computes them."""

    def __init__(self, rotary_module: torch.nn.Module) -> None:
        self.module = rotary_module

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.module.inv_freq.float()  # (R/2,), current (dynamic RoPE types update it in forward)
        scaling = float(getattr(self.module, "attention_scaling", 1.0))
        freqs = positions.to(inv_freq.device).float()[..., None] * inv_freq  # (..., T, R/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (..., T, R)
        return emb.cos() * scaling, emb.sin() * scaling


def rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE (or its inverse) of keys (S, g, T, D) float32 with cos/sin (S, T, R), R <= D (rotate-half layout)."""
    rotary = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]  # (S, 1, T, R)
    x, rest = keys[..., :rotary], keys[..., rotary:]
    half = rotary // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    if inverse:  # exact inverse, scaling included (cos^2 + sin^2 = scaling^2)
        out = (x * cos - rotated_half * sin) / (cos * cos + sin * sin)
    else:
        out = x * cos + rotated_half * sin
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


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
