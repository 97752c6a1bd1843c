"""The CPU decode kernel's reading of TurboQuant blocks (Numba; imported only when the ``numba`` backend runs).

A TurboQuant body block holds, per instance (`kvtool.methods.quant.turboquant`), bit-sliced codes (cap, BS * b / 8, d)
into a Lloyd-Max codebook and one fp16 norm per token; the stored unit vector is rotated, ``y = P x / ||x||`` with P
(d, d) the instance's rotation. With the outlier split a block has two instances over its own channel order (the
``d_o`` channels of its ``outlier_mask`` first, then the rest, each ascending), without it one instance over the head's
D channels in their order. Attention never rebuilds a key or value in head space:

* scores: ``q . x_t = sum_i ||x_t,i|| (P_i q_i) . y_t,i``: each query row is gathered into the block's channel order
  and rotated into each instance's domain (R (d_o^2 + d_r^2) per block with the split; once per work item without),
  then dotted with the codebook values of the block's tokens, one contiguous row at a time;
* values: ``sum_t p_t x_t = P_i^T sum_t p_t ||x_t,i|| y_t,i`` per instance: the weighted codebook rows are summed in the
  rotated domain and rotated back once per block with the split (then scattered to the block's channels), once per
  work item without.

A power-of-two instance's rotation, P = H diag(s), runs as the fast Walsh-Hadamard transform (d log2 d per row, in
16-lane vectors: `simd.py`); the Haar-random rotation of any other size (the split's rest, e.g. 192 of 256 channels)
as the matrix (d^2 per row, four query rows per pass over it). A block's codes go from their bytes to codebook
values in one pass, 16 at a time, and its logits and weighted value rows are products over whole tiles
(`simd.py`); a block's channel order is built without a branch per channel (its mask bits are data).
Everything else (float blocks, soft-capping, a sliding window's hidden tokens, the merge of the parts with this
step's token, the write of the token, scores) is the kernel of `cpu_decode_kernel.py`. The pure-torch reference is
`TurboQuantizer.chunk_scores` / ``chunk_values``; `tests/test_cpu_decode.py` compares the two. QJL residuals are not
read here (their stores stay on the torch path).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvtool.methods.quant.turboquant import NORM_LEVEL_UNITS
from kvtool.runtime.kernels.borrowed import borrowed
from kvtool.runtime.kernels.cpu_decode_kernel import (
    FAST,
    axpy,
    combine_streams,
    dot,
    exp_shifted,
    float_block_scores,
    float_block_values,
    half_to_float,
    open_part,
    part_scratch,
    part_softmax,
    codebook_tile,
    padded_codebook,
    slice_table,
)
from kvtool.runtime.kernels.simd import (
    LANES,
    MAX_LANES_DIM,
    tile_dots_lanes,
    walsh_hadamard_lanes,
    weighted_rows_lanes,
)
from kvtool.runtime.kernels.team_launch import team_runner

LN2 = 0.6931471805599453  # 8-bit norms: 2**x = exp(x ln 2)


@njit(cache=True, inline="always")
def block_order(mask, block, order):
    """order (D,) <- the channels of body block ``block`` in its stored order: those whose bit is set in its packed
    ``mask`` (cap, D / 8) (channel 8j + i at bit i of byte j) ascending, then the others ascending."""
    d = order.shape[0]
    row = mask[block]
    d_o = 0
    for c in range(d):
        d_o += (np.int64(row[c >> 3]) >> (c & 7)) & 1
    seen_o, seen_r = 0, d_o  # no branch per channel: the mask bits are data, a branch on each mispredicts often
    for c in range(d):
        bit = (np.int64(row[c >> 3]) >> (c & 7)) & 1
        order[seen_o if bit else seen_r] = c
        seen_o += bit
        seen_r += 1 - bit


@njit(cache=True, inline="always", fastmath=FAST)
def walsh_hadamard(x):
    """x (d,) <- sqrt(d) H x in place, H the orthonormal Walsh-Hadamard matrix (Sylvester order; d a power of two >= 8;
    the caller scales by 1 / sqrt(d)): log2(d) passes of butterflies, as `kvtool.methods.lowrank.hadamard.fwht`. From
    d = 16 in 16-lane vectors (`simd.walsh_hadamard_lanes`: Numba leaves the passes under 16 apart scalar); here
    (d = 8, or beyond ``MAX_LANES_DIM``) the three passes of pairs 1, 2 and 4 apart run as one pass over groups of 8."""
    d = x.shape[0]
    if LANES <= d <= MAX_LANES_DIM:
        walsh_hadamard_lanes(x)
        return
    for i in range(0, d, 8):
        a0, a1, a2, a3, a4, a5, a6, a7 = x[i], x[i + 1], x[i + 2], x[i + 3], x[i + 4], x[i + 5], x[i + 6], x[i + 7]
        b0, b1, b2, b3, b4, b5, b6, b7 = a0 + a1, a0 - a1, a2 + a3, a2 - a3, a4 + a5, a4 - a5, a6 + a7, a6 - a7
        c0, c1, c2, c3, c4, c5, c6, c7 = b0 + b2, b1 + b3, b0 - b2, b1 - b3, b4 + b6, b5 + b7, b4 - b6, b5 - b7
        x[i], x[i + 1], x[i + 2], x[i + 3] = c0 + c4, c1 + c5, c2 + c6, c3 + c7
        x[i + 4], x[i + 5], x[i + 6], x[i + 7] = c0 - c4, c1 - c5, c2 - c6, c3 - c7
    h = 8
    while h < d:
        for i in range(0, d, 2 * h):
            low, high = x[i:i + h], x[i + h:i + 2 * h]  # views from 0: LLVM vectorizes these, not range(i, i + h)
            for j in range(low.shape[0]):
                a, b = low[j], high[j]
                low[j] = a + b
                high[j] = a - b
        h *= 2


@njit(cache=True, inline="always", fastmath=FAST)
def mix_groups(src, mix, transpose, dst):
    """dst (m n,) <- (M kron I_n) src, or (M^T kron I_n) src with ``transpose``: the m x m factor M of a
    ``split_rotation: kronecker`` rotation across the m groups of n channels (src read at its first m n entries)."""
    m = mix.shape[0]
    n = dst.shape[0] // m
    dst[:] = 0.0
    for i in range(m):
        for k in range(m):
            a = mix[k, i] if transpose else mix[i, k]
            for j in range(n):
                dst[i * n + j] += a * src[k * n + j]


@njit(cache=True, inline="always", fastmath=FAST)
def matrix_rows(rows, matrix, out):
    """out (R, d) <- rows (R, d) @ matrix.T (matrix (d, d)): four rows per pass over each matrix row, so a Haar rotation
    (192 x 192 floats, larger than L1) is read once per four query rows, not once per row."""
    n, d = rows.shape
    r = 0
    while r + 4 <= n:
        g0, g1, g2, g3 = rows[r], rows[r + 1], rows[r + 2], rows[r + 3]
        for j in range(d):
            mj = matrix[j]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for c in range(d):
                m = mj[c]
                a0 += m * g0[c]
                a1 += m * g1[c]
                a2 += m * g2[c]
                a3 += m * g3[c]
            out[r, j], out[r + 1, j], out[r + 2, j], out[r + 3, j] = a0, a1, a2, a3
        r += 4
    for rest in range(r, n):
        for j in range(d):
            out[rest, j] = dot(matrix[j], rows[rest])


@njit(cache=True, inline="always", fastmath=FAST)
def gather_rows(qs, order, offset, signs, out):
    """out (R, d) <- every query row of qs (R, D) at channels ``order[offset : offset + d]``, times ``signs`` (d,)
    (none when empty): a channel's index read once for four rows."""
    rows, d = out.shape
    signed = signs.shape[0] == d
    r = 0
    while r + 4 <= rows:
        q0, q1, q2, q3 = qs[r], qs[r + 1], qs[r + 2], qs[r + 3]
        o0, o1, o2, o3 = out[r], out[r + 1], out[r + 2], out[r + 3]
        for c in range(d):
            i = order[offset + c]
            s = signs[c] if signed else np.float32(1.0)
            o0[c], o1[c], o2[c], o3[c] = q0[i] * s, q1[i] * s, q2[i] * s, q3[i] * s
        r += 4
    for rest in range(r, rows):
        qr, orow = qs[rest], out[rest]
        for c in range(d):
            orow[c] = qr[order[offset + c]] * (signs[c] if signed else np.float32(1.0))


