"""The Numba-compiled CPU decode kernel of `cpu_decode.py` (imported only when the ``numba`` backend runs; compiled once
and cached on disk beside this file). See `cpu_decode.py` for the layout it reads and what it computes.

How it is written for speed (the compiler vectorizes simple loops over contiguous 1-D rows, not much else):
* every inner loop runs over one contiguous row of ``D`` channels (a key or value row, a query row, an accumulator),
  or over a view of part of one starting at 0: LLVM vectorizes ``for c in range(view.shape[0])`` but leaves a loop
  over ``range(base, end)`` of a row scalar (a kivi block at head_dim 256 ran 1.4-1.7x slower that way);
* 16-bit floats are widened in registers where they are read (`half_to_float`: one ``vcvtph2ps`` per 8 values on
  x86 with F16C, a native conversion on ARM, exact bit arithmetic elsewhere), so no float copy of a block is made;
* exp is a vectorized polynomial (`exp_shifted`), since ``np.exp`` does not vectorize without Intel SVML;
* only the per-row and per-token helpers (conversions, dot, axpy, exp, RoPE of a row) are inlined at Numba's level
  (``inline="always"``); the per-block and per-part ones (`load_codes`, `side_vectors`, `dequantize_groups`, the float
  blocks' passes, `part_softmax`, TurboQuant's `body_scores` / `body_values` ...) are calls, which LLVM may still
  inline. Inlining those too multiplied the first compile (TurboQuant's kernel 142 s on a 2-core VM, 25 s without; the
  plain kernel 21 s, 15 s) and ran no faster (1-5% slower at best-of-300 per block);
* a stream's held tokens are cut into ``parts`` (whole blocks each; flash-decoding): each part is one work item with
  its own softmax maximum, sum and weighted values (`attend_part`), and `combine` merges the parts of every stream
  with this step's own token. `decode_step` runs the items on one thread, or for a large step (`cpu_decode.py`'s
  ``SPREAD_MIN_WORK``) on torch's own OpenMP threads (`items_on_team_thread`: `team_launch.py` calls
  ``GOMP_parallel`` from compiled code, no Python on those threads), then `combine_streams` on one (a batch-1
  step has few streams, 3 on SmolLM2, so their tokens are split). Threads of our own (`attend_items` on Python
  threads) are left for a torch without OpenMP: beside torch's spinning threads they made the step slower.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from kvtool.runtime.kernels.body_format import BFLOAT16, FLOAT8_E4M3, FP8_LAYOUTS, INT8_SCALED
from kvtool.runtime.kernels.borrowed import borrowed
from kvtool.runtime.kernels.simd import LANES, codebook_block_lanes, codebook_lanes, tile_dots_lanes, weighted_rows_lanes
from kvtool.runtime.kernels.team_launch import team_runner

TINY_LOGIT = np.float32(-60.0)  # relative weights under e^-60 are dropped (subnormal products are ~100x slower)
FAST = {"reassoc", "contract"}  # sums may be reordered (vectorized) and fused; no assumption about inf / nan


def _native_half() -> bool:
    """The CPU widens float16 in hardware (x86 F16C, or ARM), so LLVM's ``fpext half`` needs no library call."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    try:
        import llvmlite.binding as llvm

        return "+f16c" in llvm.get_host_cpu_features().flatten()
    except Exception:  # noqa: BLE001  unknown host: the portable bit arithmetic
        return False


NATIVE_HALF = _native_half()  # a compile-time constant of the kernel (the on-disk cache is per CPU)
HALF_MAGIC = np.float32(2.0**112)  # 2^(127 - 15): rebias a float16 exponent placed in a float32
HALF_WAS_INF_NAN = np.float32(2.0**16)  # 2^(143 - 127): at or above this the float16 was inf / nan


@intrinsic
def _fpext_half(typingctx, bits):
    """uint16 bit pattern of an IEEE float16 -> float32 by LLVM's ``fpext half`` (exact)."""
    if not isinstance(bits, types.Integer) or bits.bitwidth != 16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@njit(cache=True, inline="always", fastmath=FAST)
def half_to_float(h):
    """float16 bits (uint16) -> float32, exactly (subnormals, inf and nan included)."""
    if NATIVE_HALF:
        return _fpext_half(h)
    return half_bits_to_float(h)


@njit(cache=True, inline="always", fastmath=FAST)
def half_bits_to_float(h):
    """`half_to_float` by integer and float arithmetic that vectorizes anywhere: the magnitude bits shifted into a
    float32 and multiplied by 2^112 (which also scales subnormals exactly), an all-ones exponent for inf / nan, then
    the sign."""
    u = np.uint32(h)
    magnitude = np.float32(np.uint32((u & np.uint32(0x7FFF)) << np.uint32(13)).view(np.float32) * HALF_MAGIC)
    inf_nan = np.uint32(0x7F800000) if magnitude >= HALF_WAS_INF_NAN else np.uint32(0)
    sign = np.uint32((u & np.uint32(0x8000)) << np.uint32(16))
    return np.uint32(np.uint32(np.float32(magnitude).view(np.uint32) | sign) | inf_nan).view(np.float32)


@njit(cache=True, inline="always", fastmath=FAST)
def bf16_to_float(h):
    return np.uint32(np.uint32(h) << np.uint32(16)).view(np.float32)


@njit(cache=True, inline="always", fastmath=FAST)
def dot(a, b):
    """a . b over two float32 rows."""
    acc = np.float32(0.0)
    for c in range(a.shape[0]):
        acc += a[c] * b[c]
    return acc


