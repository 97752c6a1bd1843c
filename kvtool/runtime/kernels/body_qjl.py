"""TurboQuant's QJL residual in the decode kernel: one more term per body key's score, read in place.

Layout read (`kvtool.methods.quant.turboquant` keys with ``qjl: true``; values never carry it):
besides its codes and norms (`body_rotated.py`, `body_split.py`), each instance i of a block
(the outlier one with the ``outlier_`` prefix under the split) holds, for its BS tokens,

* ``[outlier_]qjl_signs`` (cap, BS / 8, d) uint8: ``sign(G_i r)`` as 1-bit codes in the
  bit-sliced, token-split layout of `kvtool.methods.quant.packing` (bit set: +1, clear: -1),
  r = y - y_hat the residual of the rotated unit vector, G_i (d, d) the instance's Gaussian sketch;
* ``[outlier_]residual_norm`` (cap, BS) fp16, ``||r||`` per token.

The torch path's estimator (`TurboQuantizer.chunk_scores`): a token scores

    q . x ~ sum_i ||x_i|| * ((P_i q_i) . y_hat_i + gamma_i * (G_i P_i q_i) . sign_i),
    gamma_i = sqrt(pi / 2) / d_i * ||r_i||,

so the kernel never applies G to a key: the query is *sketched* instead, ``G_i P_i q_i``, and
each body key's score gains ``||x_i|| gamma_i`` times the dot of that sketch with the key's
+-1 signs (`qjl_logits`: one (R, d) @ (d, TT) tl.dot per token tile, beside the codebook score).

* One instance (``rotated``): the rotated query ``P q`` is sketched once per step in torch
  (`sketched_query`: one (S R, D) @ (D, D) product, O(D^2) per stream, not per token), with the
  side's ``qjl_sketch`` G (D, D) float32 from `kernel_tensors`.
* The outlier split: each block has its own outlier set, hence its own q_i (the query's channels
  of instance i, in the block's order), so the kernel sketches the head-space query per block
  (`split_sketched_queries`): ``G_i P_i q_i = q @ S_i^T`` with ``S_i[j, c] = (G_i P_i)[j, rank_i(c)]``
  where instance i holds channel c (0 elsewhere), built from the block's mask as `body_split.py`
  builds its placements, from G_o P_o (d_o, d_o) and G_r P_r (d_r, d_r) appended row-major to the
  side's ``split_tables``. Two (R, D) @ (D, d) products per block: less than the block's rebuild.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvtool.runtime.kernels.body_block import _packed_codes, token_norms
from kvtool.runtime.kernels.body_split import channel_ranks, placement

SQRT_HALF_PI = tl.constexpr(math.sqrt(math.pi / 2))  # the QJL estimator's scale, before the 1 / d


def sketched_query(q_rot: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rotated query rows P q (S, R, D) float32 -> the sketch G P q (S, R, D) contiguous (one instance)."""
    return (q_rot @ tensors["qjl_sketch"].T).contiguous()


def qjl_pointers(tensors: dict[str, torch.Tensor] | None, dummy: torch.Tensor) -> tuple:
    """The key side's (signs, residual norms, outlier signs, outlier residual norms); dummies where absent."""
    tensors = tensors or {}
    return tuple(tensors.get(name, dummy) for name in ("qjl_signs", "residual_norm", "outlier_qjl_signs",
                                                       "outlier_residual_norm"))


@triton.jit
def qjl_logits(qs, signs_ptr, rnorm_ptr, norm_ptr, block, t, DIM: tl.constexpr, BDI: tl.constexpr, BS: tl.constexpr,
               SCALES: tl.constexpr):
    """QJL terms (BR, TT) float32 of one instance for the block's tokens t (TT,), queries sketched as qs (BR, BDI)
    (zero past DIM): ``||x|| * sqrt(pi/2) / DIM * ||r|| * qs . sign``."""
    j = tl.arange(0, BDI)
    mask = (t[:, None] < BS) & (j < DIM)[None, :]
    bit = _packed_codes(signs_ptr + block * (BS // 8) * DIM, t, j, mask, DIM, BS, 1, 0, 0)  # (TT, BDI) 0 / 1
    sign = tl.where(mask, bit.to(tl.float32) * 2.0 - 1.0, 0.0)  # +-1, exact in tf32
    dots = tl.dot(qs, tl.trans(sign), input_precision="tf32x3")  # (BR, TT)
    tmask = t < BS
    gamma = tl.load(rnorm_ptr + block * BS + t, mask=tmask, other=0.0).to(tl.float32) * (SQRT_HALF_PI / DIM)  # (TT,)
    norm = token_norms(norm_ptr, block, t, BS, SCALES)  # (TT,) ||x_i||
    return dots * (gamma * norm)[None, :]


@triton.jit
def split_sketched_queries(q, mask_ptr, tables_ptr, block, c, cmask, D: tl.constexpr, SPLIT: tl.constexpr,
                           O_LEVELS: tl.constexpr, BDO: tl.constexpr, BDR: tl.constexpr):
    """Head-space query rows q (BR, BD) -> each instance's sketch of this block, (BR, BDO) and (BR, BDR) float32:
    ``G_i P_i q_i`` with q_i the rows' channels of instance i in the block's order."""
    outlier, rank_o, rank_r = channel_ranks(mask_ptr, block, c, cmask, D)
    sketches = tables_ptr + O_LEVELS + SPLIT * SPLIT + (D - SPLIT) * (D - SPLIT)  # past the codebook, P_o and P_r
    s_o = placement(sketches, rank_o, outlier, SPLIT, BDO)  # (BDO, BD): (G_o P_o)[j, rank_o(c)]
    s_r = placement(sketches + SPLIT * SPLIT, rank_r, cmask & ~outlier, D - SPLIT, BDR)  # (BDR, BD)
    return tl.dot(q, tl.trans(s_o), input_precision="ieee"), tl.dot(q, tl.trans(s_r), input_precision="ieee")
