"""FP8 KV storage (e4m3 / e5m2), the format serving engines use (``vllm serve --kv-cache-dtype fp8``).

Every element is stored as ``fp8(x / scale)`` (torch.float8_e4m3fn or float8_e5m2, values
beyond the format's max saturate to +-max) and read back as ``fp8 * scale``:

* ``granularity: block`` (dynamic): one float32 scale per stored block of one (sequence, KV
  head) stream, ``amax(block) / fp8_max``; needs no calibration;
* ``granularity: layer`` / ``head`` (static): one calibrated scale per layer or per KV head,
  ``amax / fp8_max`` over the calibration data (``scale_fit: amax``) or the clipped amax
  with the least squared error (``scale_fit: mse``). This is vLLM's ``k_scale`` / ``v_scale``
  (`kvtool export --format vllm`).

Storage per block of one stream (leading block dim omitted):

* ``codes``: (S, D) uint8, the fp8 bit patterns (viewed as the float8 dtype to decode);
* ``scale``: (1,) float32, ``block`` granularity only.

Fitted tensors per layer (static): ``scale`` (1, 1) or (H_kv, 1) float32.

Attention: the scale is one number per block or head, so ``q . (s c) = s (q . c)`` and
``sum_t p_t s c_t = s sum_t p_t c_t`` (static); the per-block scale of ``block`` multiplies
the block's scores / probabilities.
"""

from __future__ import annotations

import torch

from kvtool.methods.base import BlockQuantizer
from kvtool.methods.quant.static_scales import check_heads, mse_clip, per_block, reduce_range, require_fitted
from kvtool.methods.registry import register

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MIN_SCALE = 1e-12


def fp8_max(fmt: str) -> float:
    return float(torch.finfo(FP8_DTYPES[fmt]).max)


def to_fp8(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """float -> fp8 (saturating: torch's cast turns out-of-range values into NaN / inf)."""
    limit = fp8_max(fmt)
    return x.float().clamp(-limit, limit).to(FP8_DTYPES[fmt])


@register("fp8")
class Fp8Quantizer(BlockQuantizer):
    """fp8 codes with a dynamic per-block or a calibrated per-layer / per-KV-head scale."""

    fit_source = "ranges"  # static scales come from `calibration.RangeStats` (every token, after RoPE)

    def __init__(self, spec, head_dim, block_size, dtype=torch.float16, fitted=None) -> None:
        super().__init__(spec, head_dim, block_size, dtype, fitted)
        self.fp8_dtype = FP8_DTYPES[spec.fp8_format]
        self.fp8_max = fp8_max(spec.fp8_format)
        self.static = spec.granularity != "block"
        if self.static:
            require_fitted(self.fitted, ("scale",), "fp8", spec.path, head_dim)
            self.scale = self.fitted["scale"].detach().float().cpu()

    @classmethod
    def requires_fit(cls, spec) -> bool:
        return spec.granularity != "block"  # dynamic per-block scales need no calibration

    def check_kv_heads(self, num_kv_heads: int) -> None:
        if self.static:
            check_heads(self.scale, num_kv_heads, "fp8", self.spec.path)

    def kernel_format(self):
        from kvtool.runtime.kernels.body_format import BodyFormat

        scales = "static" if self.static else "block"
        return BodyFormat(bits=8, per_channel=False, group=1, fp8=self.spec.fp8_format, scales=scales, zero=False)

    def kernel_encode_format(self):
        return self.kernel_format()  # the encode kernel's fp8 rule: amax or calibrated scale, saturating, nearest even

    def kernel_constants(self) -> dict[str, torch.Tensor]:
        return {"static_scale": self.scale} if self.static else {}  # (1 or H_kv, 1)

    def block_spec(self):
        spec = {"codes": ((self.block_size, self.head_dim), torch.uint8)}
        if not self.static:
            spec["scale"] = ((1,), torch.float32)
        return spec

    def _scales(self, blocks_or_x, group: torch.Tensor, device) -> torch.Tensor:
        """(N, 1, 1) float32 scale of every block."""
        if self.static:
            return per_block(self.scale, group, device)
        return blocks_or_x["scale"].float()[:, :, None]

    def encode_blocks(self, x: torch.Tensor, group: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x[:, 0].float()  # (N, S, D)
        out = {}
        if self.static:
            scale = per_block(self.scale, group, x.device)  # (N, 1, 1)
        else:
            scale = (x.abs().amax(dim=(1, 2)) / self.fp8_max).clamp(min=_MIN_SCALE)[:, None]  # (N, 1)
            out["scale"] = scale
            scale = scale[:, :, None]
        out["codes"] = to_fp8(x / scale, self.spec.fp8_format).view(torch.uint8)
        return out

    def decode_blocks(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        codes = blocks["codes"].view(self.fp8_dtype).float()  # (N, S, D)
        x = codes * self._scales(blocks, group, codes.device)
        limit = torch.finfo(self.dtype).max
        return x.clamp(-limit, limit).to(self.dtype)[:, None]

    # --- attention algebra: the scale leaves the contraction ----------------------------------
    def _chunk_codes(self, blocks, group):
        """fp8 codes as float (Sc, 1, nb*S, D) and the scale per token (Sc, 1, 1, nb*S)."""
        codes = blocks["codes"]  # (Sc, nb, S, D)
        sc, nb, s, d = codes.shape
        values = codes.view(self.fp8_dtype).float().reshape(sc, 1, nb * s, d)
        if self.static:
            scale = per_block(self.scale, group, codes.device).reshape(sc, 1, 1, 1).expand(sc, 1, 1, nb * s)
        else:
            scale = blocks["scale"].float().reshape(sc, 1, 1, nb).repeat_interleave(s, dim=-1)
        return values, scale

    def chunk_scores(self, query, blocks, group, keys_to_attention=None):
        if keys_to_attention is not None:
            return super().chunk_scores(query, blocks, group, keys_to_attention)
        codes, scale = self._chunk_codes(blocks, group)
        return torch.matmul(query, codes.transpose(-1, -2)) * scale  # (Sc, 1, R, T)

    def chunk_values(self, probs, blocks, group):
        codes, scale = self._chunk_codes(blocks, group)
        return torch.matmul(probs * scale, codes)  # (Sc, 1, R, D)

    # --- calibration ----------------------------------------------------------------------------
    @classmethod
    def fit_ranges(cls, spec, head_dim, block_size, lo, hi, samples) -> dict[str, torch.Tensor]:
        """Per (H, D) calibration min/max and a sample (N, H, D) -> ``scale`` (1 or H_kv, 1) float32."""
        limit = fp8_max(spec.fp8_format)
        lo, hi = reduce_range(lo.float(), hi.float(), spec.granularity)
        amax = torch.maximum(lo.abs(), hi.abs())
        if spec.scale_fit == "mse":

            def roundtrip(x, c_lo, c_hi):
                scale = (c_hi / limit).clamp(min=_MIN_SCALE)
                return to_fp8(x / scale, spec.fp8_format).float() * scale

            _, amax = mse_clip(-amax, amax, samples.float(), spec.granularity, roundtrip)
        return {"scale": (amax / limit).clamp(min=_MIN_SCALE).contiguous()}
