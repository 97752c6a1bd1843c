"""Triton functions that read one body block of one side (keys or values) in place, as float32 (BS, BD).

`load_body` follows the steps of `BodyFormat` (codes -> codebook lookup -> scale and zero ->
sparse outliers), each step a constant so that a format compiles to straight-line code. The
torch reference is the quantizer's own ``decode_blocks`` (tests/test_kernels.py compares them).

Pointers of one side (unused ones point at a 1-element dummy):

* ``data``: (cap, BS, D) float blocks (method none);
* ``codes``: (cap, BS * bits / 8, D) uint8 packed codes, or (cap, BS, D) uint8 fp8 bytes;
* ``scale``, ``zero``: per block ((cap, D) / (cap, BS, ceil(D / group)) fp16, (cap, 1) float32,
  (cap, BS) fp16 per-token norms), or static tables (rows 1 | H_kv, columns 1 | D) float32 read
  at ``head * srow + channel * scol``;
* ``lut``: (levels,) float32 codebook; ``oidx``: (cap, K) int16 flat index - 32768 and ``oval``:
  (cap, K) fp16 sparse outliers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.runtime.kernels.body_format import FP8_LAYOUTS

OUTLIER_CHUNK = tl.constexpr(32)  # outliers placed per tl.dot (bounded registers for any outlier count)


@triton.jit
def _packed_codes(base, t, c, mask, D: tl.constexpr, BS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr):
    """Integer codes (BS, BD) int32 of a bit-sliced, token-split block starting at ``base``."""
    K0: tl.constexpr = 8 // W0
    R0: tl.constexpr = BS // K0  # byte rows of the first slice
    b0 = tl.load(base + (t[:, None] % R0) * D + c[None, :], mask=mask, other=0).to(tl.int32)
    code = (b0 >> ((t[:, None] // R0) * W0)) & ((1 << W0) - 1)
    if W1 > 0:
        K1: tl.constexpr = 8 // W1
        R1: tl.constexpr = BS // K1
        b1 = tl.load(base + (R0 + t[:, None] % R1) * D + c[None, :], mask=mask, other=0).to(tl.int32)
        code = code | (((b1 >> ((t[:, None] // R1) * W1)) & ((1 << W1) - 1)) << W0)
        if W2 > 0:
            K2: tl.constexpr = 8 // W2
            R2: tl.constexpr = BS // K2
            b2 = tl.load(base + (R0 + R1 + t[:, None] % R2) * D + c[None, :], mask=mask, other=0).to(tl.int32)
            code = code | (((b2 >> ((t[:, None] // R2) * W2)) & ((1 << W2) - 1)) << (W0 + W1))
    return code


@triton.jit
def _fp8_value(byte, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """fp8 bit patterns (int32 in [0, 256)) -> float32, exactly (e4m3fn: 3, 7; e5m2: 2, 15).

    Built from the bits, so it runs on every GPU and in the interpreter; the saturating
    encoder (`fp8.to_fp8`) never stores NaN or inf.
    """
    exponent = (byte >> MANTISSA) & ((1 << (7 - MANTISSA)) - 1)
    mantissa = byte & ((1 << MANTISSA) - 1)
    normal = (((exponent + (127 - BIAS)) << 23) | (mantissa << (23 - MANTISSA))).to(tl.float32, bitcast=True)
    subnormal_unit = tl.full((), (128 - BIAS - MANTISSA) << 23, tl.int32).to(tl.float32, bitcast=True)  # 2**(1-bias-m)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * subnormal_unit, normal)
    # the sign bit ORed into the float's bits (the magnitude's is 0): with a select of ``-magnitude`` the H100 read
    # some negative zeros back as +0.0 (tests/test_kernels.py's signbit check, 2026-11-27); an OR keeps every sign
    return (magnitude.to(tl.int32, bitcast=True) | ((byte >> 7) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_kernel(byte_ptr, out_ptr, n, MANTISSA: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    byte = tl.load(byte_ptr + i, mask=i < n, other=0).to(tl.int32)
    tl.store(out_ptr + i, _fp8_value(byte, MANTISSA, BIAS), mask=i < n)


def fp8_bytes_to_float(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp8 bytes (N,) uint8 -> float32 (N,) through `_fp8_value` (tests check it against torch's float8 dtypes)."""
    mantissa, bias = FP8_LAYOUTS[fmt]
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    _fp8_kernel[(triton.cdiv(codes.numel(), 256),)](codes.contiguous(), out, codes.numel(), mantissa, bias, 256)
    return out


@triton.jit
def _codebook(code, lut_ptr, LEVELS: tl.constexpr):
    """Codes (BS, BD) -> codebook levels float32: selects in registers up to 16 levels (nuq), else a gather (cached)."""
    if LEVELS > 16:  # TurboQuant's 5/6-bit outlier instances
        return tl.load(lut_ptr + code)
    x = code.to(tl.float32) * 0.0
    for level in tl.static_range(LEVELS):
        x = tl.where(code == level, tl.load(lut_ptr + level), x)
    return x


