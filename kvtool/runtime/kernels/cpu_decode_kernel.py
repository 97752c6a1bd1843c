"""The Numba-compiled CPU decode kernel of `cpu_decode.py` (imported only when the ``numba`` backend runs; compiled once
and cached on disk beside this file). See `cpu_decode.py` for the layout it reads and what it computes."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

TINY_LOGIT = np.float32(-60.0)  # relative weights under e^-60 are dropped (subnormal products are ~100x slower)
FAST = {"reassoc", "contract"}  # sums may be reordered (vectorized) and fused; no assumption about inf / nan


HALF_MAGIC = np.float32(2.0**112)  # 2^(127 - 15): rebias a float16 exponent placed in a float32
HALF_WAS_INF_NAN = np.float32(2.0**16)  # 2^(143 - 127): at or above this the float16 was inf / nan


@njit(cache=True, inline="always", fastmath=FAST)
def load_floats(src, block, count, bf16, buf):
    """buf[:count] (FBS, D) float32 <- the first ``count`` rows of float block ``block`` (uint16 bit patterns of float16
    or bfloat16), by bit operations that vectorize (float16: the magnitude bits shifted into a float32 and multiplied
    by 2^112, which also scales subnormals exactly; inf / nan keep an all-ones exponent; then the sign)."""
    d = buf.shape[1]
    bits = buf.view(np.uint32)
    for t in range(count):
        row, out = src[block, t], bits[t]
        if bf16:
            for c in range(d):
                out[c] = np.uint32(row[c]) << np.uint32(16)
        else:
            values = buf[t]
            for c in range(d):
                out[c] = (np.uint32(row[c]) & np.uint32(0x7FFF)) << np.uint32(13)
            for c in range(d):
                values[c] *= HALF_MAGIC
            for c in range(d):
                if values[c] >= HALF_WAS_INF_NAN:
                    out[c] |= np.uint32(0x7F800000)
                out[c] |= (np.uint32(row[c]) & np.uint32(0x8000)) << np.uint32(16)


@njit(cache=True, inline="always", fastmath=FAST)
def unpack_block(codes, block, widths, buf):
    """buf (BS, D) float32 <- the integer codes of body block ``block`` (bit-sliced, token-split: byte row j of a
    w-bit slice holds tokens j, j + BS/k, ... at bits 0, w, ...; k = 8 / w)."""
    bs, d = buf.shape
    row, low = 0, 0
    for i in range(widths.shape[0]):
        w = widths[i]
        if w == 0:
            break
        k = 8 // w
        sub = bs // k
        mask = np.int32((1 << w) - 1)
        weight = np.float32(1 << low)
        for j in range(sub):
            for part in range(k):
                t = j + part * sub
                shift = np.int32(part * w)
                if low == 0:
                    for c in range(d):
                        buf[t, c] = np.float32((np.int32(codes[block, row + j, c]) >> shift) & mask)
                else:
                    for c in range(d):
                        buf[t, c] += np.float32((np.int32(codes[block, row + j, c]) >> shift) & mask) * weight
        row += sub
        low += w


@njit(cache=True, inline="always", fastmath=FAST)
def dequantize_groups(buf, scale, zero, block, group, half):
    """buf (BS, D) codes -> values in place: code * scale + zero per token and group of ``group`` channels."""
    bs, d = buf.shape
    groups = d // group
    for t in range(bs):
        row = buf[t]
        for gi in range(groups):
            sc = half[scale[block, t * groups + gi]]
            zr = half[zero[block, t * groups + gi]]
            for c in range(gi * group, (gi + 1) * group):
                row[c] = row[c] * sc + zr


LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)  # ln 2 split in two (Cephes): k * LN2_HI is exact for |k| < 2^9
LN2_LO = np.float32(-2.12194440e-4)
DROPPED = -1000  # exponent marker of a term under e^-60


@njit(cache=True, inline="always", fastmath=FAST)
def exp_shifted(row, m, exponents):
    """row[x] <- exp(row[x] - m) in place (row <= m), in loops that vectorize (np.exp does not without SVML):
    exp(z) = 2^k * exp(r), k = round(z / ln 2), |r| <= ln 2 / 2, exp(r) by Cephes' degree-7 polynomial (about 1 ulp).
    Terms under e^-60 (relative weight < 1e-26) become exactly 0: products with subnormals are ~100x slower."""
    n = row.shape[0]
    for x in range(n):
        z = row[x] - m
        dropped = z <= TINY_LOGIT
        z = max(z, TINY_LOGIT)
        k = np.floor(z * LOG2E + np.float32(0.5))
        r = z - k * LN2_HI - k * LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        row[x] = p * r * r + r + np.float32(1.0)
        exponents[x] = np.int32(DROPPED) if dropped else np.int32(k)
    bits = row.view(np.int32)
    for x in range(n):
        e = exponents[x]
        bits[x] = bits[x] + (e << np.int32(23)) if e != DROPPED else np.int32(0)  # times 2^k (k >= -87: normal); 0.0


@njit(cache=True, inline="always", fastmath=FAST)
def dot(a, b):
    acc = np.float32(0.0)
    for c in range(a.shape[0]):
        acc += a[c] * b[c]
    return acc


@njit(cache=True, parallel=True, fastmath=FAST)
def decode(
    q, new_k, new_v, float_k, float_v, float_table, float_len, body_table, body_len,
    k_codes, k_scale, k_zero, k_widths, k_channel, k_group,
    v_codes, v_scale, v_zero, v_widths, v_channel, v_group,
    bs, fbs, half, bf16, softcap, sink_logits, has_sink, new_bits, write, out,
):
    streams, rows, d = q.shape
    for s in prange(streams):
        if write:  # this step's token into the stream's next float slot (after the held tokens: never read here)
            slot = float_len[s]
            block, offset = float_table[s, slot // fbs], slot % fbs
            for c in range(d):
                float_k[block, offset, c] = new_bits[0, s, c]
                float_v[block, offset, c] = new_bits[1, s, c]
        n_float = float_len[s]
        n_blocks = body_len[s]
        n_body = n_blocks * bs
        total = n_float + n_body + 1
        scores = np.empty((rows, total), dtype=np.float32)
        body_buf = np.empty((bs, d), dtype=np.float32)
        float_buf = np.empty((fbs, d), dtype=np.float32)
        q_block = np.empty((rows, d), dtype=np.float32)  # the query with a block's per-channel key scales folded in
        acc = np.zeros((rows, d), dtype=np.float32)
        # pass 1: scores, token order = body blocks then float slots (order does not change the result)
        for j in range(n_blocks):
            block = body_table[s, j]
            unpack_block(k_codes, block, k_widths, body_buf)
            if k_channel:  # q . (scale * code + zero) = (q * scale) . code + q . zero
                for r in range(rows):
                    z = np.float32(0.0)
                    for c in range(d):
                        q_block[r, c] = q[s, r, c] * half[k_scale[block, c]]
                        z += q[s, r, c] * half[k_zero[block, c]]
                    for t in range(bs):
                        scores[r, j * bs + t] = dot(q_block[r], body_buf[t]) + z
            else:
                dequantize_groups(body_buf, k_scale, k_zero, block, k_group, half)
                for t in range(bs):
                    for r in range(rows):
                        scores[r, j * bs + t] = dot(q[s, r], body_buf[t])
        for fb in range((n_float + fbs - 1) // fbs):
            count = min(fbs, n_float - fb * fbs)
            load_floats(float_k, float_table[s, fb], count, bf16, float_buf)
            for r in range(rows):
                for t in range(count):
                    scores[r, n_body + fb * fbs + t] = dot(q[s, r], float_buf[t])
        for r in range(rows):
            scores[r, total - 1] = dot(q[s, r], new_k[s])
        # softmax per row (soft-capped logits; a learned sink adds a term with no value)
        exponents = np.empty(total, dtype=np.int32)
        for r in range(rows):
            row = scores[r]
            if softcap > 0.0:
                for x in range(total):
                    row[x] = np.float32(softcap * np.tanh(row[x] / softcap))
            m = np.float32(-np.inf)
            for x in range(total):
                m = max(m, row[x])
            if has_sink:
                m = max(m, np.float32(sink_logits[s, r]))
            exp_shifted(row, m, exponents)
            l = np.float32(0.0)
            for x in range(total):
                l += row[x]
            if has_sink:
                l += np.exp(np.float32(sink_logits[s, r]) - m)
            inv = np.float32(1.0) / l
            for x in range(total):
                row[x] *= inv
        # pass 2: values
        for j in range(n_blocks):
            block = body_table[s, j]
            unpack_block(v_codes, block, v_widths, body_buf)
            if v_channel:  # sum_t p_t (scale * code_t + zero) = scale * sum_t p_t code_t + zero * sum_t p_t
                for r in range(rows):
                    q_block[r, :] = 0.0
                    mass = np.float32(0.0)
                    for t in range(bs):
                        p = scores[r, j * bs + t]
                        mass += p
                        for c in range(d):
                            q_block[r, c] += p * body_buf[t, c]
                    for c in range(d):
                        acc[r, c] += q_block[r, c] * half[v_scale[block, c]] + mass * half[v_zero[block, c]]
            else:
                dequantize_groups(body_buf, v_scale, v_zero, block, v_group, half)
                for r in range(rows):
                    acc_r = acc[r]
                    for t in range(bs):
                        p = scores[r, j * bs + t]
                        if p != 0.0:
                            row = body_buf[t]
                            for c in range(d):
                                acc_r[c] += p * row[c]
        for fb in range((n_float + fbs - 1) // fbs):
            count = min(fbs, n_float - fb * fbs)
            load_floats(float_v, float_table[s, fb], count, bf16, float_buf)
            for r in range(rows):
                acc_r = acc[r]
                for t in range(count):
                    p = scores[r, n_body + fb * fbs + t]
                    if p != 0.0:
                        row = float_buf[t]
                        for c in range(d):
                            acc_r[c] += p * row[c]
        for r in range(rows):
            p = scores[r, total - 1]
            for c in range(d):
                out[s, r, c] = acc[r, c] + p * new_v[s, c]
