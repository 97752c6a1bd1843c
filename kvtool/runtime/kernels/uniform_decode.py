"""Decode attention over float and uniform-code blocks, several blocks per tile: the fast path of
`decode_attention.paged_decode_attention` for the formats most recipes store (KIVI-style uniform
2/3/4/8-bit codes with per-channel or per-token-group fp16 scale and zero, float16 blocks).

The general kernel (`decode_attention._decode_partials`) reads every format one block at a time:
each step loads a block id, then that block's bytes, then decodes them through a chain of
constant-folded format steps. For the common formats that walk is latency-bound (one dependent
block-table read per 32 tokens) and decodes each packed byte once per token it holds. This kernel
reads the same paged store, same pointers, same layout, differently:

* **tiles of NB blocks**: a program loads NB block ids at once, then the NB blocks' packed bytes
  as one (NB, R0, D) tile (R0: byte rows of the code's first slice), so the loads of a tile are
  independent and Triton's software pipeline keeps the next tile's bytes in flight; keys and
  values are decoded one after the other (the key tile is dead before the value tile lives);
* **each byte read once**: a byte of a ``w``-bit slice holds ``8 / w`` tokens of one channel
  (the token-split layout of `kvtool.methods.quant.packing`): sub-tile i of the tile takes bits
  ``i*w .. i*w + w - 1`` of the same bytes, i.e. tokens ``i*R0 .. i*R0 + R0 - 1`` of every block;
  3-bit codes' second slice (1 bit, BS / 8 rows) is read per sub-tile;
* **codes to floats without conversion instructions**: on CUDA with float16 products, inline PTX
  turns four packed bytes into four float16 ``1024 + code`` (one prmt and one lop3 per two codes:
  the code ORed into the mantissa of 1024.0); elsewhere ``(code | 0x4B000000)`` read as float32 is
  ``2**23 + code`` exactly (``0x6400`` / 1024 for float16), so one OR and one subtraction replace an
  int->float conversion (a quarter-rate instruction on NVIDIA GPUs);
* **nothing masked**: past a split's range the tile repeats the range's last real block (finite
  values, vectorized unmasked loads) and the logits mask the repeats;
* **parameters broadcast, not gathered**: per-channel scale/zero (NB, D) once per tile, per-token
  group scale/zero (NB, R0, D / group) expanded to the channels by a broadcast and a reshape;
* **contiguous ranges per split**: program (s, p) walks blocks p * per .. (p + 1) * per - 1 of
  stream s (flash-decoding; `decode_attention.merge_partials` reduces the splits with the new token
  and the learned sinks, as for the general kernel);
* **precision**: ``"exact"`` multiplies in three-pass tf32 (float32 accuracy: the torch
  reference's, for float32 models); ``"half"`` multiplies float16 operands with float32
  accumulation, the precision a float16 / bfloat16 model's own attention computes in (the
  runtime picks it from the query's dtype).

Formats read (`covers`): each side float16 blocks (method none) or uniform codes of 2, 3, 4 or 8
bits with per-channel ((D,) per block) or per-token-group ((BS, D / group) per block) fp16 scale
and zero; when both sides are codes their first slices have the same width (2 for 2/3 bits, 4, 8);
power-of-two head_dim and group; keys stored after RoPE. Everything else goes to the general
kernel. Reference: the general kernel and the store's torch path (tests/test_kernels.py compares
all three under ``TRITON_INTERPRET=1`` and on CUDA). Measured on an H100: `benchmarks/RESULTS.md`,
"GPU: the tiled kernel" (4-bit 1.1-1.2x bf16 SDPA, register-bound at 12% occupancy).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvtool.runtime.kernels.body_format import BodyFormat

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # no inline PTX under the interpreter
MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2**23: OR-ing a code < 2**23 into its mantissa gives 2**23 + code
MAGIC_HALF = tl.constexpr(0x6400)  # float16 bits of 1024: OR-ing a code < 1024 into its mantissa gives 1024 + code


@triton.jit
def _codes_as_float(code, HALF: tl.constexpr):
    """int32 codes -> float32 (codes < 2**23) or float16 (HALF, codes < 1024), exactly, with an OR and a subtraction
    instead of an int -> float conversion (a quarter-rate instruction)."""
    if HALF:
        return (code | MAGIC_HALF).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    else:
        return (code | MAGIC).to(tl.float32, bitcast=True) - 8388608.0


def _half_codes_asm(shift: int, mask: int) -> str:
    """PTX: four packed bytes ($2) -> four float16 ``1024 + ((byte >> shift) & mask)`` ($0: bytes 0, 1; $1: 2, 3).

    prmt spreads the bytes into the low byte of each 16-bit half; one shift and one lop3 ((a & b) | c) per pair then
    take the code's bits and OR them into the mantissa of 1024.0 (0x6400): two instructions per two codes, where the
    portable path spends a conversion, shifts, masks and repacking per code."""
    pair = mask | mask << 16
    shifted = [f"shr.b32 t0, t0, {shift};", f"shr.b32 t1, t1, {shift};"] if shift else []
    return " ".join([
        "{ .reg .b32 t0, t1;", "prmt.b32 t0, 0, $2, 0x0504;", "prmt.b32 t1, 0, $2, 0x0706;", *shifted,
        f"lop3.b32 $0, t0, {pair:#x}, 0x64006400, 0xea;", f"lop3.b32 $1, t1, {pair:#x}, 0x64006400, 0xea; }}",
    ])


# the (shift, mask) pairs sub-tiles take: 8-bit codes, 4-bit sub-tiles 0 and 1, 2-bit sub-tiles 0 to 3
ASM_8_0 = tl.constexpr(_half_codes_asm(0, 0xFF))
ASM_4_0 = tl.constexpr(_half_codes_asm(0, 0xF))
ASM_4_4 = tl.constexpr(_half_codes_asm(4, 0xF))
ASM_2_0 = tl.constexpr(_half_codes_asm(0, 0x3))
ASM_2_2 = tl.constexpr(_half_codes_asm(2, 0x3))
ASM_2_4 = tl.constexpr(_half_codes_asm(4, 0x3))
ASM_2_6 = tl.constexpr(_half_codes_asm(6, 0x3))


@triton.jit
def _bytes_as_half(b, W0: tl.constexpr, i: tl.constexpr):
    """uint8 bytes (...) -> float16 codes of sub-tile i (bits i*W0 .. i*W0 + W0 - 1), exactly, by inline PTX on
    four bytes at a time (CUDA only: the interpreter takes `_side_codes`)."""
    if W0 == 8:
        asm: tl.constexpr = ASM_8_0
    elif W0 == 4:
        if i == 0:
            asm: tl.constexpr = ASM_4_0
        else:
            asm: tl.constexpr = ASM_4_4
    else:
        if i == 0:
            asm: tl.constexpr = ASM_2_0
        elif i == 1:
            asm: tl.constexpr = ASM_2_2
        elif i == 2:
            asm: tl.constexpr = ASM_2_4
        else:
            asm: tl.constexpr = ASM_2_6
    x = tl.inline_asm_elementwise(asm, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
    return x - 1024.0


@triton.jit
def _side_codes(codes_ptr, blocks, i: tl.constexpr, c, TS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr):
    """Codes (NB, TS, D) int32 of tokens i*TS .. i*TS + TS - 1 of NB blocks.

    The first slice's TS byte rows hold ``8 / W0`` sub-tiles of tokens: sub-tile i is bits ``i*W0 ..`` of the same
    bytes (read from DRAM once; the next sub-tile's read hits the cache). 3-bit codes' 1-bit slice (BS / 8 rows):
    token t is bit ``t // R1`` of row ``t % R1``.
    """
    rows = tl.arange(0, TS)
    base = codes_ptr + blocks[:, None, None] * (BS * BITS // 8 * D) + c[None, None, :]
    b0 = tl.load(base + rows[None, :, None] * D).to(tl.int32)
    if W0 == 8:
        code = b0
    else:
        code = (b0 >> (i * W0)) & ((1 << W0) - 1)
    if W1 > 0:
        R1: tl.constexpr = BS * W1 // 8
        t = i * TS + rows
        b1 = tl.load(base + (BS * W0 // 8) * D + (t % R1)[None, :, None] * D)
        code = code | (((b1.to(tl.int32) >> ((t // R1) * W1)[None, :, None]) & ((1 << W1) - 1)) << W0)
    return code


@triton.jit
def _channel_params(scale_ptr, zero_ptr, blocks, c, D: tl.constexpr, SCALES: tl.constexpr):
    """Per-channel scale and zero of NB blocks, (NB, 1, D) fp16, read once per tile (SCALES 1); else placeholders."""
    if SCALES == 1:
        offs = blocks[:, None] * D + c[None, :]
        return tl.load(scale_ptr + offs)[:, None, :], tl.load(zero_ptr + offs)[:, None, :]
    else:
        return tl.zeros((1, 1, D), tl.float16), tl.zeros((1, 1, D), tl.float16)


@triton.jit
def _tile_bytes(codes_ptr, blocks, c, TS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr,
                W1: tl.constexpr, ASM: tl.constexpr):
    """The first slice's bytes of NB blocks, (NB, TS, D) uint8, read once per tile for every sub-tile (ASM, codes of
    one slice); else a placeholder (the sub-tiles read their codes themselves)."""
    if ASM and BITS != 16 and W1 == 0:
        rows = tl.arange(0, TS)
        return tl.load(codes_ptr + blocks[:, None, None] * (BS * BITS // 8 * D) + rows[None, :, None] * D + c[None, None, :])
    else:
        return tl.zeros((1, 1, 1), tl.uint8)


@triton.jit
def _side_tile(data_ptr, scale_ptr, zero_ptr, tile_bytes, ch_scale, ch_zero, blocks, i: tl.constexpr, c, NB: tl.constexpr,
               TS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, W0: tl.constexpr,
               W1: tl.constexpr, SCALES: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr):
    """Tokens i*TS .. i*TS + TS - 1 of NB blocks of one side as (NB * TS, D): float16 (HALF) or float32.

    BITS 16: float16 blocks (cap, BS, D); else codes (`_side_codes`, or on CUDA `_bytes_as_half` of the tile's
    bytes ``tile_bytes``, read once for all its sub-tiles) times their
    per-channel (SCALES 1: ``ch_scale``, ``ch_zero`` (NB, 1, D)) or per-token-group (SCALES 2: (BS, D / GROUP) per
    block, read here) fp16 scale, plus the zero. Every block id is a real block of the stream (the caller repeats
    the last one past the range), so nothing is masked: every value is finite and the logits mask the repeats.
    """
    if BITS == 16:
        t = i * TS + tl.arange(0, TS)
        x = tl.load(data_ptr + blocks[:, None, None] * (BS * D) + t[None, :, None] * D + c[None, None, :])
    else:
        if ASM and W1 == 0:  # CUDA, float16: four codes per pair of instructions, from the tile's bytes
            x = _bytes_as_half(tile_bytes, W0, i)
        else:
            x = _codes_as_float(_side_codes(data_ptr, blocks, i, c, TS, D, BS, BITS, W0, W1), HALF)
        if SCALES == 1:  # per block and channel: (NB, 1, D)
            scale = ch_scale
            zero = ch_zero
        else:  # per token and group of GROUP channels: (NB, TS, NG) expanded over each group's channels
            NG: tl.constexpr = D // GROUP
            t = i * TS + tl.arange(0, TS)
            g = tl.arange(0, NG)
            offs = blocks[:, None, None] * (BS * NG) + t[None, :, None] * NG + g[None, None, :]
            scale = tl.reshape(tl.broadcast_to(tl.load(scale_ptr + offs)[:, :, :, None], (NB, TS, NG, GROUP)), (NB, TS, D))
            zero = tl.reshape(tl.broadcast_to(tl.load(zero_ptr + offs)[:, :, :, None], (NB, TS, NG, GROUP)), (NB, TS, D))
        if HALF:
            x = x * scale + zero  # float16 arithmetic: the product's rounding, the model's own precision
        else:
            x = x * scale.to(tl.float32) + zero.to(tl.float32)
    if HALF:
        x = x.to(tl.float16)
    else:
        x = x.to(tl.float32)
    return tl.reshape(x, (NB * TS, D))


@triton.jit
def _float_tile(ptr, scale_ptr, offs, scale_offs, valid, T: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                FG: tl.constexpr):
    """Float-pool tokens at ``offs`` (NBF, FBS, D), valid (NBF, FBS), as (T, D): the pool's 16-bit dtype (float32,
    float8 and int8 pools as float16) for half products, else float32. FG > 0: int8 codes times their float16 scales
    (one per FG channels of a token, at ``scale_offs`` (NBF, FBS, D)), multiplied in float32."""
    x = tl.load(ptr + offs, mask=valid[:, :, None], other=0.0)
    if FG > 0:
        x = x.to(tl.float32) * tl.load(scale_ptr + scale_offs, mask=valid[:, :, None], other=0.0).to(tl.float32)
    x = tl.reshape(x, (T, D))
    if HALF:
        if x.dtype != tl.float16 and x.dtype != tl.bfloat16:
            x = x.to(tl.float16)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def _scores(q, k, m, valid, HALF: tl.constexpr, SOFTCAP: tl.constexpr, softcap):
    """Online-softmax step for rows q (BR, D) over keys k (T, D), valid (T,): (m_new, rescale (BR,), p (BR, T))."""
    if HALF:
        logits = tl.dot(q.to(k.dtype), tl.trans(k))  # (BR, T) half operands, float32 accumulation
    else:
        logits = tl.dot(q, tl.trans(k), input_precision="tf32x3")
    if SOFTCAP:
        logits = softcap * (2.0 * tl.sigmoid(2.0 * logits / softcap) - 1.0)  # softcap * tanh(x / softcap)
    logits = tl.where(valid[None, :], logits, float("-inf"))
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, tl.exp(m - m_safe), tl.exp(logits - m_safe[:, None])


@triton.jit
def _weighted(p, v, HALF: tl.constexpr):
    """p (BR, T) float32 @ v (T, D): (BR, D) float32."""
    if HALF:
        return tl.dot(p.to(v.dtype), v)
    else:
        return tl.dot(p, v, input_precision="tf32x3")


@triton.jit
def _uniform_partials(
    q_ptr, fk_ptr, fv_ptr, fks_ptr, fvs_ptr, ftable_ptr, ftable_stride, flen_ptr, btable_ptr, btable_stride, blen_ptr,
    kd_ptr, ks_ptr, kz_ptr, vd_ptr, vs_ptr, vz_ptr, m_out, l_out, acc_out, R, softcap, f_per, b_per, SPLITS,
    D: tl.constexpr, BR: tl.constexpr, FBS: tl.constexpr, FG: tl.constexpr, NBF: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr,
    TS: tl.constexpr, HAS_BODY: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr, SOFTCAP: tl.constexpr,
    K_BITS: tl.constexpr, K_W0: tl.constexpr, K_W1: tl.constexpr, K_SCALES: tl.constexpr, K_GROUP: tl.constexpr,
    V_BITS: tl.constexpr, V_W0: tl.constexpr, V_W1: tl.constexpr, V_SCALES: tl.constexpr, V_GROUP: tl.constexpr,
):
    s = tl.program_id(0)
    split = tl.program_id(1)
    r = tl.arange(0, BR)
    c = tl.arange(0, D)
    q = tl.load(q_ptr + s * R * D + r[:, None] * D + c[None, :], mask=(r < R)[:, None], other=0.0)  # (BR, D)
    m = tl.full((BR,), float("-inf"), tl.float32)
    l = tl.zeros((BR,), tl.float32)
    acc = tl.zeros((BR, D), tl.float32)
    # float blocks f_per * split ..: NBF blocks of FBS tokens per step, products in the pool's dtype (HALF)
    flen = tl.load(flen_ptr + s).to(tl.int32)
    f_end = tl.minimum(tl.cdiv(flen, FBS), (split + 1) * f_per)
    nbf = tl.arange(0, NBF)
    tf = tl.arange(0, FBS)
    for start in range(split * f_per, f_end, NBF):
        cols = start + nbf  # (NBF,)
        blocks = tl.load(ftable_ptr + s * ftable_stride + cols, mask=cols < f_end, other=0).to(tl.int64)
        valid = (cols[:, None] * FBS + tf[None, :]) < flen  # (NBF, FBS)
        offs = blocks[:, None, None] * (FBS * D) + tf[None, :, None] * D + c[None, None, :]
        scale_offs = offs  # int8 slots (FG > 0): each channel's scale, FG channels per scale
        if FG > 0:
            scale_offs = blocks[:, None, None] * (FBS * (D // FG)) + tf[None, :, None] * (D // FG) + (c // FG)[None, None, :]
        k = _float_tile(fk_ptr, fks_ptr, offs, scale_offs, valid, NBF * FBS, D, HALF, FG)
        m_new, alpha, p = _scores(q, k, m, tl.reshape(valid, (NBF * FBS,)), HALF, SOFTCAP, softcap)
        v = _float_tile(fv_ptr, fvs_ptr, offs, scale_offs, valid, NBF * FBS, D, HALF, FG)
        acc = acc * alpha[:, None] + _weighted(p, v, HALF)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    if HAS_BODY:
        blen = tl.load(blen_ptr + s).to(tl.int32)
        b_end = tl.minimum(blen, (split + 1) * b_per)
        nb = tl.arange(0, NB)
        for start in range(split * b_per, b_end, NB):
            cols = start + nb  # (NB,)
            valid = cols < b_end
            # past the range: the range's last block again (a real block: finite values, unmasked loads), masked below
            blocks = tl.load(btable_ptr + s * btable_stride + tl.minimum(cols, b_end - 1)).to(tl.int64)
            token_valid = tl.reshape(tl.broadcast_to(valid[:, None], (NB, TS)), (NB * TS,))
            k_scale, k_zero = _channel_params(ks_ptr, kz_ptr, blocks, c, D, K_SCALES)  # (NB, 1, D)
            v_scale, v_zero = _channel_params(vs_ptr, vz_ptr, blocks, c, D, V_SCALES)
            k_bytes = _tile_bytes(kd_ptr, blocks, c, TS, D, BS, K_BITS, K_W1, ASM)  # (NB, TS, D) uint8
            v_bytes = _tile_bytes(vd_ptr, blocks, c, TS, D, BS, V_BITS, V_W1, ASM)
            for i in tl.static_range(BS // TS):  # sub-tile i: tokens i*TS .. of every block (bits i*W0 .. of the bytes)
                k = _side_tile(kd_ptr, ks_ptr, kz_ptr, k_bytes, k_scale, k_zero, blocks, i, c, NB, TS, D, BS, K_BITS, K_W0, K_W1,
                               K_SCALES, K_GROUP, HALF, ASM)  # (NB * TS, D)
                m_new, alpha, p = _scores(q, k, m, token_valid, HALF, SOFTCAP, softcap)
                v = _side_tile(vd_ptr, vs_ptr, vz_ptr, v_bytes, v_scale, v_zero, blocks, i, c, NB, TS, D, BS, V_BITS, V_W0, V_W1,
                               V_SCALES, V_GROUP, HALF, ASM)
                acc = acc * alpha[:, None] + _weighted(p, v, HALF)
                l = l * alpha + tl.sum(p, axis=1)
                m = m_new
    out = (s * SPLITS + split) * BR
    tl.store(m_out + out + r, m)
    tl.store(l_out + out + r, l)
    tl.store(acc_out + out * D + r[:, None] * D + c[None, :], acc)


def _reads(fmt: BodyFormat) -> bool:
    """This kernel reads ``fmt``: float16 blocks, or uniform codes of at most two slices with fp16 scale and zero
    per channel or per token group."""
    if fmt.bits == 16:
        return fmt.scales == "none" and not fmt.rank and not fmt.rotated and not fmt.split
    return fmt.uniform and fmt.widths()[2] == 0


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.lru_cache(maxsize=256)
def covers(formats: tuple[BodyFormat, BodyFormat] | None, head_dim: int, block_size: int) -> bool:
    """Whether `uniform_decode_attention` reads this store (formats None: float blocks only; cached: asked at every
    decode step)."""
    if not _pow2(head_dim) or head_dim < 16:
        return False
    if formats is None:
        return True
    if not all(_reads(fmt) for fmt in formats):
        return False
    for fmt in formats:
        if fmt.bits != 16 and fmt.scales == "token" and not (_pow2(fmt.group) and fmt.group <= head_dim):
            return False
    first = {fmt.widths()[0] for fmt in formats if fmt.bits != 16}
    return len(first) <= 1 and _pow2(block_size) and block_size >= 8


def _sub_tile(formats, block_size: int, tile_tokens: int) -> int:
    """Tokens of each block per sub-tile: the byte rows of the codes' first slice (each byte read once), or for
    float-only bodies up to ``tile_tokens``."""
    widths = {fmt.widths()[0] for fmt in formats if fmt.bits != 16}
    if widths:
        return block_size * widths.pop() // 8
    return min(block_size, tile_tokens)


def _constants(fmt: BodyFormat) -> dict:
    w0, w1, _ = fmt.widths()
    return dict(BITS=fmt.bits, W0=w0, W1=w1, SCALES=1 if fmt.scales == "channel" else 2 if fmt.scales == "token" else 0,
                GROUP=fmt.group if fmt.scales == "token" else 1)


def tile_for(head_dim: int, codes: bool) -> tuple[int, int]:
    """(tokens per product, warps per program): 4096 values per tile at 2 warps for code blocks, 8192 at 4 warps for
    float blocks; 16 to 128 tokens. Measured on an H100 (`benchmarks.gpu_attention --sweep`, Llama-3-8B heads at
    32K x 8): 4-bit 323 us at 32 tokens x 2 warps against 338 at 64 x 4 and 485 at 16 x 2; 2-bit 268 against 305
    and 446; float16 blocks 392-407 us for 16-64 tokens at 2 or 4 warps."""
    if codes:
        return max(16, min(128, 4096 // head_dim)), 2
    return max(16, min(128, 8192 // head_dim)), 4


CODE_STAGES = 2  # software-pipeline depth for code blocks: 2 beat 3 in every 4- and 2-bit row of the H100 sweep


@dataclass(frozen=True)
class TilePlan:
    """How `_uniform_partials` is compiled and launched for one store shape: its constants, the float and body
    blocks per tile (NBF, NB), warps and pipeline stages. Computed once per shape (`plan_tiles` is cached), so a
    decode step spends no Python on it; `benchmarks.kernel_resources` compiles the same plans without a GPU."""

    constants: tuple[tuple[str, object], ...]
    nbf: int
    nb: int
    num_warps: int
    num_stages: int | None

    @functools.cached_property
    def kwargs(self) -> dict:
        """The launch's keyword arguments (constants, warps, stages), built once per plan."""
        stages = {} if self.num_stages is None else {"num_stages": self.num_stages}
        return {**dict(self.constants), "num_warps": self.num_warps, **stages}

    @functools.cached_property
    def br(self) -> int:
        """Query rows per program (the ``BR`` constant)."""
        return dict(self.constants)["BR"]