@njit(cache=True, inline="always", fastmath=FAST)
def scatter_rows(rows, signs, order, offset, acc):
    """acc[r, order[offset + c]] += rows[r, c] * signs[c] (``signs`` (d,), none when empty) for every row of
    rows (R, d): a channel's index read once for four rows."""
    n, d = rows.shape
    signed = signs.shape[0] == d
    r = 0
    while r + 4 <= n:
        y0, y1, y2, y3 = rows[r], rows[r + 1], rows[r + 2], rows[r + 3]
        a0, a1, a2, a3 = acc[r], acc[r + 1], acc[r + 2], acc[r + 3]
        for c in range(d):
            i = order[offset + c]
            s = signs[c] if signed else np.float32(1.0)
            a0[i] += y0[c] * s
            a1[i] += y1[c] * s
            a2[i] += y2[c] * s
            a3[i] += y3[c] * s
        r += 4
    for rest in range(r, n):
        yr, ar = rows[rest], acc[rest]
        for c in range(d):
            ar[order[offset + c]] += yr[c] * (signs[c] if signed else np.float32(1.0))


@njit(cache=True, fastmath=FAST)
def rotate_rows(qs, order, offset, rotation, signs, gathered, rotated):
    """rotated (R, d) <- P q of every query row qs (R, D) taken at channels ``order[offset : offset + d]``: with
    ``signs`` (d,) (P = H diag(s), d a power of two) by the fast transform; with ``signs`` (d,) and ``rotation`` the
    m x m factor M of P = (M kron H_n) diag(s) (``split_rotation: kronecker``) by m fast transforms and M; else by the
    matrix P (d, d) (``gathered``: (R, d) scratch)."""
    d = rotated.shape[1]
    fast = signs.shape[0] == d
    m = rotation.shape[0]
    rows = gathered
    if fast and m != d:  # (M kron H_n) diag(s): m fast transforms of n channels, then M across them
        n = d // m
        gather_rows(qs, order, offset, signs, rows)
        for r in range(qs.shape[0]):
            for k in range(m):
                walsh_hadamard(rows[r, k * n : (k + 1) * n])
            mix_groups(rows[r], rotation, False, rotated[r])
        return
    if not fast:  # the matrix: every row gathered, then four rows per pass over P
        gather_rows(qs, order, offset, signs, rows)  # (signs empty: unsigned)
        matrix_rows(rows, rotation, rotated)
        return
    gather_rows(qs, order, offset, signs, rotated)  # signs already carry H's 1 / sqrt(d)
    for r in range(qs.shape[0]):
        walsh_hadamard(rotated[r])


