"""Static integer quantization: INT8 / INT4 (or 2 / 3 bits) with calibrated ranges.

The simple baseline beside KIVI's dynamic min/max: the range of every scale group is fixed
offline by `kvtool calibrate` (`static_scales.py`), so a block stores its codes and nothing
else (exactly ``bits`` bits per element). Asymmetric: with the calibrated ``lo`` / ``hi``,

    code = clamp(round((x - lo) / scale), 0, 2**bits - 1),   scale = (hi - lo) / (2**bits - 1),
    x ~= code * scale + lo;

values outside the calibrated range saturate. ``granularity``: ``layer`` (one range per
layer, "per tensor"), ``head`` (per KV head) or ``channel`` (per KV head and channel).
Per-channel key ranges want ``keys.pre_rope`` (the bundled ``int*-static-channel`` recipes set
it): after RoPE a slow rotary pair only reaches the angles of the positions calibration saw, so
later positions leave the range and saturate; before RoPE the range does not depend on the position.

Storage per block of one (sequence, KV head) stream: ``codes`` (S * bits / 8, D) uint8,
bit-sliced and token-split (`packing.py`).

Fitted tensors per layer: ``lo``, ``hi`` float32 of shape (1, 1), (H_kv, 1) or (H_kv, D).

Attention: per-channel (or coarser) constants fold into the query and the output,
``q . (s * c + lo) = (q * s) . c + q . lo`` and ``sum_t p_t (s c_t + lo) = s sum_t p_t c_t + lo sum_t p_t``.
"""

from __future__ import annotations

import torch

from kvtool.methods.base import BlockQuantizer
from kvtool.methods.quant.packing import pack_codes, packed_rows, unpack_codes
from kvtool.methods.quant.static_scales import check_heads, mse_clip, per_block, reduce_range, require_fitted
from kvtool.methods.registry import register

_MIN_SCALE = 1e-8


def quantize(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int) -> torch.Tensor:
    """Codes in [0, levels] of x against broadcastable ranges (float32 in, float32 codes out)."""
    scale = ((hi - lo) / levels).clamp(min=_MIN_SCALE)
    return torch.round((x - lo) / scale).clamp_(0, levels)


@register("int_static")
class IntStaticQuantizer(BlockQuantizer):
    """``bits``-bit asymmetric integer codes against ranges calibrated per layer, KV head or channel."""

    needs_fit = True
    fit_source = "ranges"

    def __init__(self, spec, head_dim, block_size, dtype=torch.float16, fitted=None) -> None:
        super().__init__(spec, head_dim, block_size, dtype, fitted)
        require_fitted(self.fitted, ("lo", "hi"), "int_static", spec.path, head_dim)
        self.levels = 2**spec.bits - 1
        self.lo = self.fitted["lo"].detach().float().cpu()
        self.hi = self.fitted["hi"].detach().float().cpu()
        self.step = ((self.hi - self.lo) / self.levels).clamp(min=_MIN_SCALE)

    def check_kv_heads(self, num_kv_heads: int) -> None:
        check_heads(self.lo, num_kv_heads, "int_static", self.spec.path)

    def kernel_format(self):
        from kvtool.runtime.kernels.body_format import BodyFormat

        return BodyFormat(bits=self.spec.bits, per_channel=False, group=1, scales="static")

    def kernel_constants(self) -> dict[str, torch.Tensor]:
        return {"static_scale": self.step, "static_zero": self.lo}  # (1 or H_kv, 1 or D) each

    def block_spec(self):
        return {"codes": ((packed_rows(self.block_size, self.spec.bits), self.head_dim), torch.uint8)}

    def encode_blocks(self, x: torch.Tensor, group: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x[:, 0].float()  # (N, S, D)
        lo, step = per_block(self.lo, group, x.device), per_block(self.step, group, x.device)  # (N, 1, 1 or D)
        codes = torch.round((x - lo) / step).clamp_(0, self.levels)
        return {"codes": pack_codes(codes, self.spec.bits)}

    def decode_blocks(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        codes = unpack_codes(blocks["codes"], self.spec.bits, self.block_size).float()  # (N, S, D)
        x = codes * per_block(self.step, group, codes.device) + per_block(self.lo, group, codes.device)
        limit = torch.finfo(self.dtype).max
        return x.clamp(-limit, limit).to(self.dtype)[:, None]

    # --- attention algebra: per-channel constants fold into the query / the output -------------
    def _chunk_codes(self, blocks, group):
        codes = blocks["codes"]  # (Sc, nb, S*bits/8, D)
        sc, nb = codes.shape[:2]
        values = unpack_codes(codes, self.spec.bits, self.block_size).float()  # (Sc, nb, S, D)
        step = per_block(self.step, group, codes.device).expand(sc, 1, self.head_dim)  # (Sc, 1, D)
        lo = per_block(self.lo, group, codes.device).expand(sc, 1, self.head_dim)
        return values.reshape(sc, 1, nb * self.block_size, self.head_dim), step[:, None], lo[:, None]

    def chunk_scores(self, query, blocks, group, keys_to_attention=None):
        if keys_to_attention is not None:
            return super().chunk_scores(query, blocks, group, keys_to_attention)
        codes, step, lo = self._chunk_codes(blocks, group)  # (Sc, 1, T, D), (Sc, 1, 1, D) x2
        return torch.matmul(query * step, codes.transpose(-1, -2)) + (query * lo).sum(dim=-1, keepdim=True)

    def chunk_values(self, probs, blocks, group):
        codes, step, lo = self._chunk_codes(blocks, group)
        return torch.matmul(probs, codes) * step + probs.sum(dim=-1, keepdim=True) * lo  # (Sc, 1, R, D)

    # --- calibration ----------------------------------------------------------------------------
    @classmethod
    def fit_ranges(cls, spec, head_dim, block_size, lo, hi, samples) -> dict[str, torch.Tensor]:
        """Per (H, D) calibration min/max and a sample (N, H, D) -> ``lo``, ``hi`` at the granularity."""
        levels = 2**spec.bits - 1
        lo, hi = reduce_range(lo.float(), hi.float(), spec.granularity)
        if spec.scale_fit == "mse":

            def roundtrip(x, c_lo, c_hi):
                step = ((c_hi - c_lo) / levels).clamp(min=_MIN_SCALE)
                return quantize(x, c_lo, c_hi, levels) * step + c_lo

            lo, hi = mse_clip(lo, hi, samples.float(), spec.granularity, roundtrip)
        return {"lo": lo.contiguous(), "hi": hi.contiguous()}
