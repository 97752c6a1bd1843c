"""TurboQuant's outlier split in the decode kernel: two instances per block, rebuilt in registers.

Layout read (`kvtool.methods.quant.turboquant` with ``extra_bits: 0.5``): a body block of
one side holds its own outlier set and, per instance (the outlier one with the ``outlier_``
prefix; d_o = ``split`` channels at ``split_bits``, the rest d_r = D - d_o at ``bits``),

* ``outlier_mask`` (cap, D / 8) uint8: bit c % 8 of byte c // 8 set when channel c is an outlier;
* ``[outlier_]codes`` (cap, BS * b / 8, d) uint8 bit-sliced, token-split codebook indices of the
  rotated unit vector ``y = P_i x_i / ||x_i||`` (x_i: the instance's channels, ascending);
* ``[outlier_]norm`` (cap, BS) fp16, ``||x_i||`` per token;

and the side's `kernel_tensors`: ``codebook`` (2**bits,) of the rest and ``split_tables``
float32, the outlier codebook (2**split_bits,), then P_o (d_o, d_o), then P_r (d_r, d_r) row-major
(with QJL, then G_o P_o and G_r P_r, `body_qjl.py`).

A token is ``x[c] = ||x_i|| (y_i @ P_i)[rank_i(c)]`` for the instance i that holds channel c,
rank_i(c) = the channels of that instance below c. `load_split` reads both instances with
`body_block.load_body` (codebook lookup times the norm), builds each instance's placement
``G_i[j, c] = P_i[j, rank_i(c)]`` (zero where channel c is the other instance's) from the block's
mask with a prefix count, and returns ``y_o @ G_o + y_r @ G_r`` (two tl.dot), keys and values
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
def _instance_rows(codes_ptr, norm_ptr, lut_ptr, block, t, DIM: tl.constexpr, BDI: tl.constexpr, BS: tl.constexpr,
                   BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, LEVELS: tl.constexpr):
    """One instance's rows (BS, BDI) float32 in its rotated domain: ``norm * codebook[code]`` (zero past DIM)."""
    lanes = tl.arange(0, BDI)
    return load_body(codes_ptr, codes_ptr, norm_ptr, norm_ptr, lut_ptr, codes_ptr, codes_ptr, 0, 0, block, 0, t, lanes,
                     lanes < DIM, DIM, BS, BITS, W0, W1, W2, 0, 0, 5, 1, False, LEVELS, 0)


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
               O_W2: tl.constexpr, O_LEVELS: tl.constexpr, BDO: tl.constexpr, BDR: tl.constexpr):
    """One split block as float32 (BS, BD) in head space, at channels c (BD,) = 0 .. BD - 1."""
    outlier, rank_o, rank_r = channel_ranks(mask_ptr, block, c, cmask, D)
    y_o = _instance_rows(ocodes_ptr, onorm_ptr, tables_ptr, block, t, SPLIT, BDO, BS, O_BITS, O_W0, O_W1, O_W2, O_LEVELS)
    y_r = _instance_rows(codes_ptr, norm_ptr, lut_ptr, block, t, D - SPLIT, BDR, BS, BITS, W0, W1, W2, LEVELS)
    g_o = placement(tables_ptr + O_LEVELS, rank_o, outlier, SPLIT, BDO)  # (BDO, BD)
    g_r = placement(tables_ptr + O_LEVELS + SPLIT * SPLIT, rank_r, cmask & ~outlier, D - SPLIT, BDR)  # (BDR, BD)
    return tl.dot(y_o, g_o, input_precision="ieee") + tl.dot(y_r, g_r, input_precision="ieee")
