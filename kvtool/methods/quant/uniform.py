"""Uniform asymmetric integer quantization (KIVI, Liu et al. 2024).

Keys are quantized per channel (``axis: channel``): each channel of a block of
S tokens gets its own scale and zero point, which keeps outlier channels from
spoiling the others. Values are quantized per token (``axis: token``): each
token gets a scale and zero point per group of ``group_size`` channels.

Storage per block of one (sequence, KV head) stream:

* ``codes``: (S * D * bits / 32) int32 words, codes in token-major order
  (token s, channel d at index s * D + d), bit-plane packed (see `packing.py`);
* ``scale`` and ``zero``: float16, (D,) for ``channel`` or (S, D / group) for ``token``.

Dequantization: ``x = code * scale + zero``.
"""

from __future__ import annotations

import torch

from kvtool.methods.base import BlockQuantizer
from kvtool.methods.quant.packing import pack_codes, packed_words, unpack_codes
from kvtool.methods.registry import register

_FP16_MAX = 65504.0


@register("uniform")
class UniformQuantizer(BlockQuantizer):
    """Asymmetric ``bits``-bit quantization with min/max scales per channel or per token group."""

    def __init__(self, spec, head_dim, block_size, dtype=torch.float16, fitted=None) -> None:
        super().__init__(spec, head_dim, block_size, dtype, fitted)
        self.group = self.token_group()
        self.levels = 2**spec.bits - 1

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """View x (B, H, N, S, D) so that the reduction dim of a scale group is last."""
        if self.spec.axis == "channel":
            return x.transpose(-1, -2)  # (B, H, N, D, S): one group = one channel over S tokens
        b, h, n, s, d = x.shape
        return x.reshape(b, h, n, s, d // self.group, self.group)  # (B, H, N, S, D/g, g)

    def _ungrouped(self, g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.spec.axis == "channel":
            return g.transpose(-1, -2)
        return g.reshape(shape)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        grouped = self._grouped(x.float())
        lo = grouped.amin(dim=-1).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
        hi = grouped.amax(dim=-1).clamp(-_FP16_MAX, _FP16_MAX)
        scale = ((hi - lo.float()) / self.levels).clamp(min=1e-6, max=_FP16_MAX).to(torch.float16)
        # Codes are computed against the fp16-rounded scale and zero the decoder will see.
        codes = torch.round((grouped - lo.float()[..., None]) / scale.float()[..., None]).clamp_(0, self.levels)
        codes = self._ungrouped(codes, x.shape)  # (B, H, N, S, D)
        flat = codes.reshape(*x.shape[:3], -1)  # (B, H, N, S*D) token-major
        return {"codes": pack_codes(flat, self.spec.bits), "scale": scale, "zero": lo}

    def decode(self, storage: dict[str, torch.Tensor]) -> torch.Tensor:
        codes = unpack_codes(storage["codes"], self.spec.bits)  # (B, H, N, S*D)
        b, h, n = codes.shape[:3]
        shape = torch.Size((b, h, n, self.block_size, self.head_dim))
        grouped = self._grouped(codes.reshape(shape).float())
        x = grouped * storage["scale"].float()[..., None] + storage["zero"].float()[..., None]
        limit = torch.finfo(self.dtype).max  # fp16 scale rounding can push the top code just past the range
        return self._ungrouped(x, shape).clamp(-limit, limit).to(self.dtype)

    def block_nbytes(self) -> int:
        s, d = self.block_size, self.head_dim
        words = packed_words(s * d, self.spec.bits)
        groups = d if self.spec.axis == "channel" else s * (d // self.group)
        return words * 4 + 2 * groups * 2  # codes + fp16 scale + fp16 zero