@triton.jit
def _outliers(x, oidx_ptr, oval_ptr, block, t, c, D: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr):
    """x (BS, BD) with the block's K sparse (index, value) pairs written at their positions.

    Placement is two one-hot products per chunk of outliers, (BS, CHUNK) @ (CHUNK, BD) in fp16 with
    fp32 accumulation: exact, since positions are distinct and fp16 values are exact in fp16.
    """
    j = tl.arange(0, CHUNK)
    for start in range(0, K, CHUNK):
        present = start + j < K
        offs = block * K + start + j
        flat = tl.load(oidx_ptr + offs, mask=present, other=0).to(tl.int32) + 32768  # (CHUNK,) token-major s * D + d
        value = tl.load(oval_ptr + offs, mask=present, other=0.0).to(tl.float16)
        at_token = ((t[:, None] == flat[None, :] // D) & present[None, :]).to(tl.float16)  # (BS, CHUNK)
        at_channel = (flat[:, None] % D == c[None, :]).to(tl.float16)  # (CHUNK, BD)
        placed = tl.dot(at_token, at_channel)  # (BS, BD) 1.0 where an outlier sits
        sparse = tl.dot(at_token * value[None, :], at_channel)
        x = tl.where(placed > 0.5, sparse, x)
    return x


@triton.jit
def token_norms(norm_ptr, block, t, BS: tl.constexpr, SCALES: tl.constexpr):
    """TurboQuant's norms (TT,) float32 of a block's tokens t (0 past BS): SCALES 5, one fp16 per token (cap, BS); 6,
    8-bit codes c (cap, BS + 4) uint8 whose last 4 bytes are the block's log2 range hi, lo (int16, 1/1024 octave):
    2**((hi - c (hi - lo) / 255) / 1024) (`kvtool.methods.quant.turboquant.encode_norms8`)."""
    if SCALES == 5:
        return tl.load(norm_ptr + block * BS + t, mask=t < BS, other=0.0).to(tl.float32)
    row = norm_ptr + block * (BS + 4)
    hi = _int16_at(row + BS)
    lo = _int16_at(row + BS + 2)
    code = tl.load(row + t, mask=t < BS, other=0).to(tl.float32)
    return tl.where(t < BS, tl.exp2((hi - code * ((hi - lo) / 255.0)) * (1.0 / 1024.0)), 0.0)  # 1024: NORM_LEVEL_UNITS


@triton.jit
def _int16_at(ptr):
    """The little-endian int16 at byte ``ptr`` as float32."""
    bits = tl.load(ptr).to(tl.int32) | (tl.load(ptr + 1).to(tl.int32) << 8)
    return tl.where(bits >= 32768, bits - 65536, bits).to(tl.float32)


@triton.jit
def load_body(data_ptr, codes_ptr, scale_ptr, zero_ptr, lut_ptr, oidx_ptr, oval_ptr, srow, scol, block, head, t, c, cmask,
              D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
              FP8_MANTISSA: tl.constexpr, FP8_BIAS: tl.constexpr, SCALES: tl.constexpr, GROUP: tl.constexpr,
              HAS_ZERO: tl.constexpr, LEVELS: tl.constexpr, OUTLIERS: tl.constexpr):
    """One body block of one side as float32 (BS, BD); SCALES: 0 none, 1 channel, 2 token, 3 block, 4 static, 5 norm,
    6 norm8 (`token_norms`).

    D is the width of what the block stores: head_dim, or the latent rank of a low-rank format.
    """
    mask = (t[:, None] < BS) & cmask[None, :]
    if BITS == 16:
        x = tl.load(data_ptr + block * BS * D + t[:, None] * D + c[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        if FP8_MANTISSA > 0:
            byte = tl.load(codes_ptr + block * BS * D + t[:, None] * D + c[None, :], mask=mask, other=0).to(tl.int32)
            x = _fp8_value(byte, FP8_MANTISSA, FP8_BIAS)
        else:
            code = _packed_codes(codes_ptr + block * (BS * BITS // 8) * D, t, c, mask, D, BS, W0, W1, W2)
            if LEVELS > 0:
                x = _codebook(code, lut_ptr, LEVELS)
            else:
                x = code.to(tl.float32)
        if SCALES == 1:  # per block and channel
            x = x * tl.load(scale_ptr + block * D + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
            if HAS_ZERO:
                x = x + tl.load(zero_ptr + block * D + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        elif SCALES == 2:  # per block, token and group of channels
            NG: tl.constexpr = (D + GROUP - 1) // GROUP  # a last partial group (Palu latents)
            if NG <= 16:  # (TT, 16) parameters spread over the channels by a one-hot product: no per-channel gather
                g = tl.arange(0, 16)
                offs = block * BS * NG + t[:, None] * NG + g[None, :]
                pmask = (t[:, None] < BS) & (g[None, :] < NG)
                spread = ((g[:, None] == c[None, :] // GROUP) & cmask[None, :]).to(tl.float16)  # (16, BD)
                scale = tl.load(scale_ptr + offs, mask=pmask, other=0.0).to(tl.float16)  # fp16 stored: exact
                x = x * tl.dot(scale, spread)  # one nonzero term per output: exact in fp32
                if HAS_ZERO:
                    x = x + tl.dot(tl.load(zero_ptr + offs, mask=pmask, other=0.0).to(tl.float16), spread)
            else:
                offs = block * BS * NG + t[:, None] * NG + c[None, :] // GROUP
                x = x * tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                if HAS_ZERO:
                    x = x + tl.load(zero_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        elif SCALES == 3:  # one float32 per block
            x = x * tl.load(scale_ptr + block).to(tl.float32)
        elif SCALES == 4:  # calibrated: per layer / KV head, optionally per channel
            x = x * tl.load(scale_ptr + head * srow + c * scol, mask=cmask, other=0.0).to(tl.float32)[None, :]
            if HAS_ZERO:
                x = x + tl.load(zero_ptr + head * srow + c * scol, mask=cmask, other=0.0).to(tl.float32)[None, :]
        elif SCALES >= 5:  # TurboQuant's per-token norm
            x = x * token_norms(scale_ptr, block, t, BS, SCALES)[:, None]
        if OUTLIERS > 0:
            x = _outliers(x, oidx_ptr, oval_ptr, block, t, c, D, OUTLIERS, OUTLIER_CHUNK)
    return x


def _lanes(n: int) -> int:
    """Power-of-two register width for n coordinates, at least 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(max(n, 1)))


RESIDENT_BASIS = 8192  # float32 values of a latent basis kept in shared memory across blocks (32 KB, `reconstruct`)
RECON_VALUES = 8192  # float32 basis values per reconstruction chunk where the basis is read per block (32 KB)


def latent_chunk(rank: int, head_dim: int) -> int:
    """Latent coordinates reconstructed per product (`body_lowrank.reconstruct`): the whole width BL where its basis
    (BL x head_dim float32) fits in RESIDENT_BASIS and stays in shared memory across blocks, else chunks of
    RECON_VALUES values read per block (at least 16 coordinates, tl.dot)."""
    lanes, width = _lanes(rank), triton.next_power_of_2(head_dim)
    if lanes * width <= RESIDENT_BASIS:
        return lanes
    return max(16, min(lanes, RECON_VALUES // width))


SPLIT_VALUES = 16384  # float32 placement values of a TurboQuant split instance per product (64 KB, `body_split`)


def split_chunk(dim: int, head_dim: int) -> int:
    """Rotated coordinates of one TurboQuant split instance per product (`body_split.load_split`): the whole width where
    its placement (width x head_dim float32, rebuilt per block) fits in SPLIT_VALUES, else fewer (at least 16)."""
    lanes, width = _lanes(dim), triton.next_power_of_2(head_dim)
    return lanes if lanes * width <= SPLIT_VALUES else max(16, SPLIT_VALUES // width)


def side_constants(fmt, head_dim: int) -> dict:
    """The decode kernel's constants for one side's `BodyFormat`, without the K_ / V_ prefix: `load_body`'s, the
    latent rank, its width BL and reconstruction chunk BLC, whether the side is rotated, and the outlier split's
    instances (widths BDO, BDR; chunks BDOC, BDRC) and whether its channel masks are per KV head (XSTATIC)."""
    w0, w1, w2 = fmt.widths()
    o0, o1, o2 = fmt.widths(fmt.split_bits)
    mantissa, bias = fmt.fp8_layout()
    return dict(BITS=fmt.bits, W0=w0, W1=w1, W2=w2, FP8_MANTISSA=mantissa, FP8_BIAS=bias, SCALES=fmt.scale_mode(),
                GROUP=fmt.group, HAS_ZERO=fmt.zero, LEVELS=fmt.levels, OUTLIERS=fmt.outliers, RANK=fmt.rank,
                BL=_lanes(fmt.rank), BLC=latent_chunk(fmt.rank, head_dim), ROTATED=fmt.rotated, SPLIT=fmt.split,
                O_BITS=fmt.split_bits, O_W0=o0, O_W1=o1, O_W2=o2, O_LEVELS=2**fmt.split_bits if fmt.split else 0,
                BDO=_lanes(fmt.split),
                BDR=_lanes(head_dim - fmt.split), BDOC=split_chunk(fmt.split, head_dim),
                BDRC=split_chunk(head_dim - fmt.split, head_dim), XSTATIC=fmt.static_mask)