@njit(cache=True, inline="always", fastmath=FAST)
def fp8_to_float(byte, mantissa, bias):
    """An fp8 bit pattern (e4m3fn: 3, 7; e5m2: 2, 15) -> float32, exactly (the saturating encoder stores no nan/inf)."""
    b = np.int32(byte)
    exponent = (b >> mantissa) & ((np.int32(1) << (np.int32(7) - mantissa)) - np.int32(1))
    frac = b & ((np.int32(1) << mantissa) - np.int32(1))
    normal = np.uint32(((exponent + np.int32(127) - bias) << np.int32(23)) | (frac << (np.int32(23) - mantissa))).view(
        np.float32
    )
    unit = np.uint32((np.int32(128) - bias - mantissa) << np.int32(23)).view(np.float32)  # 2^(1 - bias - mantissa)
    magnitude = np.float32(frac) * unit if exponent == 0 else normal
    return -magnitude if b >= 128 else magnitude


E4M3_MANTISSA, E4M3_BIAS = (np.int32(n) for n in FP8_LAYOUTS["e4m3"])


@njit(cache=True, inline="always", fastmath=FAST)
def dot_half(a, h, hs, float_kind):
    """a . h: a float32 row and a float-pool row (float16 / bfloat16 bits, float8 e4m3 bytes, or int8 codes with
    ``hs`` the float16 bits of one scale per group of channels), widened as it is read."""
    acc = np.float32(0.0)
    if float_kind == INT8_SCALED:
        group = a.shape[0] // hs.shape[0]
        for j in range(hs.shape[0]):
            base, part = j * group, np.float32(0.0)
            for c in range(group):  # (a fixed-length loop from an offset: LLVM vectorizes it, not range(base, end))
                part += a[base + c] * np.float32(np.int8(h[base + c]))  # (int8 codes passed as their bytes)
            acc += part * half_to_float(np.uint16(hs[j]))
    elif float_kind == BFLOAT16:
        for c in range(a.shape[0]):
            acc += a[c] * bf16_to_float(h[c])
    elif float_kind == FLOAT8_E4M3:
        for c in range(a.shape[0]):
            acc += a[c] * fp8_to_float(h[c], E4M3_MANTISSA, E4M3_BIAS)
    else:
        for c in range(a.shape[0]):
            acc += a[c] * half_to_float(np.uint16(h[c]))  # (typed for uint8 rows too: the branch above reads them)
    return acc


@njit(cache=True, inline="always", fastmath=FAST)
def axpy(acc, p, x):
    """acc += p * x over float32 rows."""
    for c in range(acc.shape[0]):
        acc[c] += p * x[c]


@njit(cache=True, inline="always", fastmath=FAST)
def axpy_half(acc, p, h, hs, float_kind):
    """acc += p * h: h a float-pool row (`dot_half`; ``hs`` its scales), widened as it is read."""
    if float_kind == INT8_SCALED:
        group = acc.shape[0] // hs.shape[0]
        for j in range(hs.shape[0]):
            ps, base = p * half_to_float(np.uint16(hs[j])), j * group
            for c in range(group):  # (as in `dot_half`: vectorized)
                acc[base + c] += ps * np.float32(np.int8(h[base + c]))
    elif float_kind == BFLOAT16:
        for c in range(acc.shape[0]):
            acc[c] += p * bf16_to_float(h[c])
    elif float_kind == FLOAT8_E4M3:
        for c in range(acc.shape[0]):
            acc[c] += p * fp8_to_float(h[c], E4M3_MANTISSA, E4M3_BIAS)
    else:
        for c in range(acc.shape[0]):
            acc[c] += p * half_to_float(np.uint16(h[c]))  # (typed for uint8 rows too)


@njit(cache=True, inline="always", fastmath=FAST)
def unpack_block(codes, block, widths, buf):
    """buf (BS, D) float32 <- the integer codes of body block ``block`` (bit-sliced, token-split: byte row j of a
    w-bit slice holds tokens j, j + BS/k, ... at bits 0, w, ...; k = 8 / w)."""
    bs = buf.shape[0]
    rows = codes[block]  # (BS * bits / 8, D) uint8
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
            src = rows[row + j]
            for part in range(k):
                dst = buf[j + part * sub]
                shift = np.int32(part * w)
                if low == 0:
                    for c in range(dst.shape[0]):
                        dst[c] = np.float32((np.int32(src[c]) >> shift) & mask)
                else:
                    for c in range(dst.shape[0]):
                        dst[c] += np.float32((np.int32(src[c]) >> shift) & mask) * weight
        row += sub
        low += w


@njit(cache=True, inline="always")
def padded_codebook(codebook, table):
    """table (32,) float32 <- the codebook (up to 32 levels), padded by its last level (read by `lookup_row`); zeros
    for the empty placeholder of a side without an outlier instance."""
    top = codebook.shape[0] - 1
    for i in range(table.shape[0]):
        table[i] = codebook[min(i, top)] if top >= 0 else np.float32(0.0)


@njit(cache=True, inline="always", fastmath=FAST)
def lookup_row(row, codebook, table):
    """row (d,) float codes 0 .. L - 1 -> their codebook values in place: up to 32 levels 16 codes at a time by a
    variable permute of the padded ``table`` (`simd.codebook_lanes`; Numba leaves ``codebook[code]`` scalar), the
    rest and larger codebooks (6-bit outlier codes) one by one."""
    n = row.shape[0]
    done = 0
    if codebook.shape[0] <= 32:
        codebook_lanes(row, table)
        done = n - n % LANES
    for c in range(done, n):
        row[c] = codebook[np.int32(row[c])]