@njit(cache=True, fastmath=FAST)
def unrotate_into(summed, rotation, signs, order, offset, row, acc):
    """acc (R, D) += P^T summed[r] (an instance's rotated-domain sums (R, d)) at channels ``order[offset : offset + d]``
    (``row``: (R, d) scratch): with ``signs`` diag(s) H y by the fast transform (with
    ``rotation`` an m x m factor M, ``split_rotation: kronecker``: diag(s) (M^T kron H_n) y), else by the matrix."""
    n_rows, d = summed.shape
    fast = signs.shape[0] == d
    m = rotation.shape[0]
    rows = row
    if not fast:  # the matrix: P^T y_r = sum_j y_r[j] P[j], four rows per pass over P
        rows[:] = 0.0
        r = 0
        while r + 4 <= n_rows:
            s0, s1, s2, s3 = summed[r], summed[r + 1], summed[r + 2], summed[r + 3]
            o0, o1, o2, o3 = rows[r], rows[r + 1], rows[r + 2], rows[r + 3]
            for j in range(d):
                pj = rotation[j]
                y0, y1, y2, y3 = s0[j], s1[j], s2[j], s3[j]
                for c in range(d):
                    p = pj[c]
                    o0[c] += y0 * p
                    o1[c] += y1 * p
                    o2[c] += y2 * p
                    o3[c] += y3 * p
            r += 4
        for rest in range(r, n_rows):
            for j in range(d):
                axpy(rows[rest], summed[rest, j], rotation[j])
        scatter_rows(rows, signs, order, offset, acc)  # (signs empty: unsigned)
        return
    for r in range(n_rows):
        if fast and m != d:  # diag(s) (M^T kron H_n): M^T across the n-channel groups, then m fast transforms
            n = d // m
            mix_groups(summed[r], rotation, True, rows[r])
            for k in range(m):
                walsh_hadamard(rows[r, k * n : (k + 1) * n])
        else:
            rows[r] = summed[r]
            walsh_hadamard(rows[r])
    scatter_rows(rows, signs, order, offset, acc)  # diag(s), then to the block's channels


