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
bound by the core's multiply-adds (Zen 4 runs a 16-lane one as two 8-lane halves). So a large call is shared out over
torch's own OpenMP threads (`team_launch`, as the decode kernel's steps): 0.35 ms on two threads at that shape.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvtool.runtime.kernels.cpu_decode_kernel import FAST, rotate_row
from kvtool.runtime.kernels.openmp_team import team_for
from kvtool.runtime.kernels.simd import matrix_product_lanes, tile_dots_lanes
from kvtool.runtime.kernels.team_launch import team_runner

TILE = 16  # tokens reconstructed at a time (`tile_dots_lanes` reduces sixteen tokens' logits together)
SPREAD_MIN_WORK = 1 << 21  # multiply-adds from which a call spreads over torch's threads (about 50 us on one core)


def covers(tokens: int, head_dim: int) -> bool:
    """`latent_logits` takes chunks of ``tokens`` tokens at ``head_dim`` (any rank)."""
    return tokens % TILE == 0 and head_dim % 16 == 0


@njit(cache=True, fastmath=FAST)
def logits_of_tiles(coded, group, up, bias, has_bias, cos, sin, rotary, interleaved, q, out, first, last):
    """The (stream, sixteen-token tile) items [first, last) of `latent_logits` (item i: stream i // tiles, tokens
    16 (i % tiles) ..., tiles = T / 16): every head's keys of the tile reconstructed, turned and dotted."""
    tokens = coded.shape[1]
    heads, d = up.shape[1], up.shape[3]
    rows = q.shape[2]
    tiles = tokens // TILE
    keys = np.empty((TILE, d), np.float32)
    logits = np.empty((rows, TILE), np.float32)
    for item in range(first, last):
        s, t0 = item // tiles, (item % tiles) * TILE
        g_s = group[s]
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


def logits_on_team_thread(payload, thread, size):
    """What each thread of an OpenMP team runs (`team_launch`): ``payload`` = (`logits_of_tiles`' arrays and flags,
    then the item count); thread ``thread`` of ``size`` takes a contiguous share of the items."""
    total = payload[11]
    logits_of_tiles(*payload[:11], total * thread // size, total * (thread + 1) // size)


_logits_on_team = team_runner(logits_on_team_thread)


@njit(cache=True, nogil=True, fastmath=FAST)
def logits_step(coded, group, up, bias, has_bias, cos, sin, rotary, interleaved, q, out, team, threads):
    """`latent_logits` compiled: its items on this thread, or with ``team`` (the addresses of ``GOMP_parallel``,
    ``omp_get_thread_num`` and ``omp_get_num_threads``, `openmp_team`; zeros: none) on a team of ``threads`` OpenMP
    threads, this one among them, each taking a contiguous share."""
    total = coded.shape[0] * (coded.shape[1] // TILE)
    if team[0] != 0:
        _logits_on_team(team[0], team[1], team[2], threads,
                        (coded, group, up, bias, has_bias, cos, sin, rotary, interleaved, q, out, total))
    else:
        logits_of_tiles(coded, group, up, bias, has_bias, cos, sin, rotary, interleaved, q, out, 0, total)


def latent_logits(coded, group, up, bias, has_bias, cos, sin, rotary, interleaved, q, out) -> None:
    """out (S, g, R, T) float32 <- q (S, g, R, D) . RoPE(coded (S, T, r) @ up[G_s] (g, r, D) + bias[G_s] (g, D)), head
    by head, with G_s = group[s] (S,) the stream's head group: the logits of each stream's R query rows per KV head
    against its chunk of T tokens, from their stored coordinates ``coded`` (the Hadamard transform, if any, folded into
    ``up`` (G, g, r, D)) and the tokens' cos / sin (S, T, R) (``rotary`` = R channels turn, 0 for keys stored after
    RoPE; ``interleaved``: the pair layout). T a multiple of `TILE`, D a multiple of 16 (`covers`); numpy arrays.

    Threads: a call of at least `SPREAD_MIN_WORK` multiply-adds (tokens x heads x rank x D) runs on torch's own OpenMP
    threads (``torch.get_num_threads()`` of them, `openmp_team`), each taking a contiguous share of the (stream, tile)
    items: the reconstruction is compute-bound, and a model's other operations already use every thread torch has;
    smaller calls, and processes with no team, run on this thread."""
    work = coded.shape[0] * coded.shape[1] * up.shape[1] * coded.shape[2] * up.shape[3]
    team, addresses, threads = team_for(work, SPREAD_MIN_WORK)
    logits_step(coded, group, up, bias, has_bias, cos, sin, rotary, interleaved, q, out, addresses, threads)
    if team is not None:
        team.runs += 1
