"""No compression: blocks are stored as floats in the cache's float dtype (the 16-bit baseline).

Storage per block of one (sequence, KV head) stream: ``data`` (S, D) in the store's float dtype.
"""

from __future__ import annotations

import torch

from kvtool.methods.base import BlockQuantizer
from kvtool.methods.registry import register


@register("none")
class NoQuantizer(BlockQuantizer):
    """Stores the float block as is; `decode(encode(x))` returns ``x`` exactly (in the store dtype)."""

    def block_spec(self):
        return {"data": ((self.block_size, self.head_dim), self.dtype)}

    def encode_blocks(self, x: torch.Tensor, group: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"data": x[:, 0].to(self.dtype)}  # (N, S, D)

    def decode_blocks(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        return blocks["data"][:, None]  # (N, 1, S, D)
