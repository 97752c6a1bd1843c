"""Uniform asymmetric integer quantization (KIVI, Liu et al. 2024).

Keys are quantized per channel (``axis: channel``): each channel of a block of
S tokens gets its own scale and zero point, which keeps outlier channels from
spoiling the others. Values are quantized per token (``axis: token``): each
token gets a scale and zero point per group of ``group_size`` channels.

Storage per block of one (sequence, KV head) stream (leading block dim omitted):

* ``codes``: (S * bits / 8, D) uint8, bit-sliced and token-split (see `packing.py`);
* ``scale`` and ``zero``: float16, (D,) for ``channel`` or (S, D / group) for ``token``.

Dequantization: ``x = code * scale + zero``.

Attention never dequantizes (`chunk_scores`, `chunk_values`): zero points fold into the query,
``q . (s * c + z) = q . (s * c) + q . z``, and per-channel key scales fold into the query once per
block (``(q * s) . c``: one batched matmul over the chunk's blocks); per-token value scales
fold into the probabilities, ``sum_t p_t (s_t * c_t + z_t) = sum_t (p_t s_t) c_t + sum_t p_t z_t``;
the packed bytes are contracted raw, one matmul per bit slice over every block of the chunk, and
corrected on the small result (`packing.py`: `raw_slices`, `telescope`, `fold_weights`).
"""

from __future__ import annotations

import torch

from kvtool.methods.base import BlockQuantizer
from kvtool.methods.quant.packing import fold_weights, pack_codes, packed_rows, raw_slices, telescope, unpack_codes
from kvtool.methods.registry import register

_FP16_MAX = 65504.0


