"""Triton append/encode kernel: full float blocks of one side (keys or values) -> body blocks, in place.

When the float window of a stream holds ``recent_tokens + block_size`` non-sink tokens, its
oldest block is encoded (`LayerStore._flush`). This kernel does that encoding for N blocks at
once, one program per block, and writes the codes and parameters straight into the body pool
rows ``rows`` (N,) the store allocated for them:

    x (N, BS, D) float  ->  codes (cap, BS * bits / 8, D) uint8 + scale, zero (cap, ...) fp16   (uniform)
                        ->  codes (cap, BS, D) uint8 fp8 bit patterns + scale (cap, 1) float32  (fp8)

Formats (`BodyFormat`, given by a quantizer's ``kernel_encode_format``):

* **uniform** (KIVI, `kvtool.methods.quant.uniform`): min / max per channel over the block's
  tokens (``scales == "channel"``: scale, zero (D,)) or per token and group of channels
  (``"token"``: (BS, D / group)); ``zero = fp16(clamp(min))``, ``scale = fp16(clamp((max -
  zero) / levels, 1e-6, 65504))``, ``code = clamp(round_half_even((x - zero) / scale), 0,
  levels)`` with float32 arithmetic (IEEE division), packed bit-sliced and token-split
  (`kvtool.methods.quant.packing`) for 2/3/4/8 bits (the bits a recipe allows);
* **fp8** (`kvtool.methods.quant.fp8`): e4m3 / e5m2 bytes of ``clamp(x / scale, +-max)``,
  rounded to nearest even from float32 bits (no fp8 dtype needed, so the interpreter and any
  GPU run it); ``scale = max(amax(|x|) / max, 1e-12)`` per block (``"block"``, stored) or a
  calibrated per-layer / per-KV-head scale (``"static"``, read at each block's KV head).

The torch reference is the quantizer's own ``encode_blocks``; tests/test_kernels.py checks
that the bytes are identical (random data, constant channels, outliers beyond fp16, zeros,
exact rounding ties, fp8 subnormals).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.runtime.kernels.body_format import FP8_LAYOUTS, BodyFormat

FP16_MAX = 65504.0
MIN_UNIFORM_SCALE = 1e-6  # `uniform.UniformQuantizer.encode_blocks`
MIN_FP8_SCALE = 1e-12  # `fp8._MIN_SCALE`


@triton.jit
def _round_half_even(x):
    """torch.round of float32 x (ties to even); exact for |x| < 2**22 (callers clamp first)."""
    r = tl.floor(x)
    frac = x - r
    odd = (r.to(tl.int32) & 1) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return r + up.to(tl.float32)


@triton.jit
def _uniform_params(lo, hi, LEVELS: tl.constexpr):
    """Group min / max (float32) -> (zero, scale) as float32 values of their fp16 storage."""
    zero = tl.minimum(tl.maximum(lo, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
    hi = tl.minimum(tl.maximum(hi, -65504.0), 65504.0)
    scale = tl.math.div_rn(hi - zero, tl.full(hi.shape, LEVELS, tl.float32))
    scale = tl.minimum(tl.maximum(scale, 1e-6), 65504.0).to(tl.float16).to(tl.float32)
    return zero, scale


@triton.jit
def _uniform_codes(x, zero, scale, LEVELS: tl.constexpr):
    """Integer codes int32 in [0, LEVELS] of x against the fp16-rounded zero and scale (broadcast)."""
    q = tl.math.div_rn(x - zero, scale)
    q = tl.minimum(tl.maximum(q, -1.0), LEVELS + 1.0)  # same codes after the final clamp; rounding stays exact
    return tl.minimum(tl.maximum(_round_half_even(q), 0.0), LEVELS * 1.0).to(tl.int32)


@triton.jit
def _pack_slice(x_ptr, codes_ptr, scale_ptr, zero_ptr, n, dst, ch, cmask, zero_c, scale_c,
                D: tl.constexpr, BS: tl.constexpr, NG: tl.constexpr, BNG: tl.constexpr, BG: tl.constexpr, ROWS: tl.constexpr, LEVELS: tl.constexpr,
                PER_CHANNEL: tl.constexpr, W: tl.constexpr, LOW: tl.constexpr, ROW: tl.constexpr, STORE_PARAMS: tl.constexpr):
    """One slice of width W (bits LOW .. LOW + W) of a block: byte [j, c] = OR_i bits(code[j + i * BS / K, c]) << i * W.

    ch (BNG, BG) channel index and cmask its validity; zero_c, scale_c (BNG, BG) per-channel
    parameters (PER_CHANNEL) or unused; per-token parameters are computed here from the rows
    read (and stored once, STORE_PARAMS). Writes ROWS x D bytes at row ROW of the block.
    """
    K: tl.constexpr = 8 // W
    R: tl.constexpr = BS // K  # byte rows of this slice
    j = tl.arange(0, R)
    packed = tl.zeros((R, BNG, BG), tl.int32)  # (R, BNG, BG)
    mask = (j[:, None, None] < R) & cmask[None, :, :]
    for i in tl.static_range(K):
        t = i * R + j  # (R,) tokens of sub-row i
        x = tl.load(x_ptr + n * BS * D + t[:, None, None] * D + ch[None, :, :], mask=mask, other=0.0).to(tl.float32)
        if PER_CHANNEL:
            code = _uniform_codes(x, zero_c[None, :, :], scale_c[None, :, :], LEVELS)
        else:  # per token and group of channels: reduce over the group (last axis)
            lo = tl.min(tl.where(mask, x, float("inf")), axis=2)  # (R, BNG)
            hi = tl.max(tl.where(mask, x, float("-inf")), axis=2)
            zero, scale = _uniform_params(lo, hi, LEVELS)
            code = _uniform_codes(x, zero[:, :, None], scale[:, :, None], LEVELS)
            if STORE_PARAMS:
                g = tl.arange(0, BNG)
                offs = dst * BS * NG + t[:, None] * NG + g[None, :]
                gmask = (t[:, None] < BS) & (g[None, :] < NG)
                tl.store(scale_ptr + offs, scale.to(tl.float16), mask=gmask)
                tl.store(zero_ptr + offs, zero.to(tl.float16), mask=gmask)
        packed = packed | (((code >> LOW) & ((1 << W) - 1)) << (i * W))
    base = codes_ptr + dst * ROWS * D + (ROW + j[:, None, None]) * D + ch[None, :, :]
    tl.store(base, packed.to(tl.uint8), mask=mask)


@triton.jit
def _encode_uniform(x_ptr, rows_ptr, codes_ptr, scale_ptr, zero_ptr,
                    D: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, BG: tl.constexpr,
                    BNG: tl.constexpr, BITS: tl.constexpr, LEVELS: tl.constexpr, PER_CHANNEL: tl.constexpr,
                    W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr):
    """Program n: block x[n] (BS, D) -> pool row rows[n]. Channels as (BNG, BG): c = g * G + e (G = D per channel)."""
    n = tl.program_id(0).to(tl.int64)  # block offsets can pass 2**31 bytes
    dst = tl.load(rows_ptr + n).to(tl.int64)
    g = tl.arange(0, BNG)
    e = tl.arange(0, BG)
    ch = g[:, None] * G + e[None, :]  # (BNG, BG)
    cmask = (g[:, None] < NG) & (e[None, :] < G)
    zero_c = tl.zeros((BNG, BG), tl.float32)
    scale_c = tl.zeros((BNG, BG), tl.float32)
    if PER_CHANNEL:  # one zero and scale per channel over the block's tokens
        t = tl.arange(0, BS)
        mask = (t[:, None, None] < BS) & cmask[None, :, :]
        x = tl.load(x_ptr + n * BS * D + t[:, None, None] * D + ch[None, :, :], mask=mask, other=0.0).to(tl.float32)
        lo = tl.min(tl.where(mask, x, float("inf")), axis=0)  # (BNG, BG)
        hi = tl.max(tl.where(mask, x, float("-inf")), axis=0)
        zero_c, scale_c = _uniform_params(lo, hi, LEVELS)
        tl.store(scale_ptr + dst * D + ch, scale_c.to(tl.float16), mask=cmask)
        tl.store(zero_ptr + dst * D + ch, zero_c.to(tl.float16), mask=cmask)
    ROWS: tl.constexpr = BS * BITS // 8
    _pack_slice(x_ptr, codes_ptr, scale_ptr, zero_ptr, n, dst, ch, cmask, zero_c, scale_c,
                D, BS, NG, BNG, BG, ROWS, LEVELS, PER_CHANNEL, W0, 0, 0, True)
    if W1 > 0:
        R0: tl.constexpr = BS * W0 // 8
        _pack_slice(x_ptr, codes_ptr, scale_ptr, zero_ptr, n, dst, ch, cmask, zero_c, scale_c,
                    D, BS, NG, BNG, BG, ROWS, LEVELS, PER_CHANNEL, W1, W0, R0, False)
        if W2 > 0:
            R1: tl.constexpr = BS * W1 // 8
            _pack_slice(x_ptr, codes_ptr, scale_ptr, zero_ptr, n, dst, ch, cmask, zero_c, scale_c,
                        D, BS, NG, BNG, BG, ROWS, LEVELS, PER_CHANNEL, W2, W0 + W1, R0 + R1, False)


@triton.jit
def _fp8_bits(y, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """float32 y (|y| <= the format's max) -> fp8 bit patterns int32, round to nearest even, as torch's cast.

    Normal range: the float32 bits rounded to MANTISSA mantissa bits (a carry moves into the
    exponent); below 2**(1 - BIAS): the multiple of the subnormal unit, whose integer is the byte
    (rounding up to the smallest normal gives its byte too).
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    magnitude = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MANTISSA
    normal = (magnitude + ((1 << (SHIFT - 1)) - 1) + ((magnitude >> SHIFT) & 1)) >> SHIFT
    normal = normal - ((127 - BIAS) << MANTISSA)
    a = magnitude.to(tl.float32, bitcast=True)
    smallest_normal = tl.full((), (128 - BIAS) << 23, tl.int32).to(tl.float32, bitcast=True)  # 2**(1 - bias)
    per_unit = tl.full((), (126 + BIAS + MANTISSA) << 23, tl.int32).to(tl.float32, bitcast=True)  # 2**(bias + m - 1)
    subnormal = _round_half_even(tl.minimum(a * per_unit, (1 << MANTISSA) + 1.0)).to(tl.int32)  # bounded: no int overflow
    return tl.where(a < smallest_normal, subnormal, normal) | (sign << 7)


@triton.jit
def _encode_fp8(x_ptr, rows_ptr, group_ptr, codes_ptr, scale_ptr, table_ptr, srow, fp8_max,
                D: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
                STATIC: tl.constexpr):
    """Program n: block x[n] (BS, D) -> fp8 bytes at pool row rows[n] (+ its float32 scale unless STATIC)."""
    n = tl.program_id(0).to(tl.int64)  # block offsets can pass 2**31 bytes
    dst = tl.load(rows_ptr + n).to(tl.int64)
    t = tl.arange(0, BS)
    c = tl.arange(0, BD)
    mask = (t[:, None] < BS) & (c[None, :] < D)
    x = tl.load(x_ptr + n * BS * D + t[:, None] * D + c[None, :], mask=mask, other=0.0).to(tl.float32)  # (BS, BD)
    if STATIC:  # calibrated: the block's KV head row of the (1 | H_kv, 1) table
        head = tl.load(group_ptr + n).to(tl.int64)
        scale = tl.load(table_ptr + head * srow)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        scale = tl.maximum(tl.math.div_rn(amax, fp8_max), 1e-12)
        tl.store(scale_ptr + dst, scale)
    y = tl.math.div_rn(x, tl.zeros_like(x) + scale)
    y = tl.minimum(tl.maximum(y, -fp8_max), fp8_max)
    byte = _fp8_bits(y, MANTISSA, BIAS)
    tl.store(codes_ptr + dst * BS * D + t[:, None] * D + c[None, :], byte.to(tl.uint8), mask=mask)


def _outputs(fmt: BodyFormat, n: int, bs: int, d: int, device) -> dict[str, torch.Tensor]:
    """Freshly allocated {name: (N, ...)} storage of N blocks (what ``encode_blocks`` returns)."""
    if fmt.fp8:
        out = {"codes": torch.empty((n, bs, d), dtype=torch.uint8, device=device)}
        if fmt.scales == "block":
            out["scale"] = torch.empty((n, 1), dtype=torch.float32, device=device)
        return out
    params = (n, d) if fmt.scales == "channel" else (n, bs, d // fmt.group)
    return {
        "codes": torch.empty((n, bs * fmt.bits // 8, d), dtype=torch.uint8, device=device),
        "scale": torch.empty(params, dtype=torch.float16, device=device),
        "zero": torch.empty(params, dtype=torch.float16, device=device),
    }


def encodes(fmt: BodyFormat | None) -> bool:
    """True when `encode_body_blocks` writes blocks of this format (uniform channel/token, fp8 block/static)."""
    if fmt is None:
        return False
    if fmt.fp8:
        return fmt.scales in ("block", "static")
    return fmt.bits <= 8 and fmt.levels == 0 and not fmt.outliers and fmt.zero and fmt.scales in ("channel", "token")


def encode_body_blocks(
    x: torch.Tensor,  # (N, BS, D) float keys or values of one side, N full blocks
    fmt: BodyFormat,
    out: dict[str, torch.Tensor] | None = None,  # pool tensors {name: (cap, ...)} of this side; None: allocate (N, ...)
    rows: torch.Tensor | None = None,  # (N,) int64 pool rows to write; default 0 .. N-1
    group: torch.Tensor | None = None,  # (N,) int64 KV head of each block (fp8 static tables)
    static_scale: torch.Tensor | None = None,  # (1 | H_kv, 1) float32 (fp8 static)
) -> dict[str, torch.Tensor]:
    """Encode N blocks as the quantizer's ``encode_blocks`` does and write them at ``rows`` of ``out``; returns ``out``."""
    if not encodes(fmt):
        raise ValueError(f"the encode kernel does not write {fmt}")
    n, bs, d = x.shape
    device = x.device
    x = x.contiguous()
    out = _outputs(fmt, n, bs, d, device) if out is None else out
    rows = torch.arange(n, device=device) if rows is None else rows.to(device=device, dtype=torch.int64).contiguous()
    if n == 0:
        return out
    if fmt.fp8:
        mantissa, bias = FP8_LAYOUTS[fmt.fp8]
        static = fmt.scales == "static"
        dummy = torch.zeros(1, device=device)
        table = static_scale.to(device=device, dtype=torch.float32).contiguous() if static else dummy
        heads = group.to(device=device, dtype=torch.int64).contiguous() if static else rows
        fp8_max = float(torch.finfo(torch.float8_e4m3fn if fmt.fp8 == "e4m3" else torch.float8_e5m2).max)
        _encode_fp8[(n,)](
            x, rows, heads, out["codes"], out.get("scale", dummy), table, 1 if static and table.shape[0] > 1 else 0, fp8_max,
            D=d, BS=bs, BD=triton.next_power_of_2(d), MANTISSA=mantissa, BIAS=bias, STATIC=static,
        )
        return out
    per_channel = fmt.scales == "channel"
    group_size = d if per_channel else fmt.group
    w0, w1, w2 = fmt.widths()
    _encode_uniform[(n,)](
        x, rows, out["codes"], out["scale"], out["zero"],
        D=d, BS=bs, G=group_size, NG=d // group_size, BG=triton.next_power_of_2(group_size),
        BNG=triton.next_power_of_2(d // group_size), BITS=fmt.bits, LEVELS=2**fmt.bits - 1, PER_CHANNEL=per_channel,
        W0=w0, W1=w1, W2=w2,
    )
    return out