@njit(cache=True, inline="always")
def slice_table(widths, bs, slices):
    """slices (12,) int32 <- (first row, rows, width, low bit) of each of up to three bit slices of a body block of
    ``bs`` tokens with slice ``widths`` (`unpack_block`'s layout: a w-bit slice spans bs w / 8 byte rows), (0, 1, 0, 0)
    for a slice the codes do not have; read by `simd.codebook_block_lanes`. All zeros (the block then read by
    `unpack_block`) when the codes have more than three slices."""
    slices[:] = 0
    for i in range(3, widths.shape[0]):
        if widths[i] > 0:
            return
    first, low = 0, 0
    for i in range(3):
        w = widths[i] if i < widths.shape[0] else 0
        if w == 0:
            slices[4 * i + 1] = 1
            continue
        sub = bs * w // 8
        slices[4 * i], slices[4 * i + 1], slices[4 * i + 2], slices[4 * i + 3] = first, sub, w, low
        first += sub
        low += w


@njit(cache=True, fastmath=FAST)
def codebook_tile(codes, block, widths, codebook, table, slices, tile):
    """tile (BS, d) float32 <- the codebook values of block ``block``'s codes (cap, BS * b / 8, d), bit-sliced and
    token-split as `unpack_block` reads them. Codes of up to 5 bits in at most three slices over d a
    multiple of 16 (every TurboQuant recipe's instances at head_dim 64 and 256): in one pass from the bytes to the
    codebook values (`simd.codebook_block_lanes`; ``slices`` from `slice_table`, all zeros when it does not apply;
    ``table`` the codebook padded to 32 levels, `padded_codebook`); else `unpack_block` (which writes the integer
    codes as floats), then `lookup_row` over the tile as one row."""
    if slices[1] > 0 and codebook.shape[0] <= 32 and tile.shape[1] % LANES == 0:
        codebook_block_lanes(codes[block], slices, table, tile)
        return
    unpack_block(codes, block, widths, tile)
    lookup_row(tile.reshape(tile.size), codebook, table)  # the tile is one contiguous row


@njit(cache=True, fastmath=FAST)
def load_codes(codes, block, widths, fp8_mantissa, fp8_bias, levels, table, slices, buf):
    """buf (BS, D) float32 <- body block ``block``'s codes: fp8 bytes (cap, BS, D) decoded to floats when
    ``fp8_mantissa`` > 0; else bit-sliced integer codes, as their codebook values when the side has ``levels`` (L,)
    (nuq: `codebook_tile`, ``table`` and ``slices`` from `padded_codebook` and `slice_table`), else as the integers
    (`unpack_block`)."""
    if fp8_mantissa > 0:
        rows = codes[block]
        for t in range(buf.shape[0]):
            src, dst = rows[t], buf[t]
            for c in range(dst.shape[0]):
                dst[c] = fp8_to_float(src[c], fp8_mantissa, fp8_bias)
    elif levels.shape[0] > 0:
        codebook_tile(codes, block, widths, levels, table, slices, buf)
    else:
        unpack_block(codes, block, widths, buf)