@register("uniform")
class UniformQuantizer(BlockQuantizer):
    """Asymmetric ``bits``-bit quantization with min/max scales per channel or per token group."""

    def __init__(self, spec, head_dim, block_size, dtype=torch.float16, fitted=None) -> None:
        super().__init__(spec, head_dim, block_size, dtype, fitted)
        self.group = self.token_group()
        self.levels = 2**spec.bits - 1

    def block_spec(self):
        s, d, bits = self.block_size, self.head_dim, self.spec.bits
        scales = (d,) if self.spec.axis == "channel" else (s, d // self.group)
        return {
            "codes": ((packed_rows(s, bits), d), torch.uint8),
            "scale": (scales, torch.float16),
            "zero": (scales, torch.float16),
        }

    def kernel_format(self):
        from kvtool.runtime.kernels.body_format import BodyFormat

        return BodyFormat(bits=self.spec.bits, per_channel=self.spec.axis == "channel", group=self.group)

    def kernel_encode_format(self):
        return self.kernel_format()  # the encode kernel's uniform rule: min / max, round half to even, fp16 parameters

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """View x (N, S, D) so that the reduction dim of a scale group is last."""
        if self.spec.axis == "channel":
            return x.transpose(-1, -2)  # (N, D, S): one group = one channel over S tokens
        n, s, d = x.shape
        return x.reshape(n, s, d // self.group, self.group)  # (N, S, D/g, g)

    def _ungrouped(self, g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return g.transpose(-1, -2) if self.spec.axis == "channel" else g.reshape(shape)

    def encode_blocks(self, x: torch.Tensor, group: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x[:, 0].float()  # (N, S, D)
        grouped = self._grouped(x)
        lo = grouped.amin(dim=-1).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
        hi = grouped.amax(dim=-1).clamp(-_FP16_MAX, _FP16_MAX)
        scale = ((hi - lo.float()) / self.levels).clamp(min=1e-6, max=_FP16_MAX).to(torch.float16)
        # Codes are computed against the fp16-rounded scale and zero the decoder will see.
        codes = torch.round((grouped - lo.float()[..., None]) / scale.float()[..., None]).clamp_(0, self.levels)
        codes = self._ungrouped(codes, x.shape)  # (N, S, D)
        return {"codes": pack_codes(codes, self.spec.bits), "scale": scale, "zero": lo}

    def decode_blocks(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        x = self._dequantize(blocks)  # (N, S, D) float32
        limit = torch.finfo(self.dtype).max  # fp16 scale rounding can push the top code just past the range
        return x.clamp(-limit, limit).to(self.dtype)[:, None]

    def _dequantize(self, blocks: dict[str, torch.Tensor]) -> torch.Tensor:
        """{name: (..., ...)} -> (..., S, D) float32 ``code * scale + zero``, unrounded."""
        codes = unpack_codes(blocks["codes"], self.spec.bits, self.block_size).float()  # (..., S, D)
        scale, zero = blocks["scale"].float(), blocks["zero"].float()
        if self.spec.axis == "channel":  # (..., D): one per channel of a block
            return codes * scale[..., None, :] + zero[..., None, :]
        grouped = codes.reshape(*codes.shape[:-1], -1, self.group)  # (..., S, D / group, group)
        return (grouped * scale[..., None] + zero[..., None]).reshape(codes.shape)

    # --- attention algebra ---------------------------------------------------------------------
    def chunk_scores(self, query, blocks, group, keys_to_attention=None):
        if keys_to_attention is not None or self.spec.axis != "channel":
            return super().chunk_scores(query, blocks, group, keys_to_attention)
        if query.shape[2] > self.block_size:  # many rows (prefill): scaling the keys once costs less than the query per block
            return torch.matmul(query, self._dequantized(blocks).transpose(-1, -2))  # (Sc, 1, R, T)
        q = query[:, 0]  # (Sc, R, D)
        sc, nb = blocks["codes"].shape[:2]
        r, s = q.shape[1], self.block_size
        # the per-channel scales fold into the query, once per block: one batched matmul over every block of the chunk
        # (it parallelizes over blocks; scaling the raw bytes instead writes and reads a float32 copy of every key)
        q_blocks = q[:, None] * blocks["scale"].float()[:, :, None, :]  # (Sc, nb, R, D)
        scores = None
        for width, low, raw in raw_slices(blocks["codes"], self.spec.bits, s):  # raw (Sc, nb, S, D) uint8
            part = telescope(torch.matmul(q_blocks, raw.float().transpose(-1, -2)), width, s)  # (Sc, nb, R, S) vs codes
            part = part if low == 0 else part * float(1 << low)
            scores = part if scores is None else scores + part
        zeros = torch.matmul(q, blocks["zero"].float().transpose(-1, -2))  # (Sc, R, nb): q . z per block
        return (scores.transpose(1, 2) + zeros[..., None]).reshape(sc, 1, r, nb * s)  # (Sc, 1, R, nb*S)

    def chunk_values(self, probs, blocks, group):
        if probs.shape[2] > self.head_dim:  # many rows (prefill): scaling the values once costs less than every row's weights
            return torch.matmul(probs, self._dequantized(blocks))  # (Sc, 1, R, D)
        p = probs[:, 0]  # (Sc, R, T)
        sc, nb = blocks["codes"].shape[:2]
        s, d = self.block_size, self.head_dim
        scale, zero = blocks["scale"].float(), blocks["zero"].float()
        if self.spec.axis == "channel":
            return self._channel_values(p, blocks["codes"], scale, zero)[:, None]
        groups, r, t = d // self.group, p.shape[1], nb * s
        scale_t = scale.reshape(sc, t, groups).transpose(1, 2).contiguous()  # (Sc, G, T): small, read contiguously below
        weights = p[:, None] * scale_t[:, :, None]  # (Sc, G, R, T): p_t * s_t for each channel group
        out = None
        for width, low, raw in raw_slices(blocks["codes"], self.spec.bits, s):  # raw (Sc, nb, S, D) uint8
            codes = raw.reshape(sc, t, groups, self.group).transpose(1, 2)  # (Sc, G, T, g) view
            codes = codes.to(torch.float32, memory_format=torch.contiguous_format)  # one pass into float32
            part = torch.matmul(fold_weights(weights, width, s), codes)  # (Sc, G, R, g): each group its own weights
            part = part if low == 0 else part * float(1 << low)
            out = part if out is None else out + part
        out = out.transpose(1, 2).reshape(sc, r, d)  # (Sc, R, D)
        zeros = torch.matmul(p, zero.reshape(sc, t, groups))  # (Sc, R, G): sum_t p_t z_t per group
        return (out.reshape(sc, r, groups, self.group) + zeros[..., None]).reshape(sc, r, d)[:, None]

    def chunk_floats(self, blocks, group):
        return self._dequantized(blocks)  # unrounded, as chunk_scores / chunk_values read them: (Sc, 1, nb*S, D)

    def _dequantized(self, blocks: dict[str, torch.Tensor]) -> torch.Tensor:
        """{name: (Sc, nb, ...)} -> (Sc, 1, nb * S, D) float32 ``code * scale + zero``, unrounded (a bounded temporary:
        the chunk's blocks only). For forwards with many query rows, where the folded algebra would scale every row."""
        x = self._dequantize(blocks)  # (Sc, nb, S, D)
        sc, nb, s, d = x.shape
        return x.reshape(sc, 1, nb * s, d)

    def _channel_values(self, p, codes, scale, zero):
        """Values with per-channel scales (per block): block partial sums, then scaled."""
        sc, nb = codes.shape[:2]
        s = self.block_size
        pb = p.reshape(sc, p.shape[1], nb, s).transpose(1, 2)  # (Sc, nb, R, S)
        acc = None
        for width, low, raw in raw_slices(codes, self.spec.bits, s):
            part = torch.matmul(fold_weights(pb, width, s), raw.float()) * float(1 << low)  # (Sc, nb, R, D)
            acc = part if acc is None else acc + part
        out = (acc * scale[:, :, None, :]).sum(dim=1)  # (Sc, R, D)
        return out + torch.matmul(pb.sum(dim=-1).transpose(1, 2), zero)  # + sum_blocks (sum_t p_t) z_blk