@njit(cache=True, inline="always")
def _int16_at(norm, block, i):
    """The little-endian int16 at bytes i, i + 1 of a block's row."""
    bits = np.int32(norm[block, i]) | (np.int32(norm[block, i + 1]) << 8)
    return bits - 65536 if bits >= 32768 else bits


@njit(cache=True, inline="always", fastmath=FAST)
def block_norm_range(norm, block, bs):
    """(hi, step) float32 in octaves of a block whose ``norm`` holds 8-bit codes ((cap, bs + 4) uint8: the codes, then
    the block's log2 range hi, lo as int16 in 1/1024 octave): a code c reads 2**(hi - c step); (0, 0) for fp16 norms
    ((cap, 2 bs) uint8: the little-endian bytes of each token's fp16 norm; bs >= 16, so 2 bs != bs + 4)."""
    if norm.shape[1] == 2 * bs:
        return np.float32(0.0), np.float32(0.0)
    hi, lo = _int16_at(norm, block, bs), _int16_at(norm, block, bs + 2)
    return np.float32(hi / NORM_LEVEL_UNITS), np.float32((hi - lo) / (255.0 * NORM_LEVEL_UNITS))


@njit(cache=True, inline="always", fastmath=FAST)
def token_norm(norm, block, t, hi, step, bs):
    """||x_t|| of token t of the block (bs tokens): its fp16 norm (norm (cap, 2 bs): two bytes per token), or with
    8-bit codes (norm (cap, bs + 4)) 2**(hi - c step) from the block's range (`block_norm_range`). Both are uint8
    arrays, so the kernel has one compiled signature for either (and for keys and values that differ)."""
    if norm.shape[1] != 2 * bs:
        return np.float32(np.exp((hi - np.float32(norm[block, t]) * step) * np.float32(LN2)))
    return half_to_float(np.uint16(np.uint16(norm[block, 2 * t]) | (np.uint16(norm[block, 2 * t + 1]) << np.uint16(8))))


@njit(cache=True, inline="always", fastmath=FAST)
def block_norms(norm, block, norms, exponents):
    """norms (BS,) float32 <- ||x_t|| of every token of the block (`token_norm`; ``exponents`` (BS,) int32 scratch).
    8-bit codes read 2**(hi - c step) = e**(hi ln 2) e**(-c step ln 2), the second factor by the kernel's vectorized
    exponential (`exp_shifted`; np.exp is a scalar call per token without SVML), the first once per block."""
    bs = norms.shape[0]
    hi, step = block_norm_range(norm, block, bs)
    if norm.shape[1] == 2 * bs:  # fp16 norms
        for t in range(bs):
            norms[t] = token_norm(norm, block, t, hi, step, bs)
        return
    for t in range(bs):
        norms[t] = -np.float32(norm[block, t]) * step * np.float32(LN2)
    exp_shifted(norms, np.float32(0.0), exponents)
    top = np.float32(np.exp(hi * np.float32(LN2)))
    for t in range(bs):
        norms[t] *= top


@njit(cache=True, fastmath=FAST)
def instance_scores(scores, base, rotated, tile, norm, block, dots, norms, exponents):
    """scores[r, base + t] += ||x_t|| (P q_r) . y_t over the block's tokens: one instance's share of the logits
    (``dots`` (R, BS), ``norms`` (BS,), ``exponents`` (BS,) int32: scratch). With d and BS multiples of 16 the
    products run as `simd.tile_dots_lanes` (sixteen tokens' sums reduced together), else one dot product per row and
    token."""
    bs = tile.shape[0]
    rows, d = rotated.shape
    block_norms(norm, block, norms, exponents)
    if d % LANES == 0 and bs % LANES == 0:
        tile_dots_lanes(rotated, tile, dots, d)
        for r in range(rows):
            for t in range(bs):
                scores[r, base + t] += norms[t] * dots[r, t]
        return
    for t in range(bs):
        for r in range(rows):
            scores[r, base + t] += norms[t] * dot(rotated[r], tile[t])


