"""TurboQuant's outlier split in the decode kernel: two instances per block, rebuilt in registers.

Layout read (`kvtool.methods.quant.turboquant` with ``extra_bits`` 0.5 or 0.25): a body block of
one side holds its own outlier set and, per instance (the outlier one with the ``outlier_``
prefix; d_o = ``split`` channels at ``split_bits``, the rest d_r = D - d_o at ``bits``),

* ``outlier_mask`` (cap, D / 8) uint8: bit c % 8 of byte c // 8 set when channel c is an outlier;
* ``[outlier_]codes`` (cap, BS * b / 8, d) uint8 bit-sliced, token-split codebook indices of the
  rotated unit vector ``y = P_i x_i / ||x_i||`` (x_i: the instance's channels, ascending);
* ``[outlier_]norm`` (cap, BS) fp16, ``||x_i||`` per token (or 8-bit codes, (cap, BS + 4) uint8 with
  ``norm_bits: 8``, `body_block.token_norms`);

and the side's `kernel_tensors`: ``codebook`` (2**bits,) of the rest and ``split_tables``
float32, the outlier codebook (2**split_bits,), then P_o (d_o, d_o), then P_r (d_r, d_r) row-major
(with QJL, then G_o P_o and G_r P_r, `body_qjl.py`).

A token is ``x[c] = ||x_i|| (y_i @ P_i)[rank_i(c)]`` for the instance i that holds channel c,
rank_i(c) = the channels of that instance below c. `load_split` reads both instances with
`body_block.load_body` (codebook lookup times the norm), builds each instance's placement
``G_i[j, c] = P_i[j, rank_i(c)]`` (zero where channel c is the other instance's) from the block's
mask with a prefix count, and returns ``y_o @ G_o + y_r @ G_r`` (tl.dot, in chunks of coordinates where a
placement is large), keys and values
alike, in head space. With ``qjl: true`` (keys) each instance's QJL residual term is added to the
scores by `body_qjl.py`, from the same mask ranks and placements of the sketch matrices.

Why rebuild rather than keep attention in the rotated domains (the plain recipe's read,
`body_rotated.py`): every block has its own outlier set, hence its own domain, so the query
would have to be permuted and rotated per block and each block's value sum rotated back and
scattered per block: the same two (d, D) products per block, only with R query rows in place
of BS tokens, and a second score path. The rebuild costs O(BS D^2) per block in registers (no
extra memory traffic: P_o, P_r and the mask stay in cache) and leaves one online softmax.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtool.runtime.kernels.body_block import load_body


@triton.jit
def _instance_rows(codes_ptr, norm_ptr, lut_ptr, block, t, lanes, DIM: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr,
                   W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, LEVELS: tl.constexpr, SCALES: tl.constexpr):
    """One instance's rows (TT, lanes) float32 in its rotated domain at coordinates ``lanes``: ``norm * codebook[code]``
    (zero past DIM)."""
    return load_body(codes_ptr, codes_ptr, norm_ptr, norm_ptr, lut_ptr, codes_ptr, codes_ptr, 0, 0, block, 0, t, lanes,
                     lanes < DIM, DIM, BS, BITS, W0, W1, W2, 0, 0, SCALES, 1, False, LEVELS, 0)


@triton.jit
def _instance_in_head_space(codes_ptr, norm_ptr, lut_ptr, rot_ptr, rank, held, block, t, DIM: tl.constexpr,
                            BDI: tl.constexpr, BDC: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, W0: tl.constexpr,
                            W1: tl.constexpr, W2: tl.constexpr, LEVELS: tl.constexpr, SCALES: tl.constexpr):
    """``y_i @ G_i`` (TT, BD) float32 of one instance, in chunks of BDC rotated coordinates: a chunk's rows of y and of
    the placement G (BDC x BD float32, the product's operand in shared memory) at a time, not BDI x BD (head_dim 256:
    the rest instance's whole placement was 256 KB, two of them 680 KB with the other operands, and the kernel
    could not launch on an H100)."""
    x = tl.zeros((t.shape[0], rank.shape[0]), tl.float32)
    for chunk in tl.static_range(BDI // BDC):
        lanes = chunk * BDC + tl.arange(0, BDC)
        y = _instance_rows(codes_ptr, norm_ptr, lut_ptr, block, t, lanes, DIM, BS, BITS, W0, W1, W2, LEVELS, SCALES)
        g = tl.load(rot_ptr + lanes[:, None] * DIM + rank[None, :], mask=(lanes < DIM)[:, None] & held[None, :], other=0.0)
        x += tl.dot(y, g, input_precision="ieee")
    return x


@triton.jit
def placement(rot_ptr, rank, held, DIM: tl.constexpr, BDI: tl.constexpr):
    """G (BDI, BD) float32: G[j, c] = P[j, rank[c]] where the instance holds channel c (held (BD,)), else 0."""
    j = tl.arange(0, BDI)
    return tl.load(rot_ptr + j[:, None] * DIM + rank[None, :], mask=(j < DIM)[:, None] & held[None, :], other=0.0)


@triton.jit
def channel_ranks(mask_ptr, block, c, cmask, D: tl.constexpr):
    """A block's outlier mask at channels c (BD,): (outlier (BD,) bool, rank_o, rank_r (BD,) int32), the outlier and
    the rest's channels below c."""
    byte = tl.load(mask_ptr + block * (D // 8) + c // 8, mask=cmask, other=0).to(tl.int32)
    outlier = (((byte >> (c % 8)) & 1) != 0) & cmask  # (BD,)
    count = outlier.to(tl.int32)
    rank_o = tl.cumsum(count, axis=0) - count  # outlier channels below c
    return outlier, rank_o, c - rank_o


@triton.jit
def load_split(codes_ptr, norm_ptr, lut_ptr, ocodes_ptr, onorm_ptr, mask_ptr, tables_ptr, block, t, c, cmask,
               D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
               LEVELS: tl.constexpr, SPLIT: tl.constexpr, O_BITS: tl.constexpr, O_W0: tl.constexpr, O_W1: tl.constexpr,
               O_W2: tl.constexpr, O_LEVELS: tl.constexpr, BDO: tl.constexpr, BDR: tl.constexpr, BDOC: tl.constexpr,
               BDRC: tl.constexpr, SCALES: tl.constexpr):
    """One split block as float32 (TT, BD) in head space, at channels c (BD,) = 0 .. BD - 1 (each instance in chunks of
    BDOC / BDRC coordinates, `body_block.split_chunk`)."""
    outlier, rank_o, rank_r = channel_ranks(mask_ptr, block, c, cmask, D)
    x = _instance_in_head_space(ocodes_ptr, onorm_ptr, tables_ptr, tables_ptr + O_LEVELS, rank_o, outlier, block, t, SPLIT,
                                BDO, BDOC, BS, O_BITS, O_W0, O_W1, O_W2, O_LEVELS, SCALES)
    return x + _instance_in_head_space(codes_ptr, norm_ptr, lut_ptr, tables_ptr + O_LEVELS + SPLIT * SPLIT, rank_r,
                                       cmask & ~outlier, block, t, D - SPLIT, BDR, BDRC, BS, BITS, W0, W1, W2, LEVELS,
                                       SCALES)
