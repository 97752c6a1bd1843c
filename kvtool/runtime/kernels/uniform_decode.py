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
  independent and Triton's software pipeline keeps the next tile's bytes in flight;
* **each byte read once**: a byte of a ``w``-bit slice holds ``8 / w`` tokens of one channel
  (the token-split layout of `kvtool.methods.quant.packing`): sub-tile i of the tile takes bits
  ``i*w .. i*w + w - 1`` of the same bytes, i.e. tokens ``i*R0 .. i*R0 + R0 - 1`` of every block;
  3-bit codes' second slice (1 bit, R0 / 2 rows) is read once per sub-tile;
* **codes to floats without conversion instructions**: ``(code | 0x4B000000)`` read as float32
  is ``2**23 + code`` exactly, so one OR and one subtraction replace an int->float conversion
  (a quarter-rate instruction on NVIDIA GPUs);
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
all three under ``TRITON_INTERPRET=1`` and on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.runtime.kernels.body_format import BodyFormat

MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2**23: OR-ing a code < 2**23 into its mantissa gives 2**23 + code


@triton.jit
def _codes_as_float(code):
    """int32 codes in [0, 2**23) -> float32, exactly, with an OR and a subtraction (no conversion instruction)."""
    return (code | MAGIC).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _first_slice(codes_ptr, blocks, valid, c, D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, R0: tl.constexpr):
    """The packed bytes of the first slice of NB blocks: (NB, R0, D) int32 (0 for blocks past the range)."""
    rows = tl.arange(0, R0)
    base = codes_ptr + blocks[:, None, None] * (BS * BITS // 8 * D)
    return tl.load(base + rows[None, :, None] * D + c[None, None, :], mask=valid[:, None, None], other=0).to(tl.int32)


@triton.jit
def _channel_params(scale_ptr, zero_ptr, blocks, valid, c, D: tl.constexpr, SCALES: tl.constexpr):
    """Per-channel scale and zero of NB blocks as (NB, 1, D) float32 (SCALES 1); dummies otherwise."""
    if SCALES == 1:
        offs = blocks[:, None] * D + c[None, :]
        scale = tl.load(scale_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        return scale[:, None, :], zero[:, None, :]
    else:
        return tl.zeros((1, 1, D), tl.float32), tl.zeros((1, 1, D), tl.float32)


@triton.jit
def _side_tokens(data_ptr, scale_ptr, zero_ptr, bytes0, ch_scale, ch_zero, blocks, valid, i: tl.constexpr, c,
                 NB: tl.constexpr, TS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr,
                 W0: tl.constexpr, W1: tl.constexpr, SCALES: tl.constexpr, GROUP: tl.constexpr):
    """Tokens i*TS .. i*TS + TS - 1 of NB blocks of one side as float32 (NB, TS, D).

    BITS 16: float blocks (cap, BS, D); else codes whose first slice's bytes (NB, TS, D) int32 are
    ``bytes0`` (TS == R0), with per-channel parameters ``ch_scale``, ``ch_zero`` (NB, 1, D)
    (SCALES 1) or per-token-group parameters read here (SCALES 2).
    """
    t = i * TS + tl.arange(0, TS)  # (TS,) tokens of each block
    if BITS == 16:
        offs = blocks[:, None, None] * (BS * D) + t[None, :, None] * D + c[None, None, :]
        x = tl.load(data_ptr + offs, mask=valid[:, None, None], other=0.0).to(tl.float32)
    else:
        code = (bytes0 >> (i * W0)) & ((1 << W0) - 1)  # (NB, TS, D) the first slice's bits of these tokens
        if W1 > 0:  # 3-bit codes: a 1-bit slice of BS / 8 rows; token t is bit t // R1 of row t % R1
            R1: tl.constexpr = BS * W1 // 8
            base = data_ptr + blocks[:, None, None] * (BS * BITS // 8 * D) + (BS * W0 // 8) * D
            b1 = tl.load(base + (t % R1)[None, :, None] * D + c[None, None, :], mask=valid[:, None, None], other=0)
            code = code | (((b1.to(tl.int32) >> ((t // R1) * W1)[None, :, None]) & ((1 << W1) - 1)) << W0)
        x = _codes_as_float(code)
        if SCALES == 1:
            x = x * ch_scale + ch_zero
        else:  # per token and group of GROUP channels: (NB, TS, NG) expanded over each group's channels
            NG: tl.constexpr = D // GROUP
            g = tl.arange(0, NG)
            offs = blocks[:, None, None] * (BS * NG) + t[None, :, None] * NG + g[None, None, :]
            scale = tl.load(scale_ptr + offs, mask=valid[:, None, None], other=0.0).to(tl.float32)
            zero = tl.load(zero_ptr + offs, mask=valid[:, None, None], other=0.0).to(tl.float32)
            scale = tl.reshape(tl.broadcast_to(scale[:, :, :, None], (NB, TS, NG, GROUP)), (NB, TS, D))
            zero = tl.reshape(tl.broadcast_to(zero[:, :, :, None], (NB, TS, NG, GROUP)), (NB, TS, D))
            x = x * scale + zero
    return x


@triton.jit
def _absorb(q, k, v, valid, m, l, acc, HALF: tl.constexpr, SOFTCAP: tl.constexpr, softcap):
    """Online-softmax update of rows q (BR, D) with tokens k, v (T, D) float32, valid (T,)."""
    if HALF:
        logits = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16)))  # (BR, T) float32 accumulation
    else:
        logits = tl.dot(q, tl.trans(k), input_precision="tf32x3")
    if SOFTCAP:
        logits = softcap * (2.0 * tl.sigmoid(2.0 * logits / softcap) - 1.0)  # softcap * tanh(x / softcap)
    logits = tl.where(valid[None, :], logits, float("-inf"))
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(logits - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if HALF:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="tf32x3")
    return m_new, l, acc


@triton.jit
def _uniform_partials(
    q_ptr, fk_ptr, fv_ptr, ftable_ptr, ftable_stride, flen_ptr, btable_ptr, btable_stride, blen_ptr,
    kd_ptr, ks_ptr, kz_ptr, vd_ptr, vs_ptr, vz_ptr, m_out, l_out, acc_out, R, softcap, f_per, b_per, SPLITS,
    D: tl.constexpr, BR: tl.constexpr, FBS: tl.constexpr, NBF: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr,
    TS: tl.constexpr, HAS_BODY: tl.constexpr, HALF: tl.constexpr, SOFTCAP: tl.constexpr,
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
    # float blocks f_per * split .. : NBF blocks of FBS tokens per step
    flen = tl.load(flen_ptr + s).to(tl.int32)
    f_end = tl.minimum(tl.cdiv(flen, FBS), (split + 1) * f_per)
    nbf = tl.arange(0, NBF)
    tf = tl.arange(0, FBS)
    for start in range(split * f_per, f_end, NBF):
        cols = start + nbf  # (NBF,)
        blocks = tl.load(ftable_ptr + s * ftable_stride + cols, mask=cols < f_end, other=0).to(tl.int64)
        valid = (cols[:, None] * FBS + tf[None, :]) < flen  # (NBF, FBS)
        offs = blocks[:, None, None] * (FBS * D) + tf[None, :, None] * D + c[None, None, :]
        k = tl.load(fk_ptr + offs, mask=valid[:, :, None], other=0.0).to(tl.float32)
        v = tl.load(fv_ptr + offs, mask=valid[:, :, None], other=0.0).to(tl.float32)
        m, l, acc = _absorb(q, tl.reshape(k, (NBF * FBS, D)), tl.reshape(v, (NBF * FBS, D)), tl.reshape(valid, (NBF * FBS,)),
                            m, l, acc, HALF, SOFTCAP, softcap)
    if HAS_BODY:
        blen = tl.load(blen_ptr + s).to(tl.int32)
        b_end = tl.minimum(blen, (split + 1) * b_per)
        nb = tl.arange(0, NB)
        for start in range(split * b_per, b_end, NB):
            cols = start + nb  # (NB,)
            valid = cols < b_end
            blocks = tl.load(btable_ptr + s * btable_stride + cols, mask=valid, other=0).to(tl.int64)
            kbytes = tl.zeros((1, 1, 1), tl.int32)
            vbytes = tl.zeros((1, 1, 1), tl.int32)
            if K_BITS != 16:
                kbytes = _first_slice(kd_ptr, blocks, valid, c, D, BS, K_BITS, TS)  # (NB, TS, D)
            if V_BITS != 16:
                vbytes = _first_slice(vd_ptr, blocks, valid, c, D, BS, V_BITS, TS)
            k_scale, k_zero = _channel_params(ks_ptr, kz_ptr, blocks, valid, c, D, K_SCALES)  # (NB, 1, D)
            v_scale, v_zero = _channel_params(vs_ptr, vz_ptr, blocks, valid, c, D, V_SCALES)
            token_valid = tl.reshape(tl.broadcast_to(valid[:, None], (NB, TS)), (NB * TS,))
            for i in tl.static_range(BS // TS):  # sub-tile i: tokens i*TS .. of every block (bits i*W0 .. of the bytes)
                k = _side_tokens(kd_ptr, ks_ptr, kz_ptr, kbytes, k_scale, k_zero, blocks, valid, i, c, NB, TS, D, BS,
                                 K_BITS, K_W0, K_W1, K_SCALES, K_GROUP)
                v = _side_tokens(vd_ptr, vs_ptr, vz_ptr, vbytes, v_scale, v_zero, blocks, valid, i, c, NB, TS, D, BS,
                                 V_BITS, V_W0, V_W1, V_SCALES, V_GROUP)
                m, l, acc = _absorb(q, tl.reshape(k, (NB * TS, D)), tl.reshape(v, (NB * TS, D)), token_valid, m, l, acc,
                                    HALF, SOFTCAP, softcap)
    out = (s * SPLITS + split) * BR
    tl.store(m_out + out + r, m)
    tl.store(l_out + out + r, l)
    tl.store(acc_out + out * D + r[:, None] * D + c[None, :], acc)


def _reads(fmt: BodyFormat) -> bool:
    """This kernel reads ``fmt``: float16 blocks, or uniform codes of at most two slices with fp16 scale and zero
    per channel or per token group."""
    if fmt.bits == 16:
        return fmt.scales == "none" and not fmt.rank and not fmt.rotated and not fmt.split
    return (
        not fmt.fp8 and fmt.levels == 0 and fmt.outliers == 0 and fmt.rank == 0 and not fmt.rotated and fmt.split == 0
        and not fmt.qjl and fmt.zero and fmt.scales in ("channel", "token") and fmt.widths()[2] == 0
    )


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def covers(formats: tuple[BodyFormat, BodyFormat] | None, head_dim: int, block_size: int) -> bool:
    """Whether `uniform_decode_attention` reads this store (formats None: float blocks only)."""
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


def tile_for(head_dim: int) -> int:
    """Tokens per product: 8192 values per tile (64 float32 registers a thread for keys and as many for values at
    4 warps), 16 to 128 tokens."""
    return max(16, min(128, 8192 // head_dim))


def splits_for(streams: int, tiles: int, programs: int = 1024) -> int:
    """Programs per stream: about ``programs`` in all (a memory-bound walk wants many warps on every SM: 132 on an
    H100), at least two tiles each, at most 64 partials to merge."""
    return int(max(1, min(64, tiles // 2, triton.cdiv(programs, max(streams, 1)))))


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
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention output (S, R, D) float32 of one decode step over the paged store (see the module docstring)."""
    from kvtool.runtime.kernels.decode_attention import merge_partials, query_rows, zeros

    if precision not in ("exact", "half"):
        raise ValueError(f"uniform_decode_attention: precision '{precision}' is not 'exact' or 'half'")
    s, r, d = q.shape
    device = q.device
    q = q.contiguous().float()
    has_body = body is not None and body_table is not None and body_table.shape[1] > 0
    if not covers(formats if has_body else None, d, block_size if has_body else 16):
        raise ValueError(f"uniform_decode_attention: formats {formats} at head_dim {d} are the general kernel's")
    br, fbs = query_rows(r), float_k.shape[1]
    tile_tokens = tile_tokens or tile_for(d)
    nbf = max(1, tile_tokens // fbs)
    dummy = zeros(1, torch.float32, device)
    dummy_table = zeros(s, torch.int32, device)[:, None]  # (S, 1)
    ftable = float_table if float_table.shape[1] else dummy_table
    f_tiles = triton.cdiv(int(float_table.shape[1]), nbf)
    if has_body:
        kf, vf = formats
        bs = block_size
        ts = _sub_tile(formats, bs, tile_tokens)
        nb = max(triton.cdiv(16, ts), tile_tokens // ts)  # at least 16 tokens per product (tl.dot)
        b_tiles = triton.cdiv(int(body_table.shape[1]), nb)
        kb, vb = body
        k_ptrs = (kb["data"] if kf.bits == 16 else kb["codes"], kb.get("scale", dummy), kb.get("zero", dummy))
        v_ptrs = (vb["data"] if vf.bits == 16 else vb["codes"], vb.get("scale", dummy), vb.get("zero", dummy))
        btable, blen = body_table, body_len
    else:
        kf = vf = BodyFormat(16, False, 1)
        bs, ts, nb, b_tiles = 16, 16, 1, 0
        k_ptrs = v_ptrs = (dummy, dummy, dummy)
        btable, blen = dummy_table, zeros(s, torch.int64, device)
    splits = splits or splits_for(s, f_tiles + b_tiles)
    f_per = triton.cdiv(triton.cdiv(int(float_table.shape[1]), splits), nbf) * nbf  # float blocks per split
    b_per = triton.cdiv(triton.cdiv(int(btable.shape[1]) if has_body else 0, splits), nb) * nb
    m = torch.empty((s, splits, br), device=device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty((s, splits, br, d), device=device, dtype=torch.float32)
    _uniform_partials[(s, splits)](
        q, float_k, float_v, ftable, ftable.stride(0), float_len, btable, btable.stride(0), blen,
        *k_ptrs, *v_ptrs, m, l, acc, r, float(softcap or 0.0), f_per, b_per, splits,
        D=d, BR=br, FBS=fbs, NBF=nbf, BS=bs, NB=nb, TS=ts, HAS_BODY=has_body, HALF=precision == "half",
        SOFTCAP=bool(softcap), **{f"K_{k}": v for k, v in _constants(kf).items()},
        **{f"V_{k}": v for k, v in _constants(vf).items()},
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return merge_partials(m, l, acc, q, new_k, new_v, softcap, sink_logits)
