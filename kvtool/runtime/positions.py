"""Original token positions for caches that store keys before RoPE.

KVQuant quantizes keys *before* RoPE. transformers hands the cache keys after
RoPE, so the cache rotates them back (RoPE is orthogonal) before encoding and
rotates the decoded keys forward again when it reads them. Both need each token's
true position, which is not its slot with left padding (or, later, after
eviction). `PositionProbe` records the ``position_ids`` of every forward with a
hook on the model's rotary module; `PositionTracker` keeps them per slot.
"""

from __future__ import annotations

from typing import Callable

import torch


class PositionProbe:
    """Forward hook on the rotary module: remembers the position_ids (B, t) of the latest forward."""

    def __init__(self, rotary_module: torch.nn.Module) -> None:
        self.last: torch.Tensor | None = None
        self.handle = rotary_module.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output) -> None:
        position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        self.last = None if position_ids is None else position_ids.detach()

    def remove(self) -> None:
        self.handle.remove()


class PositionTracker:
    """Positions (B, T) int32 of every token slot of one cache, shared by all its layers.

    `commit` is called once per forward (by layer 0) with the number of new tokens; it
    takes the probe's position_ids when they match, else continues 0, 1, 2, ... (right
    for unpadded input when no probe is attached).
    """

    def __init__(self, probe: PositionProbe | None, cos_sin: Callable[[torch.Tensor], tuple]) -> None:
        self.probe, self.rope_cos_sin = probe, cos_sin
        self.positions: torch.Tensor | None = None  # (B, T) int32
        self._cos_sin: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # per forward: layers share it

    def commit(self, batch: int, new_tokens: int, device: torch.device) -> None:
        seen = 0 if self.positions is None else self.positions.shape[1]
        last = self.probe.last if self.probe is not None else None
        if last is not None and last.shape[-1] == new_tokens:
            new = last.to(device=device, dtype=torch.int32).expand(batch, -1)  # (B, t)
        else:
            new = torch.arange(seen, seen + new_tokens, device=device, dtype=torch.int32).expand(batch, -1)
        self.positions = new.clone() if self.positions is None else torch.cat([self.positions, new], dim=1)
        self._cos_sin.clear()

    def cos_sin(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, end-start, R) for the slots [start, end); computed once per forward, shared by the layers."""
        if (start, end) not in self._cos_sin:
            self._cos_sin[(start, end)] = self.rope_cos_sin(self.positions[:, start:end].long())
        return self._cos_sin[(start, end)]

    def select(self, fn) -> None:
        if self.positions is not None:
            self.positions = fn(self.positions)
        self._cos_sin.clear()

    def nbytes(self) -> int:
        return 0 if self.positions is None else self.positions.numel() * self.positions.element_size()


class TokenProbe:
    """Forward pre-hook on the input embedding: remembers the input_ids (B, t) of the latest forward.

    FastGen keeps special and punctuation tokens, so the evicting cache needs the ids
    of the tokens whose K/V it receives. None when the model was fed embeddings.
    """

    def __init__(self, embedding: torch.nn.Module) -> None:
        self.last: torch.Tensor | None = None
        self.handle = embedding.register_forward_pre_hook(self._record)

    def _record(self, module, args) -> None:
        ids = args[0] if args else None
        self.last = ids.detach() if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else None

    def remove(self) -> None:
        self.handle.remove()
