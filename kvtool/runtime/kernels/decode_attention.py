"""Triton decode attention over the paged store (flash-decoding), reading every block in place.

One decode step: each stream (one sequence x one KV head) has R query rows (the query heads of
its GQA group, already multiplied by the softmax scale) and attends to

* its float blocks (sinks, recent window, or everything for float-only recipes): `float_table`
  (S, F) int32 block ids, `float_len` (S,) tokens; block = `FBS` tokens x D in the cache's float
  dtype;
* its body blocks: `body_table` (S, Bn) int32 ids, `body_len` (S,) blocks of `BS` tokens, each a
  key and a value *format*: float16 data (method none) or uniform ``bits``-bit codes in the
  bit-sliced, token-split layout of `kvtool.methods.quant.packing` with fp16 scale/zero per
  channel ((D,) per block) or per token group ((BS, D / group) per block), dequantized in
  registers.

Pass 1 (`_decode_partials`): grid (S, SPLITS); program (s, p) walks float blocks p, p + SPLITS, ...
and body blocks p, p + SPLITS, ... with an online softmax and writes its partial max, sum and
unnormalised output. Pass 2 (`_merge_partials`): grid (S,); merges the partials with the new
token's own term and an optional learned sink logit (one more softmax term with no value), so a
long context is split over many programs and reduced once. The torch reference is the store's
torch path (`kvtool.runtime.paged_attention.attend` over `KvtoolLayer._chunks`); tests compare
the two under ``TRITON_INTERPRET=1`` on CPU and on CUDA when a GPU is present.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.runtime.kernels.body_format import BodyFormat


@triton.jit
def _softcapped(x, SOFTCAP: tl.constexpr, softcap):
    if SOFTCAP:
        x = softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)  # softcap * tanh(x / softcap)
    return x


@triton.jit
def _load_body(data_ptr, codes_ptr, scale_ptr, zero_ptr, block, t, c, cmask,
               D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
               W2: tl.constexpr, PER_CHANNEL: tl.constexpr, GROUP: tl.constexpr):
    """One body block of one side as float32 (BS, BD): float16 data, or uniform codes dequantized."""
    mask = (t[:, None] < BS) & cmask[None, :]
    if BITS == 16:
        x = tl.load(data_ptr + block * BS * D + t[:, None] * D + c[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        ROWS: tl.constexpr = BS * BITS // 8  # byte rows of a block
        base = codes_ptr + block * ROWS * D
        K0: tl.constexpr = 8 // W0
        R0: tl.constexpr = BS // K0
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
        if PER_CHANNEL:
            scale = tl.load(scale_ptr + block * D + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
            zero = tl.load(zero_ptr + block * D + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        else:
            NG: tl.constexpr = D // GROUP
            offs = block * BS * NG + t[:, None] * NG + c[None, :] // GROUP
            scale = tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            zero = tl.load(zero_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = code.to(tl.float32) * scale + zero
    return x


@triton.jit
def _absorb(q, k, v, valid, m, l, acc, SOFTCAP: tl.constexpr, softcap):
    """Online-softmax update of rows q (BR, BD) with tokens k, v (T, BD), valid (T,)."""
    logits = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (BR, T)
    logits = _softcapped(logits, SOFTCAP, softcap)
    logits = tl.where(valid[None, :], logits, float("-inf"))
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(logits - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # (BR, BD)
    return m_new, l, acc


@triton.jit
def _decode_partials(
    q_ptr, fk_ptr, fv_ptr, ftable_ptr, ftable_stride, flen_ptr,
    kd_ptr, kc_ptr, ks_ptr, kz_ptr, vd_ptr, vc_ptr, vs_ptr, vz_ptr, btable_ptr, btable_stride, blen_ptr,
    m_out, l_out, acc_out, R, softcap,
    D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, FBS: tl.constexpr, BS: tl.constexpr, SPLITS: tl.constexpr,
    HAS_BODY: tl.constexpr, SOFTCAP: tl.constexpr,
    K_BITS: tl.constexpr, K_W0: tl.constexpr, K_W1: tl.constexpr, K_W2: tl.constexpr, K_PER_CHANNEL: tl.constexpr, K_GROUP: tl.constexpr,
    V_BITS: tl.constexpr, V_W0: tl.constexpr, V_W1: tl.constexpr, V_W2: tl.constexpr, V_PER_CHANNEL: tl.constexpr, V_GROUP: tl.constexpr,
):
    s = tl.program_id(0)
    split = tl.program_id(1)
    r = tl.arange(0, BR)
    c = tl.arange(0, BD)
    rmask, cmask = r < R, c < D
    q = tl.load(q_ptr + s * R * D + r[:, None] * D + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)  # (BR, BD)
    m = tl.full((BR,), float("-inf"), tl.float32)
    l = tl.zeros((BR,), tl.float32)
    acc = tl.zeros((BR, BD), tl.float32)
    # float blocks
    flen = tl.load(flen_ptr + s).to(tl.int32)
    tf = tl.arange(0, FBS)
    for col in range(split, tl.cdiv(flen, FBS), SPLITS):
        block = tl.load(ftable_ptr + s * ftable_stride + col).to(tl.int64)
        valid = col * FBS + tf < flen
        offs = block * FBS * D + tf[:, None] * D + c[None, :]
        kv_mask = valid[:, None] & cmask[None, :]
        k = tl.load(fk_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(fv_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        m, l, acc = _absorb(q, k, v, valid, m, l, acc, SOFTCAP, softcap)
    if HAS_BODY:
        blen = tl.load(blen_ptr + s).to(tl.int32)
        tb = tl.arange(0, BS)
        valid_b = tb < BS
        for col in range(split, blen, SPLITS):
            block = tl.load(btable_ptr + s * btable_stride + col).to(tl.int64)
            k = _load_body(kd_ptr, kc_ptr, ks_ptr, kz_ptr, block, tb, c, cmask, D, BS, K_BITS, K_W0, K_W1, K_W2, K_PER_CHANNEL, K_GROUP)
            v = _load_body(vd_ptr, vc_ptr, vs_ptr, vz_ptr, block, tb, c, cmask, D, BS, V_BITS, V_W0, V_W1, V_W2, V_PER_CHANNEL, V_GROUP)
            m, l, acc = _absorb(q, k, v, valid_b, m, l, acc, SOFTCAP, softcap)
    out = (s * SPLITS + split) * BR
    tl.store(m_out + out + r, m)
    tl.store(l_out + out + r, l)
    tl.store(acc_out + out * BD + r[:, None] * BD + c[None, :], acc)


@triton.jit
def _merge_partials(
    m_in, l_in, acc_in, q_ptr, new_k_ptr, new_v_ptr, sink_ptr, out_ptr, R, softcap,
    D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SPLITS: tl.constexpr, HAS_SINK: tl.constexpr, SOFTCAP: tl.constexpr,
):
    s = tl.program_id(0)
    r = tl.arange(0, BR)
    c = tl.arange(0, BD)
    rmask, cmask = r < R, c < D
    q = tl.load(q_ptr + s * R * D + r[:, None] * D + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    new_k = tl.load(new_k_ptr + s * D + c, mask=cmask, other=0.0)
    new_v = tl.load(new_v_ptr + s * D + c, mask=cmask, other=0.0)
    m = _softcapped(tl.sum(q * new_k[None, :], axis=1), SOFTCAP, softcap)  # (BR,) the new token: always seen
    l = tl.full((BR,), 1.0, tl.float32)
    acc = tl.zeros((BR, BD), tl.float32) + new_v[None, :]
    if HAS_SINK:
        sink = tl.load(sink_ptr + s * R + r, mask=rmask, other=0.0)
        m_new = tl.maximum(m, sink)
        l = l * tl.exp(m - m_new) + tl.exp(sink - m_new)
        acc = acc * tl.exp(m - m_new)[:, None]
        m = m_new
    for split in range(SPLITS):
        base = (s * SPLITS + split) * BR
        m_p = tl.load(m_in + base + r)
        l_p = tl.load(l_in + base + r)
        acc_p = tl.load(acc_in + base * BD + r[:, None] * BD + c[None, :])
        m_new = tl.maximum(m, m_p)
        a = tl.exp(m - m_new)
        b = tl.where(m_p == float("-inf"), 0.0, tl.exp(m_p - m_new))
        l = l * a + l_p * b
        acc = acc * a[:, None] + acc_p * b[:, None]
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + s * R * D + r[:, None] * D + c[None, :], out, mask=rmask[:, None] & cmask[None, :])


def _side(blocks: dict[str, torch.Tensor] | None, fmt: BodyFormat | None, device) -> tuple:
    """(data, codes, scale, zero) pointers of one side; unused ones are a 1-element dummy."""
    dummy = torch.zeros(1, device=device)
    if blocks is None:
        return dummy, dummy, dummy, dummy
    if fmt.bits == 16:
        return blocks["data"], dummy, dummy, dummy
    return dummy, blocks["codes"], blocks["scale"], blocks["zero"]


def splits_for(streams: int, blocks: int) -> int:
    """Programs per stream: enough to fill a GPU at small batch, never more than blocks to walk."""
    if blocks <= 4:
        return 1
    return int(max(1, min(16, blocks // 4, triton.cdiv(256, max(streams, 1)))))


def paged_decode_attention(
    q: torch.Tensor,  # (S, R, D) float32, already multiplied by the softmax scale
    new_k: torch.Tensor,  # (S, D) float32: this step's token, attended to by every row
    new_v: torch.Tensor,  # (S, D) float32
    float_k: torch.Tensor,  # (cap, FBS, D) float pool (one head per stream)
    float_v: torch.Tensor,
    float_table: torch.Tensor,  # (S, F) int32
    float_len: torch.Tensor,  # (S,) int64 tokens
    body: tuple[dict, dict] | None = None,  # key and value tensors of the body pool {name: (cap, ...)}
    body_table: torch.Tensor | None = None,  # (S, Bn) int32
    body_len: torch.Tensor | None = None,  # (S,) int64 blocks
    formats: tuple[BodyFormat, BodyFormat] | None = None,
    block_size: int = 0,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,  # (S, R) learned sink logits
    splits: int | None = None,
) -> torch.Tensor:
    """Attention output (S, R, D) float32 of one decode step over the paged store."""
    s, r, d = q.shape
    device = q.device
    q = q.contiguous().float()
    br, bd, fbs = max(triton.next_power_of_2(r), 1), triton.next_power_of_2(d), float_k.shape[1]
    has_body = body is not None and body_table is not None and body_table.shape[1] > 0
    longest = int(float_table.shape[1]) + (int(body_table.shape[1]) if has_body else 0)
    splits = splits or splits_for(s, longest)
    m = torch.empty((s, splits, br), device=device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty((s, splits, br, bd), device=device, dtype=torch.float32)
    kf, vf = formats if has_body else (BodyFormat(16, False, 1), BodyFormat(16, False, 1))
    kd, kc, ks, kz = _side(body[0] if has_body else None, kf, device)
    vd, vc, vs, vz = _side(body[1] if has_body else None, vf, device)
    dummy_table = torch.zeros((s, 1), dtype=torch.int32, device=device)
    btable = body_table if has_body else dummy_table
    blen = body_len if has_body else torch.zeros(s, dtype=torch.int64, device=device)
    ftable = float_table if float_table.shape[1] else dummy_table
    bs = block_size if has_body else 16
    _decode_partials[(s, splits)](
        q, float_k, float_v, ftable, ftable.stride(0), float_len,
        kd, kc, ks, kz, vd, vc, vs, vz, btable, btable.stride(0), blen,
        m, l, acc, r, float(softcap or 0.0),
        D=d, BR=br, BD=bd, FBS=fbs, BS=bs, SPLITS=splits, HAS_BODY=has_body, SOFTCAP=bool(softcap),
        K_BITS=kf.bits, K_W0=kf.widths()[0], K_W1=kf.widths()[1], K_W2=kf.widths()[2], K_PER_CHANNEL=kf.per_channel, K_GROUP=kf.group,
        V_BITS=vf.bits, V_W0=vf.widths()[0], V_W1=vf.widths()[1], V_W2=vf.widths()[2], V_PER_CHANNEL=vf.per_channel, V_GROUP=vf.group,
    )
    out = torch.empty((s, r, d), device=device, dtype=torch.float32)
    sink = sink_logits.contiguous().float() if sink_logits is not None else torch.zeros(1, device=device)
    _merge_partials[(s,)](
        m, l, acc, q, new_k.contiguous().float(), new_v.contiguous().float(), sink, out, r, float(softcap or 0.0),
        D=d, BR=br, BD=bd, SPLITS=splits, HAS_SINK=sink_logits is not None, SOFTCAP=bool(softcap),
    )
    return out