@njit(cache=True, fastmath=FAST)
def instance_values(weights, base, tile, norm, block, summed, coef, norms, exponents):
    """summed (R, d) += sum_t p_t ||x_t|| y_t over the block's tokens: one instance's weighted rows, rotated domain
    (``coef`` (R, BS), ``norms`` (BS,), ``exponents`` (BS,) int32: scratch). With d a multiple of 16 as
    `simd.weighted_rows_lanes` (the coefficients p_t ||x_t|| first), else one row update per row and token."""
    bs = tile.shape[0]
    rows, d = summed.shape
    block_norms(norm, block, norms, exponents)
    if d % LANES == 0:
        for r in range(rows):
            for t in range(bs):
                coef[r, t] = weights[r, base + t] * norms[t]
        weighted_rows_lanes(coef, tile, summed, d)
        return
    for t in range(bs):
        for r in range(rows):
            p = weights[r, base + t]
            if p != 0.0:
                axpy(summed[r], p * norms[t], tile[t])


@njit(cache=True, fastmath=FAST)
def body_scores(s, j0, j1, qs, body_table, side, bs, order, scores, head):
    """scores[r, j * bs + t] <- the logits of the tokens of body columns [j0, j1) of stream s (TurboQuant keys; ``head``
    the stream's KV head, whose row of a calibrated mask gives every block's channel order)."""
    rows, d = qs.shape
    d_o, codes_o, codes_r, norm_o, norm_r, mask, book_o, book_r, rot_o, rot_r, signs_o, signs_r, widths_o, widths_r = side[:14]
    static = side[15]
    d_r = d - d_o
    tile_o, tile_r = np.empty((bs, max(d_o, 1)), dtype=np.float32), np.empty((bs, d_r), dtype=np.float32)
    table_o, table_r = np.empty(32, dtype=np.float32), np.empty(32, dtype=np.float32)  # the codebooks, padded
    padded_codebook(book_o, table_o)
    padded_codebook(book_r, table_r)
    slices_o, slices_r = np.empty(12, dtype=np.int32), np.empty(12, dtype=np.int32)  # the codes' bit slices
    slice_table(widths_o, bs, slices_o)
    slice_table(widths_r, bs, slices_r)
    rotated_o, rotated_r = np.empty((rows, max(d_o, 1)), dtype=np.float32), np.empty((rows, d_r), dtype=np.float32)
    gathered_o, gathered_r = np.empty_like(rotated_o), np.empty_like(rotated_r)  # the query rows in a block's order
    dots, norms = np.empty((rows, bs), dtype=np.float32), np.empty(bs, dtype=np.float32)
    exponents = np.empty(bs, dtype=np.int32)
    if d_o == 0 and j1 > j0:  # one channel order: the queries rotated once
        rotate_rows(qs, order, 0, rot_r, signs_r, gathered_r, rotated_r)
    elif static and j1 > j0:  # the split over the head's calibrated channels: one order, the queries rotated once
        block_order(mask, head, order)
        rotate_rows(qs, order, 0, rot_o, signs_o, gathered_o, rotated_o)
        rotate_rows(qs, order, d_o, rot_r, signs_r, gathered_r, rotated_r)
    for j in range(j0, j1):
        block = body_table[s, j]
        base = j * bs
        scores[:, base : base + bs] = 0.0
        if d_o > 0:
            if not static:  # the block's own channel order: the queries gathered into it and rotated per block
                block_order(mask, block, order)
                rotate_rows(qs, order, 0, rot_o, signs_o, gathered_o, rotated_o)
                rotate_rows(qs, order, d_o, rot_r, signs_r, gathered_r, rotated_r)
            codebook_tile(codes_o, block, widths_o, book_o, table_o, slices_o, tile_o)
            instance_scores(scores, base, rotated_o, tile_o, norm_o, block, dots, norms, exponents)
        codebook_tile(codes_r, block, widths_r, book_r, table_r, slices_r, tile_r)
        instance_scores(scores, base, rotated_r, tile_r, norm_r, block, dots, norms, exponents)


