"""Palu's low-rank latents in the decode kernel: keys and values reconstructed in registers.

Layout read (`kvtool.methods.lowrank.palu`, ``group_heads: 1``: one KV head per stream, so the
group basis is the head's): a body block of one side holds the latent of its BS tokens,

* ``latent`` (cap, BS, r) fp16 (``bits: 16``), or
* ``codes`` (cap, BS * bits / 8, r) uint8 bit-sliced, token-split codes with ``scale`` / ``zero``
  (cap, BS, ceil(r / q)) fp16 per token and group of q coordinates (the last group may be partial),
  optionally of the Walsh-Hadamard-transformed latent;

read by `body_block.load_body` with the latent's r coordinates in place of the D channels (in chunks of
coordinates, `reconstruct`), then reconstructed as ``x = latent @ recon[head] + recon_bias[head]`` with the quantizer's
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
def reconstruct(data_ptr, codes_ptr, scale_ptr, zero_ptr, lut_ptr, oidx_ptr, oval_ptr, w_ptr, b_ptr, srow, scol, block, head,
                t, c, cmask, partner, BS: tl.constexpr, BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                W2: tl.constexpr, FP8_MANTISSA: tl.constexpr, FP8_BIAS: tl.constexpr, SCALES: tl.constexpr,
                GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, LEVELS: tl.constexpr, OUTLIERS: tl.constexpr,
                RANK: tl.constexpr, BL: tl.constexpr, BLC: tl.constexpr, D: tl.constexpr, TT: tl.constexpr,
                PARTNER: tl.constexpr):
    """Rows t (TT,) of one block's latents reconstructed in head space: ``latent @ recon[head] + recon_bias[head]``
    at channels c (TT, BD) float32, and (PARTNER) the same at the rotation partner channels ``partner`` (the keys'
    RoPE partners: the same latent times the partner columns, no second pass over the block; zeros otherwise).

    The basis is the same for every block of a stream, so the compiler keeps it in shared memory across the block
    loop, as float32 product operands: BL x BD x 4 bytes per reconstruction (twice for pre-RoPE keys). Where that does
    not fit (`body_block.latent_chunk`: head_dim 256 at rank 96 needed 380 KB of shared memory in all, more than an
    H100's 227 KB, and failed to launch), the rank is walked in chunks of BLC coordinates whose basis rows are read
    again for every block (from L2: slower, but it runs): each chunk's latent columns are read from the block and
    multiplied by BLC rows of ``recon``."""
    BD: tl.constexpr = c.shape[0]
    x = tl.zeros((TT, BD), tl.float32)
    x_partner = tl.zeros((TT, BD), tl.float32)
    for chunk in tl.static_range(BL // BLC):
        lanes = chunk * BLC + tl.arange(0, BLC)
        lane_mask = lanes < RANK
        latent = load_body(data_ptr, codes_ptr, scale_ptr, zero_ptr, lut_ptr, oidx_ptr, oval_ptr, srow, scol, block, head,
                           t, lanes, lane_mask, RANK, BS, BITS, W0, W1, W2, FP8_MANTISSA, FP8_BIAS, SCALES, GROUP,
                           HAS_ZERO, LEVELS, OUTLIERS)  # (TT, BLC), zeros past RANK
        if BLC < BL:  # the basis read again per block (see above): an offset the compiler cannot prove is 0 (block
            # ids are < 2**31) keeps the loads in the loop, so the chunks share one buffer instead of all living at once
            rows = w_ptr + (head + (block >> 62)) * RANK * D + lanes[:, None] * D
        else:
            rows = w_ptr + head * RANK * D + lanes[:, None] * D
        w_mask = lane_mask[:, None] & cmask[None, :]
        x += tl.dot(latent, tl.load(rows + c[None, :], mask=w_mask, other=0.0), input_precision="ieee")  # float32 as torch
        if PARTNER:
            x_partner += tl.dot(latent, tl.load(rows + partner[None, :], mask=w_mask, other=0.0), input_precision="ieee")
    x = x + tl.load(b_ptr + head * D + c, mask=cmask, other=0.0)[None, :]
    if PARTNER:
        x_partner = x_partner + tl.load(b_ptr + head * D + partner, mask=cmask, other=0.0)[None, :]
    return x, x_partner


@triton.jit
def load_side(data_ptr, codes_ptr, scale_ptr, zero_ptr, lut_ptr, oidx_ptr, oval_ptr, w_ptr, b_ptr, xcodes_ptr, xnorm_ptr,
              xmask_ptr, xtables_ptr, srow, scol, block, head, t, c, cmask, partner, D: tl.constexpr, BS: tl.constexpr,
              BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, FP8_MANTISSA: tl.constexpr,
              FP8_BIAS: tl.constexpr, SCALES: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
              LEVELS: tl.constexpr, OUTLIERS: tl.constexpr, RANK: tl.constexpr, BL: tl.constexpr, BLC: tl.constexpr,
              SPLIT: tl.constexpr, O_BITS: tl.constexpr, O_W0: tl.constexpr, O_W1: tl.constexpr, O_W2: tl.constexpr,
              O_LEVELS: tl.constexpr, BDO: tl.constexpr, BDR: tl.constexpr, BDOC: tl.constexpr, BDRC: tl.constexpr,
              TT: tl.constexpr, PARTNER: tl.constexpr):
    """Rows t (TT,) of one body block of one side: (TT, BD) float32 at channels c (rotated sides in their rotated domain, as
    stored) and, for RANK > 0 with PARTNER, the same rows at channels ``partner`` (`reconstruct`; zeros otherwise:
    other formats read their partner channels with `body_block.load_body`).

    x*_ptr: the outlier split's outlier codes, outlier norms, channel masks and tables (`body_split.py`).
    """
    if SPLIT > 0:  # TurboQuant's outlier split: two instances rebuilt in head space
        x_partner = tl.zeros((TT, c.shape[0]), tl.float32)
        x = load_split(codes_ptr, scale_ptr, lut_ptr, xcodes_ptr, xnorm_ptr, xmask_ptr, xtables_ptr, block, t, c, cmask,
                       D, BS, BITS, W0, W1, W2, LEVELS, SPLIT, O_BITS, O_W0, O_W1, O_W2, O_LEVELS, BDO, BDR, BDOC, BDRC,
                       SCALES)
    elif RANK > 0:  # low-rank latents: the block is (BS, RANK) wide
        x, x_partner = reconstruct(data_ptr, codes_ptr, scale_ptr, zero_ptr, lut_ptr, oidx_ptr, oval_ptr, w_ptr, b_ptr, srow,
                                   scol, block, head, t, c, cmask, partner, BS, BITS, W0, W1, W2, FP8_MANTISSA, FP8_BIAS,
                                   SCALES, GROUP, HAS_ZERO, LEVELS, OUTLIERS, RANK, BL, BLC, D, TT, PARTNER)
    else:
        x_partner = tl.zeros((TT, c.shape[0]), tl.float32)
        x = load_body(data_ptr, codes_ptr, scale_ptr, zero_ptr, lut_ptr, oidx_ptr, oval_ptr, srow, scol, block, head,
                      t, c, cmask, D, BS, BITS, W0, W1, W2, FP8_MANTISSA, FP8_BIAS, SCALES, GROUP, HAS_ZERO, LEVELS, OUTLIERS)
    return x, x_partner
