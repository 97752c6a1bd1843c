"""Palu's low-rank latents in the decode kernel: keys and values reconstructed in registers.

Layout read (`kvtool.methods.lowrank.palu`, ``group_heads: 1``: one KV head per stream, so the
group basis is the head's): a body block of one side holds the latent of its BS tokens,

* ``latent`` (cap, BS, r) fp16 (``bits: 16``), or
* ``codes`` (cap, BS * bits / 8, r) uint8 bit-sliced, token-split codes with ``scale`` / ``zero``
  (cap, BS, ceil(r / q)) fp16 per token and group of q coordinates (the last group may be partial),
  optionally of the Walsh-Hadamard-transformed latent;

read by `body_block.load_body` with the latent's r coordinates in place of the D channels, then
reconstructed as ``x = latent @ recon[head] + recon_bias[head]`` with the quantizer's
`kernel_tensors`: ``recon`` (H_kv, r, D) float32 ``= H_r @ U_h^T`` (the block-diagonal Hadamard
matrix folded into the head's basis, identity without it) and ``recon_bias`` (H_kv, D) float32.

Why reconstruct in registers rather than fold U into the query (``q U``) and the output
(``(p @ latent) U^T``), Palu's own decode: Palu keys are stored before RoPE (``keys.pre_rope``),
and RoPE at each token's true position does not commute with U, so keys must be rebuilt before
they are rotated (`body_rope.rotate_keys`; the partner channels are the same latent times the
partner columns of ``recon``: one more small tl.dot, no second read of the block). Values could
fold U into the output, but then the body's output lives in the latent space while float blocks
(sinks, recent window) and the new token live in head space: a second accumulator per program
and a wider merge for a (BS, r) @ (r, D) product per block that a decode step (bounded by the
bytes it reads: r-wide latents instead of D-wide keys) can afford. Reconstruction keeps one
online softmax, one merge, and every other format's path unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtool.runtime.kernels.body_block import load_body
from kvtool.runtime.kernels.body_split import load_split


@triton.jit
def reconstruct(latent, w_ptr, b_ptr, head, c, cmask, RANK: tl.constexpr, BL: tl.constexpr, D: tl.constexpr):
    """latent (BS, BL) float32 (zero past RANK) -> (BS, BD) float32 head-space rows at channels c (BD,) of KV head ``head``."""
    l = tl.arange(0, BL)
    w_mask = (l < RANK)[:, None] & cmask[None, :]
    w = tl.load(w_ptr + head * RANK * D + l[:, None] * D + c[None, :], mask=w_mask, other=0.0)  # (BL, BD)
    x = tl.dot(latent, w, input_precision="ieee")  # (BS, BD), float32 products as torch's
    return x + tl.load(b_ptr + head * D + c, mask=cmask, other=0.0)[None, :]


@triton.jit
def load_side(data_ptr, codes_ptr, scale_ptr, zero_ptr, lut_ptr, oidx_ptr, oval_ptr, w_ptr, b_ptr, xcodes_ptr, xnorm_ptr,
              xmask_ptr, xtables_ptr, srow, scol, block, head, t, c, cmask, D: tl.constexpr, BS: tl.constexpr,
              BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, FP8_MANTISSA: tl.constexpr,
              FP8_BIAS: tl.constexpr, SCALES: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
              LEVELS: tl.constexpr, OUTLIERS: tl.constexpr, RANK: tl.constexpr, BL: tl.constexpr, SPLIT: tl.constexpr,
              O_BITS: tl.constexpr, O_W0: tl.constexpr, O_W1: tl.constexpr, O_W2: tl.constexpr, O_LEVELS: tl.constexpr,
              BDO: tl.constexpr, BDR: tl.constexpr, TT: tl.constexpr):
    """Rows t (TT,) of one body block of one side: (TT, BD) float32 at channels c (rotated sides in their rotated domain, as
    stored) and, for RANK > 0, the latent (TT, BL) they were reconstructed from (zeros otherwise).

    x*_ptr: the outlier split's outlier codes, outlier norms, channel masks and tables (`body_split.py`).
    """
    if SPLIT > 0:  # TurboQuant's outlier split: two instances rebuilt in head space
        latent = tl.zeros((TT, BL), tl.float32)
        x = load_split(codes_ptr, scale_ptr, lut_ptr, xcodes_ptr, xnorm_ptr, xmask_ptr, xtables_ptr, block, t, c, cmask,
                       D, BS, BITS, W0, W1, W2, LEVELS, SPLIT, O_BITS, O_W0, O_W1, O_W2, O_LEVELS, BDO, BDR)
    elif RANK > 0:  # low-rank latents: the block is (BS, RANK) wide
        lanes = tl.arange(0, BL)
        latent = load_body(data_ptr, codes_ptr, scale_ptr, zero_ptr, lut_ptr, oidx_ptr, oval_ptr, srow, scol, block, head,
                           t, lanes, lanes < RANK, RANK, BS, BITS, W0, W1, W2, FP8_MANTISSA, FP8_BIAS, SCALES, GROUP,
                           HAS_ZERO, LEVELS, OUTLIERS)
        x = reconstruct(latent, w_ptr, b_ptr, head, c, cmask, RANK, BL, D)
    else:
        latent = tl.zeros((TT, BL), tl.float32)
        x = load_body(data_ptr, codes_ptr, scale_ptr, zero_ptr, lut_ptr, oidx_ptr, oval_ptr, srow, scol, block, head,
                      t, c, cmask, D, BS, BITS, W0, W1, W2, FP8_MANTISSA, FP8_BIAS, SCALES, GROUP, HAS_ZERO, LEVELS, OUTLIERS)
    return x, latent