@njit(cache=True, fastmath=FAST)
def body_values(s, j0, j1, body_table, side, bs, order, weights, acc, head):
    """acc (R, D) += the weighted values of body columns [j0, j1) of stream s (TurboQuant values; weights (R, tokens);
    ``head`` as in `body_scores`)."""
    rows, d = acc.shape
    d_o, codes_o, codes_r, norm_o, norm_r, mask, book_o, book_r, rot_o, rot_r, signs_o, signs_r, widths_o, widths_r = side[:14]
    static = side[15]
    d_r = d - d_o
    tile_o, tile_r = np.empty((bs, max(d_o, 1)), dtype=np.float32), np.empty((bs, d_r), dtype=np.float32)
    table_o, table_r = np.empty(32, dtype=np.float32), np.empty(32, dtype=np.float32)  # the codebooks, padded
    padded_codebook(book_o, table_o)
    padded_codebook(book_r, table_r)
    slices_o, slices_r = np.empty(12, dtype=np.int32), np.empty(12, dtype=np.int32)  # the codes' bit slices
    slice_table(widths_o, bs, slices_o)
    slice_table(widths_r, bs, slices_r)
    summed_o, summed_r = np.zeros((rows, max(d_o, 1)), dtype=np.float32), np.zeros((rows, d_r), dtype=np.float32)
    rows_o, rows_r = np.empty_like(summed_o), np.empty_like(summed_r)  # P^T's rows
    coef, norms = np.empty((rows, bs), dtype=np.float32), np.empty(bs, dtype=np.float32)
    exponents = np.empty(bs, dtype=np.int32)
    for j in range(j0, j1):
        block = body_table[s, j]
        base = j * bs
        if d_o > 0:
            if not static:
                block_order(mask, block, order)
                summed_o[:] = 0.0
                summed_r[:] = 0.0
            codebook_tile(codes_o, block, widths_o, book_o, table_o, slices_o, tile_o)
            instance_values(weights, base, tile_o, norm_o, block, summed_o, coef, norms, exponents)
        codebook_tile(codes_r, block, widths_r, book_r, table_r, slices_r, tile_r)
        instance_values(weights, base, tile_r, norm_r, block, summed_r, coef, norms, exponents)
        if d_o > 0 and not static:  # each block its own channel order: back to head channels block by block
            unrotate_into(summed_o, rot_o, signs_o, order, 0, rows_o, acc)
            unrotate_into(summed_r, rot_r, signs_r, order, d_o, rows_r, acc)
    if d_o == 0 and j1 > j0:  # one channel order: the blocks' sums rotated back once
        unrotate_into(summed_r, rot_r, signs_r, order, 0, rows_r, acc)
    elif static and j1 > j0:  # the head's calibrated channels: one order, the sums rotated back once
        block_order(mask, head, order)
        unrotate_into(summed_o, rot_o, signs_o, order, 0, rows_o, acc)
        unrotate_into(summed_r, rot_r, signs_r, order, d_o, rows_r, acc)


@njit(cache=True, fastmath=FAST)
def attend_part_rotated(
    s, part, q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head,
    k_side, v_side, rope, window,
    bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
):
    """`cpu_decode_kernel.attend_part` for TurboQuant bodies (``rope`` is not used: TurboQuant keys are stored after
    RoPE). A side is (outlier channels d_o (0: no split), outlier codes, codes, outlier norms, norms (cap, BS) fp16
    bits, outlier masks (cap, D / 8) or (H_kv, D / 8), outlier codebook, codebook, outlier rotation (d_o, d_o), rotation (d_r, d_r),
    their signs (d,) where P = H diag(s) (else length 0: the matrix is read), outlier slice widths, slice widths,
    query scale (H_kv, D) or (0, D)). Keys with ``channel_scale: query`` hold k / s: the body's logits take the
    query times s, the row of the stream's KV head (``stream_head``); the float blocks hold k itself."""
    d = q.shape[2]
    fbs = float_k.shape[1]
    n_blocks, n_float = body_len[s], float_len[s]
    u0, u1, first, last = open_part(s, part, parts, float_len, body_len, bs, fbs, part_max, part_sum, part_acc)
    if u0 >= u1:
        return
    qs, scores, acc = q[s], weights[s], part_acc[s, part]
    order = np.arange(d)  # a block's channel order (the identity without a split)
    j1 = min(u1, n_blocks)
    query_scale = k_side[14]
    qk = qs  # (R, D) the query the body's codes are read with
    if query_scale.shape[0] > 0:
        qk = qs.copy()
        h = stream_head[s]
        for r in range(qk.shape[0]):
            for c in range(d):
                qk[r, c] *= query_scale[h, c]
    body_scores(s, u0, j1, qk, body_table, k_side, bs, order, scores, stream_head[s])  # pass 1: logits
    float_block_scores(s, u0, u1, n_blocks, n_float, qs, float_k, float_ks, float_table, float_kind, bs, scores)
    part_softmax(s, part, first, last, n_blocks, body_table, float_table, bs, fbs, window, softcap, scores, part_max,
                 part_sum)
    body_values(s, u0, j1, body_table, v_side, bs, np.arange(d), scores, acc, stream_head[s])  # pass 2: values
    float_block_values(s, u0, u1, n_blocks, n_float, float_v, float_vs, float_table, float_kind, bs, scores, acc)


