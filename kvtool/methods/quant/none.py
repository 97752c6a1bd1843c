"""No compression: blocks are stored in the model's float dtype (the 16-bit baseline)."""

from __future__ import annotations

import torch

from kvtool.methods.base import BlockQuantizer
from kvtool.methods.registry import register


@register("none")
class NoQuantizer(BlockQuantizer):
    """Stores the float block as is; `decode(encode(x))` returns ``x`` exactly."""

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"data": x.to(self.dtype).contiguous()}  # (B, H_kv, N, S, D)

    def decode(self, storage: dict[str, torch.Tensor]) -> torch.Tensor:
        return storage["data"]

    def block_nbytes(self) -> int:
        return self.block_size * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
