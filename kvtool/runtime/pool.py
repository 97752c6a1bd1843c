"""A pool of fixed-size blocks for one decoder layer: every tensor has a leading block dimension.

A `BlockPool` holds named tensors ``{name: (capacity, *shape)}`` (for example the float K/V
of ``block_size`` tokens, or packed codes with their scales beside them) and a byte
``in_use`` (capacity,) marking which block ids belong to some stream. Block ids are rows.

* `allocate(n)` hands out the lowest free ids; when too few are free the pool grows to
  ``ceil(1.25 x needed)`` blocks (geometric, so appends are amortized O(1): a growth copies
  every block once, and the next growth needs a quarter more blocks first).
* `release(ids)` returns blocks; `shrink_plan` + `apply_moves` compact the pool when many
  blocks were freed (beam search, finished sequences), so reserved bytes stay within
  1.25 x the bytes in use plus a block per stream.

No Python object per block or per stream: ids are int64 tensors on the pool's device.
"""

from __future__ import annotations

import math

import numpy as np

import torch

GROWTH = 1.25


class BlockPool:
    """Named block tensors, a free map, geometric growth; see the module docstring."""

    def __init__(self, spec: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        self.spec = dict(spec)
        self.device = torch.device(device)
        self.tensors = {name: torch.empty((0, *shape), dtype=dtype, device=self.device) for name, (shape, dtype) in self.spec.items()}
        self.in_use = torch.zeros(0, dtype=torch.bool, device=self.device)
        self.used = 0  # blocks in use (a Python int: no device sync to read it)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """{name: (capacity, *shape)} the block tensors (replaced whole when the pool grows or shrinks)."""
        return self._tensors

    @tensors.setter
    def tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._flat_views: dict[str, torch.Tensor] = {}  # views of these tensors only: no old storage stays alive
        self._sides: dict[str, dict[str, torch.Tensor]] = {}
        self._host: dict[tuple[str, bool], np.ndarray] = {}  # `host_flat`'s arrays of these tensors

    def flat(self, name: str) -> torch.Tensor:
        """Tensor ``name`` viewed per slot, (capacity x tokens per block, ...): one view per pool size, reused
        (decode steps ask for it in every layer)."""
        view = self._flat_views.get(name)
        if view is None:
            t = self._tensors[name]
            view = self._flat_views[name] = t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])
        return view

    def host_flat(self, name: str, as_bytes: bool = False) -> np.ndarray:
        """`flat` of a CPU pool as a host array sharing its memory, (slots, ...) in the tensor's dtype or, ``as_bytes``,
        (slots, bytes per slot) uint8: built once per pool size (a compiled step that moves slots asks in every layer)."""
        held = self._host.get((name, as_bytes))
        if held is None:
            view = self.flat(name)
            if as_bytes:
                view = view.reshape(view.shape[0], -1).view(torch.uint8)
            held = self._host[(name, as_bytes)] = view.numpy()
        return held

    def side(self, prefix: str) -> dict[str, torch.Tensor]:
        """{name without ``prefix``: tensor} of the tensors whose name starts with ``prefix`` (e.g. a body pool's
        keys ``k.``): built once per pool size, reused (the kernels ask for it in every layer at every step)."""
        side = self._sides.get(prefix)
        if side is None:
            side = self._sides[prefix] = {name[len(prefix):]: t for name, t in self._tensors.items() if name.startswith(prefix)}
        return side

    # --- sizes ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.in_use.shape[0]

    def block_nbytes(self) -> int:
        """Bytes of one block over all named tensors."""
        total = 0
        for shape, dtype in self.spec.values():
            total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return total

    def used_nbytes(self) -> int:
        return self.used * self.block_nbytes()

    def reserved_nbytes(self) -> int:
        """Bytes allocated: every block row (free or not) and the free map."""
        return self.capacity * (self.block_nbytes() + 1)

    # --- allocation ----------------------------------------------------------------------------
    def allocate(self, n: int) -> torch.Tensor:
        """(n,) int64 ids of free blocks (lowest first), growing the pool when needed."""
        if n <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if self.capacity - self.used < n:
            self._grow(math.ceil(GROWTH * (self.used + n)))
        ids = torch.nonzero(~self.in_use).flatten()[:n]
        self.in_use[ids] = True
        self.used += n
        return ids

    def release(self, ids: torch.Tensor) -> None:
        """Return blocks (ids must be in use, each once)."""
        if ids.numel() == 0:
            return
        self.in_use[ids] = False
        self.used -= ids.numel()

    def clear(self) -> None:
        """Free every block and the memory behind them."""
        self.tensors = {name: t[:0].clone() for name, t in self.tensors.items()}
        self.in_use = self.in_use[:0].clone()
        self.used = 0

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        self.tensors = {
            name: torch.cat([t, t.new_zeros((extra, *t.shape[1:]))]) for name, t in self.tensors.items()
        }
        self.in_use = torch.cat([self.in_use, self.in_use.new_zeros(extra)])

    # --- compaction ----------------------------------------------------------------------------
    def shrink_plan(self, slack_blocks: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(old ids, new ids, new capacity) compacting the pool when capacity > 1.25 x used + slack; else None.

        The target keeps ``used + max(slack, used / 8)`` rows, so a shrink is followed by many
        allocations or frees before the next resize (amortized O(1)).
        """
        if self.capacity <= math.ceil(GROWTH * self.used) + slack_blocks:
            return None
        target = self.used + max(slack_blocks, self.used // 8)
        movers = torch.nonzero(self.in_use[target:]).flatten() + target
        holes = torch.nonzero(~self.in_use[:target]).flatten()[: movers.numel()]
        return movers, holes, target

    def apply_moves(self, old: torch.Tensor, new: torch.Tensor, capacity: int) -> None:
        """Copy blocks ``old`` to free rows ``new`` and cut the pool to ``capacity`` rows."""
        moved = {}
        for name, t in self.tensors.items():
            t[new] = t[old]
            moved[name] = t[:capacity].clone()
        self.tensors = moved
        self.in_use[new] = True
        self.in_use[old] = False
        self.in_use = self.in_use[:capacity].clone()