@functools.lru_cache(maxsize=256)
def plan_tiles(formats: tuple[BodyFormat, BodyFormat] | None, head_dim: int, block_size: int, rows: int, float_block: int,
               precision: str = "exact", on_cuda: bool = False, softcap: bool = False, tile_tokens: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None) -> TilePlan:
    """The `TilePlan` of a store: ``formats`` None for float blocks only; ``rows`` query rows per stream (the GQA
    group); ``on_cuda`` enables the inline-PTX code path (float16 products on a GPU)."""
    if precision not in ("exact", "half"):
        raise ValueError(f"uniform_decode_attention: precision '{precision}' is not 'exact' or 'half'")
    if not covers(formats, head_dim, block_size if formats else 16):
        raise ValueError(f"uniform_decode_attention: formats {formats} at head_dim {head_dim} are the general kernel's")
    from kvtool.runtime.kernels.decode_attention import query_rows

    codes = formats is not None and any(fmt.bits != 16 for fmt in formats)
    tile_tokens = tile_tokens or tile_for(head_dim, codes)[0]
    num_warps = num_warps or tile_for(head_dim, codes)[1]
    if num_stages is None and codes:
        num_stages = CODE_STAGES
    if formats is not None:
        kf, vf = formats
        ts = _sub_tile(formats, block_size, tile_tokens)
        nb = max(triton.cdiv(16, ts), tile_tokens // ts)  # at least 16 tokens per product (tl.dot)
    else:
        kf = vf = BodyFormat(16, False, 1)
        block_size, ts, nb = 16, 16, 1
    nbf = max(1, tile_tokens // float_block)
    constants = dict(
        D=head_dim, BR=query_rows(rows), FBS=float_block, NBF=nbf, BS=block_size, NB=nb, TS=ts,
        HAS_BODY=formats is not None, HALF=precision == "half", ASM=precision == "half" and on_cuda and not INTERPRETED,
        SOFTCAP=softcap, **{f"K_{k}": v for k, v in _constants(kf).items()}, **{f"V_{k}": v for k, v in _constants(vf).items()},
    )
    return TilePlan(tuple(constants.items()), nbf, nb, num_warps, num_stages)


def uniform_decode_attention(
    q: torch.Tensor,  # (S, R, D) float32, already multiplied by the softmax scale
    new_k: torch.Tensor,  # (S, D): this step's token
    new_v: torch.Tensor,  # (S, D)
    float_k: torch.Tensor,  # (cap, FBS, D) float pool
    float_v: torch.Tensor,
    float_table: torch.Tensor,  # (S, F) int32
    float_len: torch.Tensor,  # (S,) tokens
    body: tuple[dict, dict] | None = None,  # key and value tensors {"data" | "codes", "scale", "zero": (cap, ...)}
    body_table: torch.Tensor | None = None,  # (S, Bn) int32
    body_len: torch.Tensor | None = None,  # (S,) blocks
    formats: tuple[BodyFormat, BodyFormat] | None = None,
    block_size: int = 0,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,  # (S, R)
    splits: int | None = None,
    precision: str = "exact",  # "exact": float32 products (tf32x3); "half": float16 operands, float32 accumulation
    tile_tokens: int | None = None,  # tokens per tensor-core product (NB blocks x sub-tile tokens); None: `tile_for`
    num_warps: int | None = None,  # None: `tile_for`
    num_stages: int | None = None,
    float_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8 float pools: (key, value) (cap, FBS, D / G)
) -> torch.Tensor:
    """Attention output (S, R, D) float32 of one decode step over the paged store (see the module docstring)."""
    from kvtool.runtime.kernels.decode_attention import cdiv, float_scale_arguments, merge_partials, splits_for, zeros

    s, r, d = q.shape
    device = q.device
    q = q.contiguous().float()
    has_body = body is not None and body_table is not None and body_table.shape[1] > 0
    plan = plan_tiles(formats if has_body else None, d, block_size if has_body else 16, r, float_k.shape[1], precision,
                      q.is_cuda, bool(softcap), tile_tokens, num_warps, num_stages)
    dummy = zeros(1, torch.float32, device)
    dummy_table = zeros(s, torch.int32, device)[:, None]  # (S, 1)
    ftable = float_table if float_table.shape[1] else dummy_table
    if has_body:
        kf, vf = formats
        kb, vb = body
        k_ptrs = (kb["data"] if kf.bits == 16 else kb["codes"], kb.get("scale", dummy), kb.get("zero", dummy))
        v_ptrs = (vb["data"] if vf.bits == 16 else vb["codes"], vb.get("scale", dummy), vb.get("zero", dummy))
        btable, blen = body_table, body_len
    else:
        k_ptrs = v_ptrs = (dummy, dummy, dummy)
        btable, blen = dummy_table, zeros(s, torch.int64, device)
    f_width, b_width = int(float_table.shape[1]), int(btable.shape[1]) if has_body else 0
    splits = splits or splits_for(s, cdiv(f_width, plan.nbf) + cdiv(b_width, plan.nb))  # units: tiles
    f_per = cdiv(cdiv(f_width, splits), plan.nbf) * plan.nbf  # float blocks per split, whole tiles
    b_per = cdiv(cdiv(b_width, splits), plan.nb) * plan.nb
    m = torch.empty((s, splits, plan.br), device=device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty((s, splits, plan.br, d), device=device, dtype=torch.float32)
    fks, fvs, fg = float_scale_arguments(float_k, float_scales, d, dummy)
    _uniform_partials[(s, splits)](
        q, float_k, float_v, fks, fvs, ftable, ftable.stride(0), float_len, btable, btable.stride(0), blen,
        *k_ptrs, *v_ptrs, m, l, acc, r, float(softcap or 0.0), f_per, b_per, splits, FG=fg, **plan.kwargs,
    )
    return merge_partials(m, l, acc, q, new_k, new_v, softcap, sink_logits)