@njit(cache=True)
def scatter_outliers(buf, index, value, block):
    """buf (BS, D) float32 dequantized values <- block ``block``'s sparse outliers (nuq's dense-and-sparse split): k
    (flat token-major position, value) pairs, ``index`` (cap, k) the int16 positions' bits (position - 32768, so
    position = bits ^ 0x8000) and ``value`` (cap, k) float16 bits, each replacing the dense value at its position."""
    d = buf.shape[1]
    for i in range(index.shape[1]):
        position = np.int64(index[block, i]) ^ 0x8000
        buf[position // d, position % d] = half_to_float(value[block, i])


@njit(cache=True)
def scatter_outliers_scaled(buf, index, value, block, scale, zero):
    """`scatter_outliers` into a tile of codebook values that are dequantized later as ``x * scale + zero`` per
    channel (scale, zero (D,); scale > 0): each outlier is written as ``(value - zero) / scale``, so the fold of the
    scale into the query (keys) or into the summed values gives it back (to float32 rounding)."""
    d = buf.shape[1]
    for i in range(index.shape[1]):
        position = np.int64(index[block, i]) ^ 0x8000
        c = position % d
        buf[position // d, c] = (half_to_float(value[block, i]) - zero[c]) / scale[c]


@njit(cache=True, fastmath=FAST)
def side_vectors(mode, scale16, zero16, table_scale, table_zero, has_zero, block, head, scale, zero):
    """Per-channel scale and zero (D,) of a block whose parameters do not vary by token: mode 1 fp16 per block and
    channel; 4 calibrated tables (rows 1 or H_kv, columns 1 or D) read at the stream's KV head; 3 one float32 per
    block (no zero)."""
    d = scale.shape[0]
    if mode == 1:
        for c in range(d):
            scale[c] = half_to_float(scale16[block, c])
            zero[c] = half_to_float(zero16[block, c]) if has_zero else np.float32(0.0)
    elif mode == 4:
        row = head if table_scale.shape[0] > 1 else 0
        wide = table_scale.shape[1] > 1
        for c in range(d):
            scale[c] = table_scale[row, c if wide else 0]
        if has_zero:
            zrow = head if table_zero.shape[0] > 1 else 0
            zwide = table_zero.shape[1] > 1
            for c in range(d):
                zero[c] = table_zero[zrow, c if zwide else 0]
        else:
            zero[:] = 0.0
    else:
        sc = table_scale[block, 0]
        for c in range(d):
            scale[c] = sc
        zero[:] = 0.0


@njit(cache=True, fastmath=FAST)
def dequantize_groups(buf, scale, zero, block, group):
    """buf (BS, D) codes -> values in place: code * scale + zero per token and group of ``group`` channels
    (scale / zero (cap, BS * D / group) float16 bits)."""
    bs, d = buf.shape
    groups = d // group
    for t in range(bs):
        row = buf[t]
        for gi in range(groups):
            sc = half_to_float(scale[block, t * groups + gi])
            zr = half_to_float(zero[block, t * groups + gi])
            part = row[gi * group:(gi + 1) * group]  # a view from 0 (vectorized; `range(base, end)` was scalar)
            for c in range(part.shape[0]):
                part[c] = part[c] * sc + zr


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


@njit(cache=True, inline="always")
def part_units(s, part, parts, float_len, body_len, fbs):
    """Units (body blocks, then float blocks) [u0, u1) of stream ``s``'s part ``part`` of ``parts``."""
    units = body_len[s] + (float_len[s] + fbs - 1) // fbs
    return units * part // parts, units * (part + 1) // parts


@njit(cache=True, inline="always", fastmath=FAST)
def body_position(source, positions, n_sink, streams_per_sequence, s, j, t, block, bs):
    """True position of body token t of column j (block id ``block``) of stream s, as the Triton kernel's
    `body_rope.body_positions`: source 1 the pool's ``pos`` (cap, BS) per slot; 2 the sequence's recorded positions
    (B, W) at token ``n_sink[s] + j * bs + t``; 3 that token index itself."""
    if source == 1:
        return positions[block, t]
    token = n_sink[s] + j * bs + t
    if source == 2:
        return positions[s // streams_per_sequence, token]
    return token


@njit(cache=True, inline="always", fastmath=FAST)
def rotate_row(row, cos, sin, rotary, interleaved):
    """RoPE of one pre-RoPE key row (D,) in place with its position's cos / sin (R,) (the model's layout, attention
    scaling included): x * cos + turn(x) * sin over the first R channels, turn (x1, x2) -> (-x2, x1) of the halves
    (or of each pair (2i, 2i + 1) when interleaved), as `kvtool.models.rope.apply_rope`."""
    if interleaved:
        for i in range(0, rotary, 2):
            x1, x2 = row[i], row[i + 1]
            row[i] = x1 * cos[i] - x2 * sin[i]
            row[i + 1] = x2 * cos[i + 1] + x1 * sin[i + 1]
    else:
        half = rotary // 2
        for i in range(half):
            x1, x2 = row[i], row[i + half]
            row[i] = x1 * cos[i] - x2 * sin[i]
            row[i + half] = x2 * cos[i + half] + x1 * sin[i + half]


@njit(cache=True)
def window_hidden(s, first, last, n_body, body_table, float_table, bs, fbs, window):
    """(last - first,) bool: the tokens [first, last) of stream s (body blocks, then float slots) that a sliding
    window hides from this step's query (position <= query position - W); empty when the layer has no window."""
    size, query_pos, float_pos, body_pos = window
    if size <= 0:
        return np.zeros(0, dtype=np.bool_)
    limit = query_pos[s] - size
    hidden = np.empty(last - first, dtype=np.bool_)
    for x in range(first, last):
        if x < n_body:
            position = body_pos[body_table[s, x // bs], x % bs]
        else:
            f = x - n_body
            position = float_pos[float_table[s, f // fbs], f % fbs]
        hidden[x - first] = position <= limit
    return hidden


@njit(cache=True)
def open_part(s, part, parts, float_len, body_len, bs, fbs, part_max, part_sum, part_acc):
    """Start work item (s, part): its units [u0, u1) (body blocks of ``bs`` tokens, then float blocks of ``fbs``), its
    token range [first, last), and its weighted values zeroed; an empty part (u0 >= u1) is finished here (m = -inf,
    sums 0)."""
    n_blocks, n_float = body_len[s], float_len[s]
    u0, u1 = part_units(s, part, parts, float_len, body_len, fbs)
    part_acc[s, part][:] = 0.0
    if u0 >= u1:
        part_max[s, part, :] = -np.inf
        part_sum[s, part, :] = 0.0
    n_body = n_blocks * bs
    first = u0 * bs if u0 <= n_blocks else n_body + (u0 - n_blocks) * fbs
    last = u1 * bs if u1 <= n_blocks else min(n_body + (u1 - n_blocks) * fbs, n_body + n_float)
    return u0, u1, first, last


@njit(cache=True, fastmath=FAST)
def float_block_scores(s, u0, u1, n_blocks, n_float, qs, float_k, float_ks, float_table, float_kind, bs, scores):
    """scores (R, tokens) <- q . k of the float slots among units [u0, u1) of stream s (keys widened as read;
    ``float_ks`` (cap, FBS, D / G) their scales when the slots are int8 codes)."""
    rows, fbs = qs.shape[0], float_k.shape[1]
    scaled = float_kind == INT8_SCALED
    for fb in range(max(u0, n_blocks) - n_blocks, u1 - n_blocks):
        block = float_table[s, fb]
        keys = float_k[block]  # (FBS, D) 16-bit, or bytes
        key_scales = float_ks[block if scaled else 0]  # (FBS, D / G)
        base = n_blocks * bs + fb * fbs
        for t in range(min(fbs, n_float - fb * fbs)):
            for r in range(rows):
                scores[r, base + t] = dot_half(qs[r], keys[t], key_scales[t if scaled else 0], float_kind)


@njit(cache=True, fastmath=FAST)
def part_softmax(s, part, first, last, n_blocks, body_table, float_table, bs, fbs, window, softcap, scores, part_max,
                 part_sum):
    """The part's softmax terms per row, in place over its logits ``scores[:, first:last]`` (soft-capped; a sliding
    window's hidden tokens at -inf): exp(logit - m), with m and the sum in ``part_max`` / ``part_sum[s, part]``."""
    rows = scores.shape[0]
    exponents = np.empty(last - first, dtype=np.int32)
    hidden = window_hidden(s, first, last, n_blocks * bs, body_table, float_table, bs, fbs, window)
    for r in range(rows):
        row = scores[r, first:last]
        if softcap > 0.0:
            for x in range(row.shape[0]):
                row[x] = np.float32(softcap * np.tanh(row[x] / softcap))
        for x in range(hidden.shape[0]):
            if hidden[x]:
                row[x] = -np.inf
        m = np.float32(-np.inf)
        for x in range(row.shape[0]):
            m = max(m, row[x])
        if m == -np.inf:  # every token of the part is hidden: no terms
            row[:] = 0.0
            part_max[s, part, r] = m
            part_sum[s, part, r] = 0.0
            continue
        exp_shifted(row, m, exponents)
        total = np.float32(0.0)
        for x in range(row.shape[0]):
            total += row[x]
        part_max[s, part, r] = m
        part_sum[s, part, r] = total


@njit(cache=True, fastmath=FAST)
def float_block_values(s, u0, u1, n_blocks, n_float, float_v, float_vs, float_table, float_kind, bs, weights, acc):
    """acc (R, D) += the weighted values (widened as read) of the float slots among units [u0, u1) of stream s."""
    rows, fbs = acc.shape[0], float_v.shape[1]
    scaled = float_kind == INT8_SCALED
    for fb in range(max(u0, n_blocks) - n_blocks, u1 - n_blocks):
        block = float_table[s, fb]
        values = float_v[block]
        value_scales = float_vs[block if scaled else 0]  # (FBS, D / G)
        base = n_blocks * bs + fb * fbs
        for r in range(rows):
            acc_r = acc[r]
            for t in range(min(fbs, n_float - fb * fbs)):
                p = weights[r, base + t]
                if p != 0.0:
                    axpy_half(acc_r, p, values[t], value_scales[t if scaled else 0], float_kind)


@njit(cache=True, inline="always", fastmath=FAST)
def block_logits(rows_q, tile, offsets, lanes, dots, scores, base):
    """scores[r, base + t] <- rows_q[r] . tile[t] + offsets[r] for a block's tokens: rows_q (R, D), tile (BS, D),
    offsets (R,), dots (R, BS) scratch. With ``lanes`` (D and BS multiples of 16) sixteen tokens' sums are reduced
    together (`simd.tile_dots_lanes`), else one dot product per row and token."""
    rows, bs = dots.shape
    if lanes:
        tile_dots_lanes(rows_q, tile, dots, rows_q.shape[1])
        for r in range(rows):
            for t in range(bs):
                scores[r, base + t] = dots[r, t] + offsets[r]
    else:
        for t in range(bs):
            for r in range(rows):
                scores[r, base + t] = dot(rows_q[r], tile[t]) + offsets[r]


@njit(cache=True, inline="always", fastmath=FAST)
def block_weighted_rows(scores, base, tile, lanes, coef, summed):
    """summed (R, D) += sum_t scores[r, base + t] tile[t] over a block's tokens (``coef`` (R, BS) scratch): with
    ``lanes`` four chunks of a row per pass over the tokens (`simd.weighted_rows_lanes`), else one row update per
    token with a weight (weights under e^-60 are 0: skipped)."""
    rows, bs = coef.shape
    if lanes:
        for r in range(rows):
            for t in range(bs):
                coef[r, t] = scores[r, base + t]
        weighted_rows_lanes(coef, tile, summed, tile.shape[1])
    else:
        for r in range(rows):
            summed_r = summed[r]
            for t in range(bs):
                p = scores[r, base + t]
                if p != 0.0:
                    axpy(summed_r, p, tile[t])


@njit(cache=True, fastmath=FAST)
def attend_part(
    s, part, q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head,
    k_side, v_side, rope, window,
    bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
):
    """One work item: the held tokens of stream ``s`` in its part ``part`` (whole blocks). ``rope``: body keys
    stored before RoPE are rotated at their true positions (source > 0, `body_position`, `rotate_row`). ``window``: a
    sliding-window layer's (W, query position (S,), float pool ``pos`` (cap, FBS), body pool ``pos`` (cap, BS)); W > 0
    hides every held token at a position <= the query's - W (its logit -inf after soft-capping), as the torch path's
    `chunk_visibility`. Leaves, per query row,
    exp(logit - m) in ``weights[s]`` (R, tokens; token order body blocks, then float slots), m in
    ``part_max[s, part]``, the sum of the weights in ``part_sum[s, part]`` and the weighted values in
    ``part_acc[s, part]`` (R, D). An empty part: m = -inf, sums 0."""
    rows, d = q.shape[1], q.shape[2]
    fbs = float_k.shape[1]
    n_blocks, n_float = body_len[s], float_len[s]
    u0, u1, first, last = open_part(s, part, parts, float_len, body_len, bs, fbs, part_max, part_sum, part_acc)
    if u0 >= u1:
        return
    qs, scores, acc = q[s], weights[s], part_acc[s, part]
    # pass 1: logits
    (k_codes, k_scale, k_zero, k_widths, k_mode, k_group, k_mantissa, k_bias, k_table, k_table_zero, k_has_zero,
     k_levels, k_out_index, k_out_value) = k_side
    (v_codes, v_scale, v_zero, v_widths, v_mode, v_group, v_mantissa, v_bias, v_table, v_table_zero, v_has_zero,
     v_levels, v_out_index, v_out_value) = v_side
    rope_source, rope_cos, rope_sin, rotary, interleaved, rope_positions, n_sink, streams_per_sequence = rope
    head = stream_head[s]
    body_buf = np.empty((bs, d), dtype=np.float32)
    scale_vec = np.empty(d, dtype=np.float32)
    zero_vec = np.empty(d, dtype=np.float32)
    k_lut, v_lut = np.empty(32, dtype=np.float32), np.empty(32, dtype=np.float32)  # nuq codebooks, padded
    k_slices, v_slices = np.zeros(12, dtype=np.int32), np.zeros(12, dtype=np.int32)
    if k_levels.shape[0] > 0:
        padded_codebook(k_levels, k_lut)
        slice_table(k_widths, bs, k_slices)
    if v_levels.shape[0] > 0:
        padded_codebook(v_levels, v_lut)
        slice_table(v_widths, bs, v_slices)
    k_outliers, v_outliers = k_out_index.shape[1] > 0, v_out_index.shape[1] > 0
    lanes = d % LANES == 0 and bs % LANES == 0
    dots = np.empty((rows, bs), dtype=np.float32)  # a block's logits, then its weights (scratch)
    q_fold = np.empty((rows, d), dtype=np.float32)  # query rows with a block's per-channel key scales folded in
    offsets = np.zeros(rows, dtype=np.float32)  # q . zero per row (0 where the tile holds the keys themselves)
    no_offsets = np.zeros(rows, dtype=np.float32)
    for j in range(u0, min(u1, n_blocks)):
        block = body_table[s, j]
        load_codes(k_codes, block, k_widths, k_mantissa, k_bias, k_levels, k_lut, k_slices, body_buf)
        if rope_source > 0:  # keys stored before RoPE: decoded, then rotated at each token's true position
            if k_mode != 2:
                side_vectors(k_mode, k_scale, k_zero, k_table, k_table_zero, k_has_zero, block, head, scale_vec, zero_vec)
                for t in range(bs):
                    key_row = body_buf[t]
                    for c in range(d):
                        key_row[c] = key_row[c] * scale_vec[c] + zero_vec[c]
            else:
                dequantize_groups(body_buf, k_scale, k_zero, block, k_group)
            if k_outliers:
                scatter_outliers(body_buf, k_out_index, k_out_value, block)
            for t in range(bs):
                position = body_position(rope_source, rope_positions, n_sink, streams_per_sequence, s, j, t, block, bs)
                rotate_row(body_buf[t], rope_cos[position], rope_sin[position], rotary, interleaved)
            block_logits(qs, body_buf, no_offsets, lanes, dots, scores, j * bs)
        elif k_mode != 2:  # q . (scale * code + zero) = (q * scale) . code + q . zero, scale and zero per channel
            side_vectors(k_mode, k_scale, k_zero, k_table, k_table_zero, k_has_zero, block, head, scale_vec, zero_vec)
            if k_outliers:
                scatter_outliers_scaled(body_buf, k_out_index, k_out_value, block, scale_vec, zero_vec)
            for r in range(rows):
                z = np.float32(0.0)
                qr, fold = qs[r], q_fold[r]
                for c in range(d):
                    fold[c] = qr[c] * scale_vec[c]
                    z += qr[c] * zero_vec[c]
                offsets[r] = z
            block_logits(q_fold, body_buf, offsets, lanes, dots, scores, j * bs)
        else:
            dequantize_groups(body_buf, k_scale, k_zero, block, k_group)
            if k_outliers:
                scatter_outliers(body_buf, k_out_index, k_out_value, block)
            block_logits(qs, body_buf, no_offsets, lanes, dots, scores, j * bs)
    float_block_scores(s, u0, u1, n_blocks, n_float, qs, float_k, float_ks, float_table, float_kind, bs, scores)
    part_softmax(s, part, first, last, n_blocks, body_table, float_table, bs, fbs, window, softcap, scores, part_max,
                 part_sum)
    # pass 2: values
    part_v = np.empty((rows, d), dtype=np.float32)  # a block's weighted code rows (folded scales)
    for j in range(u0, min(u1, n_blocks)):
        block = body_table[s, j]
        load_codes(v_codes, block, v_widths, v_mantissa, v_bias, v_levels, v_lut, v_slices, body_buf)
        if v_mode != 2:  # sum_t p_t (scale * code_t + zero) = scale * sum_t p_t code_t + zero * sum_t p_t
            side_vectors(v_mode, v_scale, v_zero, v_table, v_table_zero, v_has_zero, block, head, scale_vec, zero_vec)
            if v_outliers:
                scatter_outliers_scaled(body_buf, v_out_index, v_out_value, block, scale_vec, zero_vec)
            part_v[:] = 0.0
            block_weighted_rows(scores, j * bs, body_buf, lanes, dots, part_v)
            for r in range(rows):
                mass = np.float32(0.0)
                for t in range(bs):
                    mass += scores[r, j * bs + t]
                acc_r, part_r = acc[r], part_v[r]
                for c in range(d):
                    acc_r[c] += part_r[c] * scale_vec[c] + mass * zero_vec[c]
        else:
            dequantize_groups(body_buf, v_scale, v_zero, block, v_group)
            if v_outliers:
                scatter_outliers(body_buf, v_out_index, v_out_value, block)
            block_weighted_rows(scores, j * bs, body_buf, lanes, dots, acc)
    float_block_values(s, u0, u1, n_blocks, n_float, float_v, float_vs, float_table, float_kind, bs, scores, acc)


@njit(cache=True, fastmath=FAST)
def combine(
    s, q, new_k, new_v, float_k, float_v, float_table, float_len, body_table, body_len, bs, softcap, sink_logits, has_sink,
    new_bits, write, float_score, body_score, new_score, score_mode, float_pos, new_pos, write_pos, parts,
    weights, part_max, part_sum, part_acc, out,
):
    """Stream ``s``: its parts merged with this step's own token (and a learned sink) into out[s] (R, D); the scores
    (``score_mode`` 2: each held token's grows by the attention its rows gave it, summed over the rows; the written
    slot's is its own; 1: the written slot's is 0; 0: no scores); with ``write`` the token stored in the stream's
    next float slot, after the read (never read back rounded), with its position when ``write_pos``."""
    rows, d = q.shape[1], q.shape[2]
    fbs = float_k.shape[1]
    scale = np.empty((rows, parts), dtype=np.float32)  # exp(m_part - M) / L per row and part
    new_p = np.empty(rows, dtype=np.float32)
    for r in range(rows):
        logit = dot(q[s, r], new_k[s])
        if softcap > 0.0:
            logit = np.float32(softcap * np.tanh(logit / softcap))
        m = logit
        for part in range(parts):
            m = max(m, part_max[s, part, r])
        if has_sink:
            m = max(m, np.float32(sink_logits[s, r]))
        total = np.exp(logit - m)
        for part in range(parts):
            scale[r, part] = np.exp(part_max[s, part, r] - m) if part_sum[s, part, r] > 0.0 else np.float32(0.0)
            total += part_sum[s, part, r] * scale[r, part]
        if has_sink:
            total += np.exp(np.float32(sink_logits[s, r]) - m)
        inv = np.float32(1.0) / total
        new_p[r] = np.exp(logit - m) * inv
        acc_r = out[s, r]
        for c in range(d):
            acc_r[c] = new_p[r] * new_v[s, c]
        for part in range(parts):
            scale[r, part] *= inv
            axpy(acc_r, scale[r, part], part_acc[s, part, r])
    if score_mode == 2:  # the attention each held token received: its weight times its part's scale, over the rows
        n_blocks = body_len[s]
        n_body = n_blocks * bs
        n_float = float_len[s]
        scores = weights[s]
        for part in range(parts):
            u0, u1 = part_units(s, part, parts, float_len, body_len, fbs)
            for j in range(u0, min(u1, n_blocks)):
                block = body_table[s, j]
                for t in range(bs):
                    total_p = np.float32(0.0)
                    for r in range(rows):
                        total_p += scores[r, j * bs + t] * scale[r, part]
                    body_score[block, t] += total_p
            for fb in range(max(u0, n_blocks) - n_blocks, u1 - n_blocks):
                block = float_table[s, fb]
                base = n_body + fb * fbs
                for t in range(min(fbs, n_float - fb * fbs)):
                    total_p = np.float32(0.0)
                    for r in range(rows):
                        total_p += scores[r, base + t] * scale[r, part]
                    float_score[block, t] += total_p
        total_p = np.float32(0.0)
        for r in range(rows):
            total_p += new_p[r]
        new_score[s] = total_p
    if write:  # this step's token into the stream's next float slot (after the held tokens: not read above)
        n_float = float_len[s]
        block, offset = float_table[s, n_float // fbs], n_float % fbs
        for c in range(d):
            float_k[block, offset, c] = new_bits[0, s, c]
            float_v[block, offset, c] = new_bits[1, s, c]
        if write_pos:
            float_pos[block, offset] = new_pos[s]
        if score_mode > 0:
            float_score[block, offset] = new_score[s] if score_mode == 2 else np.float32(0.0)


@njit(cache=True)
def part_scratch(q, float_len, body_len, bs, parts):
    """The items' outputs: weights (S, R, tokens of the widest stream), softmax maxima and sums (S, parts, R) and
    weighted values (S, parts, R, D), float32."""
    streams, rows = q.shape[0], q.shape[1]
    widest = np.max(float_len + body_len * bs) if streams else 0
    weights = np.empty((streams, rows, max(widest, 1)), dtype=np.float32)
    part_max = np.empty((streams, parts, rows), dtype=np.float32)
    part_sum = np.empty((streams, parts, rows), dtype=np.float32)
    part_acc = np.empty((streams, parts, rows, q.shape[2]), dtype=np.float32)
    return weights, part_max, part_sum, part_acc


@njit(cache=True, fastmath=FAST)
def combine_streams(
    q, new_k, new_v, float_k, float_v, float_table, float_len, body_table, body_len, bs, softcap, sink_logits, has_sink,
    new_bits, write, float_score, body_score, new_score, score_mode, float_pos, new_pos, write_pos, parts, weights,
    part_max, part_sum, part_acc, out,
):
    """`combine` for every stream, on this thread."""
    # the caller owns every array for the whole call: no reference counts (`borrowed`)
    (
        q, new_k, new_v, float_k, float_v, float_table, float_len, body_table, body_len, bs, softcap, sink_logits,
        has_sink, new_bits, write, float_score, body_score, new_score, score_mode, float_pos, new_pos, write_pos, parts,
        weights, part_max, part_sum, part_acc, out,
    ) = borrowed((
        q, new_k, new_v, float_k, float_v, float_table, float_len, body_table, body_len, bs, softcap, sink_logits,
        has_sink, new_bits, write, float_score, body_score, new_score, score_mode, float_pos, new_pos, write_pos, parts,
        weights, part_max, part_sum, part_acc, out,
    ))
    for s in range(q.shape[0]):
        combine(
            s, q, new_k, new_v, float_k, float_v, float_table, float_len, body_table, body_len, bs, softcap, sink_logits,
            has_sink, new_bits, write, float_score, body_score, new_score, score_mode, float_pos, new_pos, write_pos,
            parts, weights, part_max, part_sum, part_acc, out,
        )


def items_on_team_thread(payload, thread, size):
    """What each thread of an OpenMP team runs (`team_launch`): ``payload`` = (ranges (N, 2) int64 item ranges
    [first, last), the parts per stream, then `attend_part`'s arguments after (stream, part)); thread ``thread`` of ``size`` takes every
    size-th range from its number."""
    ranges, parts = payload[0], payload[1]
    for i in range(thread, ranges.shape[0], size):
        for item in range(ranges[i, 0], ranges[i, 1]):
            attend_part(item // parts, item % parts, *payload[2:])


_items_on_team = team_runner(items_on_team_thread)


@njit(cache=True, nogil=True, fastmath=FAST)
def decode_step(
    q, new_k, new_v, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head,
    k_side, v_side, rope,
    window, bs, float_kind, softcap, sink_logits, has_sink, new_bits, write, float_score, body_score, new_score, score_mode,
    float_pos, new_pos, write_pos, parts, out, weights, part_max, part_sum, part_acc, team, threads, ranges,
):
    """One decode step of a layer: every (stream, part) item, then every stream's `combine` (the scratch ``weights``
    ... ``part_acc`` from `part_scratch`). The items run on this thread, or with ``team`` (the addresses of
    ``GOMP_parallel``, ``omp_get_thread_num`` and ``omp_get_num_threads``, `openmp_team`; zeros: none) on a team of
    ``threads`` OpenMP threads, this one among them, each taking item ranges of ``ranges`` (N, 2) [first, last)."""
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
        _items_on_team(team[0], team[1], team[2], threads, (
            ranges, parts, q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head,
            k_side, v_side, rope, window, bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
        ))
    else:
        for item in range(q.shape[0] * parts):
            attend_part(
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
def attend_items(
    first, last, q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head,
    k_side, v_side, rope, window, bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
):
    """The (stream, part) items [first, last) of a decode step (`attend_part` each), without the GIL: each thread of
    a step spread over Python threads runs a range of them (a torch without OpenMP, ``parallel=True``), then
    `combine_streams` merges them on one. (Numba's ``prange`` did the same, at about a minute of compilation per
    signature.)"""
    # the caller owns every array for the whole call: no reference counts (`borrowed`)
    (
        q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head, k_side,
        v_side, rope, window, bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
    ) = borrowed((
        q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table, body_len, stream_head, k_side,
        v_side, rope, window, bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
    ))
    for item in range(first, last):
        attend_part(
            item // parts, item % parts, q, float_k, float_v, float_ks, float_vs, float_table, float_len, body_table,
            body_len, stream_head,
            k_side, v_side, rope, window, bs, float_kind, softcap, parts, weights, part_max, part_sum, part_acc,
        )


@njit(cache=True, inline="always")
def half_bits_of_scale(s):
    """float32 s in [0, 65504] -> its float16 bits (uint16), rounded to nearest even, as torch's and numpy's casts."""
    if s < np.float32(6.103515625e-05):  # under 2^-14: a float16 subnormal, a multiple of 2^-24 (1024 of them: 2^-14)
        return np.uint16(np.rint(s * np.float32(16777216.0)))
    u = np.float32(s).view(np.uint32)
    u = u + np.uint32(0x0FFF) + ((u >> np.uint32(13)) & np.uint32(1))  # round the 23-bit mantissa to 10, ties to even
    exponent = ((u >> np.uint32(23)) - np.uint32(112)) << np.uint32(10)  # rebias 127 -> 15
    return np.uint16(exponent | ((u >> np.uint32(13)) & np.uint32(0x3FF)))


@njit(cache=True)
def encode_int8_rows(x, group, codes, scale_bits, held):
    """`store.encode_int8_slots` of rows x (N, D) float32 into codes (N, D) int8, scale_bits (N, D / group) uint16 (the
    float16 scales' bits) and held (N, D) float32 (code x scale), bit for bit as the torch version: the scale = the
    group's largest magnitude / 127 (float32 division), at most float16's largest, rounded to float16; the code = x /
    scale rounded half to even, clamped to +-127 (0 where the scale is 0)."""
    n, d = x.shape
    for i in range(n):
        for j in range(d // group):
            base = j * group
            amax = np.float32(0.0)
            for c in range(group):
                amax = max(amax, abs(x[i, base + c]))
            bits = half_bits_of_scale(min(amax / np.float32(127.0), np.float32(65504.0)))
            scale_bits[i, j] = bits
            scale = half_to_float(bits)
            for c in range(group):
                q = np.float32(0.0)
                if scale > 0:
                    q = min(max(np.rint(x[i, base + c] / scale), np.float32(-127.0)), np.float32(127.0))
                codes[i, base + c] = np.int8(q)
                held[i, base + c] = q * scale


@njit(cache=True)
def dequantize_latent_blocks(codes, widths, scale_bits, zero_bits, group, out, first, last):
    """Blocks [first, last) of `dequantize_latents`."""
    length = out.shape[2]
    for b in range(first, last):
        buf = out[b]
        unpack_block(codes, b, widths, buf)
        for t in range(buf.shape[0]):
            for j in range(scale_bits.shape[2]):
                scale, zero = half_to_float(scale_bits[b, t, j]), half_to_float(zero_bits[b, t, j])
                part = buf[t, j * group: min(length, (j + 1) * group)]
                for c in range(part.shape[0]):
                    part[c] = part[c] * scale + zero


def latent_blocks_on_team_thread(payload, thread, size):
    """What each thread of an OpenMP team runs (`team_launch`): a contiguous share of the blocks of ``payload`` =
    (`dequantize_latent_blocks`' arrays and group)."""
    total = payload[5].shape[0]
    dequantize_latent_blocks(*payload, total * thread // size, total * (thread + 1) // size)


_latent_blocks_on_team = team_runner(latent_blocks_on_team_thread)


@njit(cache=True, nogil=True)
def dequantize_latents(codes, widths, scale_bits, zero_bits, group, out, team, threads):
    """Palu's quantized latents on the host (`PaluQuantizer.decode_latent` before its Hadamard step): out (N, S, L)
    float32 <- the integer codes of blocks codes (N, S * bits / 8, L) uint8 (bit-sliced, token-split) x scale + zero,
    one float16 scale and zero (their bits, (N, S, ceil(L / group)) uint16) per token and group of ``group``
    coordinates (a last partial group allowed). A product, then a sum, each rounded to float32 (no fused
    multiply-add): the torch version's bits. On this thread, or with ``team`` (`openmp_team`'s addresses; zeros: none)
    its blocks shared out over ``threads`` OpenMP threads, as `decode_step`'s items."""
    if team[0] != 0:
        _latent_blocks_on_team(team[0], team[1], team[2], threads, (codes, widths, scale_bits, zero_bits, group, out))
    else:
        dequantize_latent_blocks(codes, widths, scale_bits, zero_bits, group, out, 0, out.shape[0])