# The drivers repeat `cpu_decode_kernel.decode_step` / `items_on_team_thread` / `attend_items` with this module's
# work item: Numba's on-disk cache keeps no function that takes another compiled function as an argument or closes over
# one (it would be compiled again in every process, about 15 s), so each work item gets its drivers spelled out.
def rotated_items_on_team_thread(payload, thread, size):
    """`cpu_decode_kernel.items_on_team_thread` over TurboQuant bodies."""
    ranges, parts = payload[0], payload[1]
    for i in range(thread, ranges.shape[0], size):
        for item in range(ranges[i, 0], ranges[i, 1]):
            attend_part_rotated(item // parts, item % parts, *payload[2:])


_rotated_items_on_team = team_runner(rotated_items_on_team_thread)


@njit(cache=True, nogil=True, fastmath=FAST)
def decode_rotated_step(
    q, new_k, new_v, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head,
    k_side, v_side, rope,
    window, bs, float_kind, softcap, sink_logits, has_sink, new_bits, write, float_score, body_score, new_score, score_mode,
    float_pos, new_pos, write_pos, parts, out, weights, part_max, part_sum, part_acc, team, threads, ranges,
):
    """`cpu_decode_kernel.decode_step` over TurboQuant bodies."""
    # the caller owns every array for the whole call: no reference counts (`borrowed`)
    (
        q, new_k, new_v, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len,
        stream_head, k_side, v_side, rope, window, bs, float_kind, softcap, sink_logits, has_sink, new_bits, write,
        float_score, body_score, new_score, score_mode, float_pos, new_pos, write_pos, parts, out, weights, part_max,
        part_sum, part_acc,
    ) = borrowed((
        q, new_k, new_v, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len,
        stream_head, k_side, v_side, rope, window, bs, float_kind, softcap, sink_logits, has_sink, new_bits, write,
        float_score, body_score, new_score, score_mode, float_pos, new_pos, write_pos, parts, out, weights, part_max,
        part_sum, part_acc,
    ))
    if team[0] != 0:
        _rotated_items_on_team(team[0], team[1], team[2], threads, (
            ranges, parts, q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head,
            k_side, v_side, rope, window, bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
        ))
    else:
        for item in range(q.shape[0] * parts):
            attend_part_rotated(
                item // parts, item % parts, q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table,
                body_len, stream_head,
                k_side, v_side, rope, window, bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
            )
    combine_streams(
        q, new_k, new_v, float_k, float_v, float_table, float_len, body_table, body_len, bs, softcap, sink_logits, has_sink,
        new_bits, write, float_score, body_score, new_score, score_mode, float_pos, new_pos, write_pos, parts, weights,
        part_max, part_sum, part_acc, out,
    )


@njit(cache=True, nogil=True, fastmath=FAST)
def attend_items_rotated(
    first, last, q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head,
    k_side, v_side, rope, window, bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
):
    """`cpu_decode_kernel.attend_items` over TurboQuant bodies."""
    # the caller owns every array for the whole call: no reference counts (`borrowed`)
    (
        q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head, k_side,
        v_side, rope, window, bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
    ) = borrowed((
        q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head, k_side,
        v_side, rope, window, bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
    ))
    for item in range(first, last):
        attend_part_rotated(
            item // parts, item % parts, q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table,
            body_len, stream_head,
            k_side, v_side, rope, window, bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
        )
