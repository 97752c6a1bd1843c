"""Palu's key logits on the host, compiled with Numba: the torch path's `PaluQuantizer.chunk_scores` (its reference)
in one pass over the latents, sixteen tokens at a time.

The torch path reconstructs a chunk's keys whole (tokens x g heads x D floats, 1.5 MB for SmolLM2-135M's 2K tokens),
turns them by RoPE in a few passes over that memory and only then takes the query products. Here every sixteen tokens'
keys of one head are reconstructed into a (16, D) tile (the latents times the head's up-projection,
`simd.matrix_product_lanes`), turned by RoPE row by row (`cpu_decode_kernel.rotate_row`) and dotted with the head's
query rows (`simd.tile_dots_lanes`) while the tile is in the first-level cache. Sums are reordered (vector lanes), so
the logits agree with the torch path's to float rounding, not bit for bit.

At SmolLM2-135M's shape (2K tokens, rank 80, 3 KV heads of 64) a layer's logits take about 0.68 ms on one Zen 4 core,
RoPE and products included, where torch's reconstruction alone (one MKL product) takes 0.70 ms; the product is then
bound by the core's multiply-adds (Zen 4 runs a 16-lane one as two 8-lane halves).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvtool.runtime.kernels.cpu_decode_kernel import FAST, rotate_row
from kvtool.runtime.kernels.simd import matrix_product_lanes, tile_dots_lanes

TILE = 16  # tokens reconstructed at a time (`tile_dots_lanes` reduces sixteen tokens' logits together)


def covers(tokens: int, head_dim: int) -> bool:
    """`latent_logits` takes chunks of ``tokens`` tokens at ``head_dim`` (any rank)."""
    return tokens % TILE == 0 and head_dim % 16 == 0


@njit(cache=True, fastmath=FAST)
def latent_logits(coded, group, up, bias, has_bias, cos, sin, rotary, interleaved, q, out):
    """out (S, g, R, T) float32 <- q (S, g, R, D) . RoPE(coded (S, T, r) @ up[G_s] (g, r, D) + bias[G_s] (g, D)), head
    by head, with G_s = group[s] (S,) the stream's head group: the logits of each stream's R query rows per KV head
    against its chunk of T tokens, from their stored coordinates ``coded`` (the Hadamard transform, if any, folded into
    ``up`` (G, g, r, D)) and the tokens' cos / sin (S, T, R) (``rotary`` = R channels turn, 0 for keys stored after
    RoPE; ``interleaved``: the pair layout). T a multiple of `TILE`, D a multiple of 16 (`covers`)."""
    n, tokens, _ = coded.shape
    heads, d = up.shape[1], up.shape[3]
    rows = q.shape[2]
    keys = np.empty((TILE, d), np.float32)
    logits = np.empty((rows, TILE), np.float32)
    for s in range(n):
        g_s = group[s]
        for t0 in range(0, tokens, TILE):
            latents = coded[s, t0:t0 + TILE]  # (TILE, r)
            for h in range(heads):
                matrix_product_lanes(latents, up[g_s, h], keys, d)  # (TILE, D): the head's keys before RoPE
                for t in range(TILE):
                    key = keys[t]
                    if has_bias:
                        for c in range(d):
                            key[c] += bias[g_s, h, c]
                    if rotary:
                        rotate_row(key, cos[s, t0 + t], sin[s, t0 + t], rotary, interleaved)
                tile_dots_lanes(q[s, h], keys, logits, d)  # (R, TILE)
                for i in range(rows):
                    for t in range(TILE):
                        out[s, h, i, t0 + t] = logits[i, t]
