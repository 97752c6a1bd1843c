"""Triton decode attention over the paged store (flash-decoding), reading every block in place.

One decode step: each stream (one sequence x one KV head) has R query rows (the query heads of
its GQA group, already multiplied by the softmax scale) and attends to

* its float blocks (sinks, recent window, or everything for float-only recipes): `float_table`
  (S, F) int32 block ids, `float_len` (S,) tokens; block = `FBS` tokens x D in the cache's float
  dtype (int8 codes: times their float16 scales, one per FG channels of a token, ``float_scales``);
* its body blocks: `body_table` (S, Bn) int32 ids, `body_len` (S,) blocks of `BS` tokens, each a
  key and a value *format* (`BodyFormat`, read by `body_block.load_body`), dequantized in
  registers: float16 data (method none); uniform ``bits``-bit codes in the bit-sliced,
  token-split layout of `kvtool.methods.quant.packing` with fp16 scale/zero per channel ((D,)
  per block) or per token group ((BS, D / group) per block); fp8 e4m3/e5m2 bytes with one
  float32 scale per block (dynamic) or a calibrated per-layer / per-KV-head scale (static);
  int_static packed codes with calibrated per-layer / per-head / per-channel step and offset;
  nuq packed codes looked up in the layer's codebook (selects in registers), scaled by the
  calibrated per-channel ranges (keys) or the block's per-token-group scales (values), with
  the block's sparse fp16 outliers written over their positions (`body_block._outliers`);
  Palu low-rank latents (fp16, or uniform codes per token group, optionally Hadamard-mixed)
  reconstructed in registers with the head's basis (`body_lowrank.py`); TurboQuant codebook
  indices times the per-token norm, read in the rotated domain: body keys are scored against
  the query rotated once per step and body values summed in the rotated domain, rotated back once
  per partial (`body_rotated.py`); with TurboQuant's outlier split, both instances of a block
  rebuilt in head space through the block's channel mask (`body_split.py`); TurboQuant keys with
  the 1-bit QJL residual add each body key's QJL term to its score, against the query sketched
  once per step (once per block with the split) (`body_qjl.py`); TurboQuant keys with
  ``channel_scale: query`` hold k / s, so body keys are scored against q * s (the row of the
  stream's KV head, multiplied once per step in torch, before the rotation).
  Keys stored before RoPE (``keys.pre_rope``, `body_rope.BodyRope`) are rotated in registers at
  each body token's true position, read in place (per-slot ``pos`` of an evicting store, or the
  cache's per-sequence position table).
  Calibrated tables sit beside the store (the quantizer's `kernel_tensors`); `stream_group`
  (S,) gives each stream's KV head, its row in them.

Pass 1 (`_decode_partials`): grid (S, SPLITS); program (s, p) walks float blocks p, p + SPLITS, ...
and body blocks p, p + SPLITS, ... with an online softmax and writes its partial max, sum and
unnormalised output. Pass 2 (`_merge_partials`): grid (S, R), one query row per program; merges the partials with the new
token's own term and an optional learned sink logit (one more softmax term with no value), so a
long context is split over many programs and reduced once. The torch reference is the store's
torch path (`kvtool.runtime.paged_attention.attend` over `KvtoolLayer._chunks`); tests compare
the two under ``TRITON_INTERPRET=1`` on CPU and on CUDA when a GPU is present.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.runtime.kernels.body_block import load_body, side_constants
from kvtool.runtime.kernels.body_format import NORM_MODES, BodyFormat
from kvtool.runtime.kernels.body_lowrank import load_side
from kvtool.runtime.kernels.body_qjl import qjl_logits, qjl_pointers, sketched_query, split_sketched_queries
from kvtool.runtime.kernels.body_rope import SOURCES, BodyRope, body_positions, partner_channels, rotate_keys
from kvtool.runtime.kernels.body_rotated import fold_rotated_values, rotated_query


@triton.jit
def _softcapped(x, SOFTCAP: tl.constexpr, softcap):
    if SOFTCAP:
        x = softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)  # softcap * tanh(x / softcap)
    return x


@triton.jit
def _softmax_step(q, k, valid, m, l, SOFTCAP: tl.constexpr, softcap):
    """Online-softmax update of rows q (BR, BD) with keys k (T, BD), valid (T,): (m, l, rescale (BR,), p (BR, T))."""
    logits = tl.dot(q, tl.trans(k), input_precision="tf32x3")  # (BR, T): three tf32 products, float32 accuracy
    return _softmax_logits(logits, valid, m, l, SOFTCAP, softcap)


@triton.jit
def _softmax_logits(logits, valid, m, l, SOFTCAP: tl.constexpr, softcap):
    """Online-softmax update with logits (BR, T) before soft-capping, valid (T,): (m, l, rescale (BR,), p (BR, T))."""
    logits = _softcapped(logits, SOFTCAP, softcap)
    logits = tl.where(valid[None, :], logits, float("-inf"))
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(logits - m_safe[:, None])
    return m_new, l * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _absorb(q, k, v, valid, m, l, acc, SOFTCAP: tl.constexpr, softcap):
    """Online-softmax update of rows q (BR, BD) with tokens k, v (T, BD), valid (T,)."""
    m, l, alpha, p = _softmax_step(q, k, valid, m, l, SOFTCAP, softcap)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="tf32x3")  # (BR, BD)
    return m, l, acc


@triton.jit
def stream_rows(q_ptr, s, R, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """Stream s's query rows (BR, BD), row and channel ranges, and an empty online-softmax state (m, l, acc)."""
    r = tl.arange(0, BR)
    c = tl.arange(0, BD)
    rmask, cmask = r < R, c < D
    q = tl.load(q_ptr + s * R * D + r[:, None] * D + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)  # (BR, BD)
    m = tl.full((BR,), float("-inf"), tl.float32)
    l = tl.zeros((BR,), tl.float32)
    acc = tl.zeros((BR, BD), tl.float32)
    return q, r, c, cmask, m, l, acc


@triton.jit
def store_partials(m_out, l_out, acc_out, s, split, r, c, m, l, acc, BR: tl.constexpr, BD: tl.constexpr, SPLITS):
    """Program (s, split)'s partial max, sum and unnormalised output, for `_merge_partials`."""
    out = (s * SPLITS + split) * BR
    tl.store(m_out + out + r, m)
    tl.store(l_out + out + r, l)
    tl.store(acc_out + out * BD + r[:, None] * BD + c[None, :], acc)


@triton.jit
def _decode_partials(
    q_ptr, qb_ptr, qs_ptr, fk_ptr, fv_ptr, fks_ptr, fvs_ptr, ftable_ptr, ftable_stride, flen_ptr, btable_ptr, btable_stride,
    blen_ptr, group_ptr,
    kd_ptr, kc_ptr, ks_ptr, kz_ptr, klut_ptr, koi_ptr, kov_ptr, kw_ptr, kb_ptr, kxc_ptr, kxn_ptr, kxm_ptr, kxt_ptr, k_srow, k_scol,
    ksg_ptr, krn_ptr, kxsg_ptr, kxrn_ptr,
    vd_ptr, vc_ptr, vs_ptr, vz_ptr, vlut_ptr, voi_ptr, vov_ptr, vw_ptr, vb_ptr, vxc_ptr, vxn_ptr, vxm_ptr, vxt_ptr, v_srow, v_scol,
    pos_ptr, pos_stride, nsink_ptr, streams_per_sequence, freq_ptr, rope_scaling,
    m_out, l_out, acc_out, accr_out, R, softcap,
    D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, FBS: tl.constexpr, FG: tl.constexpr, BS: tl.constexpr,
    TT: tl.constexpr, SPLITS, HAS_BODY: tl.constexpr, SOFTCAP: tl.constexpr, PRE_ROPE: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
    K_BITS: tl.constexpr, K_W0: tl.constexpr, K_W1: tl.constexpr, K_W2: tl.constexpr, K_FP8_MANTISSA: tl.constexpr,
    K_FP8_BIAS: tl.constexpr, K_SCALES: tl.constexpr, K_GROUP: tl.constexpr, K_HAS_ZERO: tl.constexpr, K_LEVELS: tl.constexpr,
    K_OUTLIERS: tl.constexpr, K_RANK: tl.constexpr, K_BL: tl.constexpr, K_BLC: tl.constexpr, K_ROTATED: tl.constexpr, K_SPLIT: tl.constexpr,
    K_O_BITS: tl.constexpr, K_O_W0: tl.constexpr, K_O_W1: tl.constexpr, K_O_W2: tl.constexpr, K_O_LEVELS: tl.constexpr,
    K_BDO: tl.constexpr, K_BDR: tl.constexpr, K_BDOC: tl.constexpr, K_BDRC: tl.constexpr, K_QJL: tl.constexpr,
    K_QSCALED: tl.constexpr, K_XSTATIC: tl.constexpr,
    V_BITS: tl.constexpr, V_W0: tl.constexpr, V_W1: tl.constexpr, V_W2: tl.constexpr, V_FP8_MANTISSA: tl.constexpr,
    V_FP8_BIAS: tl.constexpr, V_SCALES: tl.constexpr, V_GROUP: tl.constexpr, V_HAS_ZERO: tl.constexpr, V_LEVELS: tl.constexpr,
    V_OUTLIERS: tl.constexpr, V_RANK: tl.constexpr, V_BL: tl.constexpr, V_BLC: tl.constexpr, V_ROTATED: tl.constexpr, V_SPLIT: tl.constexpr,
    V_O_BITS: tl.constexpr, V_O_W0: tl.constexpr, V_O_W1: tl.constexpr, V_O_W2: tl.constexpr, V_O_LEVELS: tl.constexpr,
    V_BDO: tl.constexpr, V_BDR: tl.constexpr, V_BDOC: tl.constexpr, V_BDRC: tl.constexpr, V_XSTATIC: tl.constexpr,
):
    s = tl.program_id(0)
    split = tl.program_id(1)
    q, r, c, cmask, m, l, acc = stream_rows(q_ptr, s, R, D, BR, BD)
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
        if FG > 0:  # int8 slots: codes times their float16 scales, one per FG channels of a token
            k, v = float_slot_scaled(k, v, fks_ptr, fvs_ptr, block * FBS + tf, c, kv_mask, D, FG)
        m, l, acc = _absorb(q, k, v, valid, m, l, acc, SOFTCAP, softcap)
    if HAS_BODY:
        blen = tl.load(blen_ptr + s).to(tl.int32)
        head = tl.load(group_ptr + s).to(tl.int64)  # the stream's KV head: its row of static tables
        tt = tl.arange(0, TT)
        valid_b = tt < TT
        qb = q
        if K_ROTATED or K_QSCALED:  # keys stored rotated (TurboQuant): scored against P q; keys of k / s: q * s
            qb = tl.load(qb_ptr + s * R * D + r[:, None] * D + c[None, :], mask=(r < R)[:, None] & cmask[None, :], other=0.0)
        if K_QJL:  # keys with the QJL residual, one instance: the rotated query sketched once, G P q
            if K_SPLIT == 0:
                qs = tl.load(qs_ptr + s * R * D + r[:, None] * D + c[None, :], mask=(r < R)[:, None] & cmask[None, :], other=0.0)
        acc_rot = tl.zeros((BR, BD), tl.float32)  # body values summed in their rotated domain (V_ROTATED)
        partner, sign = partner_channels(c, ROTARY, INTERLEAVED)  # RoPE's partner channels (pre-RoPE keys)
        for col in range(split, blen, SPLITS):
            block = tl.load(btable_ptr + s * btable_stride + col).to(tl.int64)
            # the split's masks at `block`: the block's own, or (XSTATIC) the KV head's calibrated row of a (H_kv, D / 8)
            # table, reached through a pointer shifted so that row `block` of it is row `head`
            kxm_block = kxm_ptr + (head - block) * (D // 8) if K_XSTATIC else kxm_ptr
            vxm_block = vxm_ptr + (head - block) * (D // 8) if V_XSTATIC else vxm_ptr
            if K_QJL:  # the outlier split: each instance's sketch of the query in this block's channel order
                if K_SPLIT > 0:
                    qs_o, qs_r = split_sketched_queries(qb, kxm_block, kxt_ptr, block, c, cmask, D, K_SPLIT, K_O_LEVELS,
                                                        K_BDO, K_BDR)  # (BR, BDO), (BR, BDR)
            for sub in tl.static_range(BS // TT):  # the block in token tiles of TT rows (bounded registers)
                tb = sub * TT + tt
                k, k_partner = load_side(kd_ptr, kc_ptr, ks_ptr, kz_ptr, klut_ptr, koi_ptr, kov_ptr, kw_ptr, kb_ptr, kxc_ptr,
                                         kxn_ptr, kxm_block, kxt_ptr, k_srow, k_scol, block, head, tb, c, cmask, partner, D, BS,
                                         K_BITS, K_W0, K_W1, K_W2, K_FP8_MANTISSA, K_FP8_BIAS, K_SCALES, K_GROUP, K_HAS_ZERO,
                                         K_LEVELS, K_OUTLIERS, K_RANK, K_BL, K_BLC, K_SPLIT, K_O_BITS, K_O_W0, K_O_W1, K_O_W2,
                                         K_O_LEVELS, K_BDO, K_BDR, K_BDOC, K_BDRC, TT, PRE_ROPE > 0)
                if PRE_ROPE > 0:  # keys stored before RoPE: rotate at each token's true position
                    if K_RANK == 0:  # latents gave their partner columns above (the same latent, no second read)
                        k_partner = load_body(kd_ptr, kc_ptr, ks_ptr, kz_ptr, klut_ptr, koi_ptr, kov_ptr, k_srow, k_scol, block,
                                              head, tb, partner, cmask, D, BS, K_BITS, K_W0, K_W1, K_W2, K_FP8_MANTISSA,
                                              K_FP8_BIAS, K_SCALES, K_GROUP, K_HAS_ZERO, K_LEVELS, K_OUTLIERS)  # k[:, partner]
                    pos = body_positions(pos_ptr, pos_stride, nsink_ptr, s, s // streams_per_sequence, col, tb, block, BS, PRE_ROPE)
                    k = rotate_keys(k, k_partner, sign, pos, c, freq_ptr, rope_scaling, ROTARY, INTERLEAVED)
                v, _ = load_side(vd_ptr, vc_ptr, vs_ptr, vz_ptr, vlut_ptr, voi_ptr, vov_ptr, vw_ptr, vb_ptr, vxc_ptr, vxn_ptr, vxm_block,
                                 vxt_ptr, v_srow, v_scol, block, head, tb, c, cmask, c, D, BS, V_BITS, V_W0, V_W1, V_W2,
                                 V_FP8_MANTISSA, V_FP8_BIAS, V_SCALES, V_GROUP, V_HAS_ZERO, V_LEVELS, V_OUTLIERS, V_RANK, V_BL,
                                 V_BLC, V_SPLIT, V_O_BITS, V_O_W0, V_O_W1, V_O_W2, V_O_LEVELS, V_BDO, V_BDR, V_BDOC,
                                 V_BDRC, TT, False)
                if K_QJL:  # the codebook score plus each instance's QJL term
                    logits = tl.dot(qb, tl.trans(k), input_precision="tf32x3")  # (BR, TT)
                    if K_SPLIT > 0:
                        logits = logits + qjl_logits(qs_o, kxsg_ptr, kxrn_ptr, kxn_ptr, block, tb, K_SPLIT, K_BDO, BS,
                                                     K_SCALES)
                        logits = logits + qjl_logits(qs_r, ksg_ptr, krn_ptr, ks_ptr, block, tb, D - K_SPLIT, K_BDR, BS,
                                                     K_SCALES)
                    else:
                        logits = logits + qjl_logits(qs, ksg_ptr, krn_ptr, ks_ptr, block, tb, D, BD, BS, K_SCALES)
                    m, l, alpha, p = _softmax_logits(logits, valid_b, m, l, SOFTCAP, softcap)
                else:
                    m, l, alpha, p = _softmax_step(qb, k, valid_b, m, l, SOFTCAP, softcap)
                weighted = tl.dot(p, v, input_precision="tf32x3")  # (BR, BD)
                acc = acc * alpha[:, None]
                if V_ROTATED:
                    acc_rot = acc_rot * alpha[:, None] + weighted
                else:
                    acc = acc + weighted
        if V_ROTATED:  # beside the partials; `fold_rotated_values` rotates it back once
            rows = (s * SPLITS + split) * BR + r
            tl.store(accr_out + rows[:, None] * BD + c[None, :], acc_rot)
    store_partials(m_out, l_out, acc_out, s, split, r, c, m, l, acc, BR, BD, SPLITS)


@triton.jit
def _merge_partials(
    m_in, l_in, acc_in, q_ptr, new_k_ptr, new_v_ptr, sink_ptr, out_ptr, R, softcap,
    D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SPLITS, SC: tl.constexpr, HAS_SINK: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Program (s, row): query row ``row`` of stream s, its SPLITS partials read SC at a time as (SC, BD) tiles (one
    wide load per chunk, not one dependent load per split: with 64-512 splits a split-by-split loop is
    latency-bound), merged by an online softmax over the chunks."""
    s = tl.program_id(0)
    row = tl.program_id(1)
    c = tl.arange(0, BD)
    cmask = c < D
    q = tl.load(q_ptr + (s * R + row) * D + c, mask=cmask, other=0.0)
    new_k = tl.load(new_k_ptr + s * D + c, mask=cmask, other=0.0)
    new_v = tl.load(new_v_ptr + s * D + c, mask=cmask, other=0.0)
    m = _softcapped(tl.sum(q * new_k, axis=0), SOFTCAP, softcap)  # the new token's logit: always seen, finite
    l = tl.exp(m - m)  # 1.0 as a float32 scalar
    acc = new_v
    if HAS_SINK:
        sink = tl.load(sink_ptr + s * R + row)
        m_new = tl.maximum(m, sink)
        l = l * tl.exp(m - m_new) + tl.exp(sink - m_new)
        acc = acc * tl.exp(m - m_new)
        m = m_new
    j = tl.arange(0, SC)
    for start in range(0, SPLITS, SC):
        split = start + j  # (SC,)
        valid = split < SPLITS
        base = (s * SPLITS + split) * BR + row  # (SC,) offsets of this row's partials
        m_p = tl.load(m_in + base, mask=valid, other=float("-inf"))
        l_p = tl.load(l_in + base, mask=valid, other=0.0)
        acc_p = tl.load(acc_in + base[:, None] * BD + c[None, :], mask=valid[:, None], other=0.0)  # (SC, BD)
        m_new = tl.maximum(m, tl.max(m_p, axis=0))  # finite: m is
        a = tl.exp(m - m_new)
        b = tl.where(m_p == float("-inf"), 0.0, tl.exp(m_p - m_new))  # (SC,): empty splits weigh nothing
        l = l * a + tl.sum(l_p * b, axis=0)
        acc = acc * a + tl.sum(acc_p * b[:, None], axis=0)
        m = m_new
    tl.store(out_ptr + (s * R + row) * D + c, acc / l, mask=cmask)


_ZEROS: dict[tuple, torch.Tensor] = {}


def zeros(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A read-only (n,) zero tensor, kept per (dtype, device) and grown as needed: dummies and empty tables the kernels
    never write cost no allocation or fill at every decode step."""
    key = (dtype, device if isinstance(device, torch.device) else torch.device(device))
    held = _ZEROS.get(key)
    if held is None or held.numel() < n:
        held = _ZEROS[key] = torch.zeros(max(n, 64), dtype=dtype, device=device)
    return held[:n]


def _side(tensors: dict[str, torch.Tensor] | None, fmt: BodyFormat, device) -> tuple:
    """Pointers (data, codes, scale, zero, lut, outlier index, outlier value, recon, recon bias, split outlier codes,
    split outlier norms, split channel masks, split tables) and static-table strides of one side.

    tensors: the side's body pool tensors {name: (cap, ...)} and the quantizer's `kernel_tensors`
    (``static_scale`` / ``static_zero`` (1 | H_kv, 1 | D) float32, ``codebook`` (levels,) float32,
    ``recon`` (H_kv, r, D) / ``recon_bias`` (H_kv, D) float32 of low-rank latents, ``split_tables``
    of TurboQuant's outlier split, see `body_split.py`, ``qjl_sketch`` of its QJL keys, see
    `body_qjl.py`, whose signs and residual norms `body_qjl.qjl_pointers` passes). Float data is
    ``data`` (method none) or ``latent`` (Palu), the per-token scale of ``"norm"`` / ``"norm8"`` is ``norm``.
    Unused pointers are a 1-element dummy.
    """
    tensors = tensors or {}
    dummy = zeros(1, torch.float32, device)
    pick = lambda name: tensors.get(name, dummy)  # noqa: E731
    srow = scol = 0
    if fmt.scales == "static":
        scale, zero = tensors["static_scale"], tensors.get("static_zero", dummy)
        srow = scale.shape[1] if scale.shape[0] > 1 else 0
        scol = 1 if scale.shape[1] > 1 else 0
    else:
        scale, zero = pick("norm" if fmt.scales in NORM_MODES else "scale"), pick("zero")
    data = pick("latent" if fmt.rank else "data")
    pointers = (data, pick("codes"), scale, zero, pick("codebook"), pick("outlier_index"), pick("outlier_value"),
                pick("recon"), pick("recon_bias"), pick("outlier_codes"), pick("outlier_norm"), pick("outlier_mask"),
                pick("split_tables"))
    return pointers, srow, scol


def _prefixed(constants: dict, prefix: str) -> dict:
    return {f"{prefix}{name}": value for name, value in constants.items()}


def _rope_arguments(rope: BodyRope | None, streams: int, device) -> tuple[tuple, dict]:
    """(pos, pos stride, n_sink, streams per sequence, inv_freq, scaling) and the RoPE constants of the kernel."""
    if rope is None:
        dummy = zeros(1, torch.int32, device)
        return (dummy, 0, dummy, 1, zeros(1, torch.float32, device), 1.0), dict(PRE_ROPE=0, ROTARY=2, INTERLEAVED=False)
    positions = rope.positions if rope.positions is not None else zeros(1, torch.int32, device)
    n_sink = rope.n_sink if rope.n_sink is not None else zeros(streams, torch.int64, device)
    stride = positions.stride(0) if rope.source == "sequence" else 0
    args = (positions, stride, n_sink, rope.streams_per_sequence, rope.inv_freq.float().contiguous(), float(rope.scaling))
    return args, dict(PRE_ROPE=SOURCES[rope.source], ROTARY=rope.rotary_dim, INTERLEAVED=rope.interleaved)


def query_rows(r: int) -> int:
    """Register rows for a stream's R query rows: a power of two, at least 16 (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(r))


def token_tile(block_size: int, head_dim_lanes: int, quantized: bool) -> int:
    """Tokens of a body block decoded at once: the whole block up to 8192 values per tile for float16 blocks
    (about 64 float32 registers per thread for keys and as many for values at 4 warps), 4096 for codes (their
    integer temporaries; 32 tokens beat 64 at head_dim 128 on an H100), at least 16 (tl.dot)."""
    return max(16, min(block_size, (4096 if quantized else 8192) // head_dim_lanes))


MAX_SPLITS = 256  # partials per stream; the merge reads them MERGE_VALUES floats at a time
MERGE_VALUES = 8192


def splits_for(streams: int, blocks: int) -> int:
    """Programs per stream (flash-decoding splits), each walking at least two blocks (tiles): about 1024 programs in
    all while that is at most 64 per stream, else about 512 with at most `MAX_SPLITS` per stream. Measured on an H100
    (benchmarks/RESULTS.md, "GPU: the merge pass ..."): many streams need no more than 1024 programs; few streams (batch
    1, or an MQA model's one KV head) need more splits than 64 (Gemma-3's head at 32K x 1: 64 splits 50 us, 256 splits
    31 us), but every split adds partials to merge (512 splits: 43 us, 27 of them the merge)."""
    if blocks <= 4:
        return 1
    streams = max(streams, 1)
    per_stream = max(min(64, cdiv(1024, streams)), min(MAX_SPLITS, cdiv(512, streams)))
    return int(max(1, min(per_stream, blocks // 2)))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host integers (`triton.cdiv` is a constexpr function: each host call costs its wrapper)."""
    return -(-a // b)


def paged_decode_attention(
    q: torch.Tensor,  # (S, R, D) float32, already multiplied by the softmax scale
    new_k: torch.Tensor,  # (S, D) float32: this step's token, attended to by every row
    new_v: torch.Tensor,  # (S, D) float32
    float_k: torch.Tensor,  # (cap, FBS, D) float pool (one head per stream)
    float_v: torch.Tensor,
    float_table: torch.Tensor,  # (S, F) int32
    float_len: torch.Tensor,  # (S,) int64 tokens
    body: tuple[dict, dict] | None = None,  # key and value tensors {name: (cap, ...)} + kernel_tensors (see `_side`)
    body_table: torch.Tensor | None = None,  # (S, Bn) int32
    body_len: torch.Tensor | None = None,  # (S,) int64 blocks
    formats: tuple[BodyFormat, BodyFormat] | None = None,
    block_size: int = 0,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,  # (S, R) learned sink logits
    splits: int | None = None,
    stream_group: torch.Tensor | None = None,  # (S,) int64 KV head of each stream (static tables); None: all 0
    rope: BodyRope | None = None,  # body keys stored before RoPE: how to rotate them
    tile: int | None = None,  # tokens of a body block decoded at once (None: `token_tile`); tests and tuning
    num_warps: int = 4,
    num_stages: int | None = None,  # None: Triton's default software pipelining
    precision: str = "exact",  # "exact": float32 products; "half": float16 operands (`uniform_decode`), fp16/bf16 models
    kernel: str = "auto",  # "auto": `uniform_decode` where it reads the formats, else this general kernel; "general"
    float_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8 float pools: (key, value) scales
    # (cap, FBS, D / G) float16, one per G channels of a token
) -> torch.Tensor:
    """Attention output (S, R, D) float32 of one decode step over the paged store.

    Float and uniform-code stores with keys after RoPE go to `uniform_decode.uniform_decode_attention` (tiles of
    several blocks, each packed byte read once) unless ``kernel="general"`` or a token ``tile`` is asked for; the
    general kernel below reads every format, one block at a time, in float32 products."""
    from kvtool.runtime.kernels import uniform_decode

    if kernel not in ("auto", "general"):
        raise ValueError(f"paged_decode_attention: kernel '{kernel}' is not 'auto' or 'general'")
    has_body = body is not None and body_table is not None and body_table.shape[1] > 0
    if kernel == "auto" and tile is None and rope is None and uniform_decode.covers(
        formats if has_body else None, q.shape[-1], block_size if has_body else 16
    ):
        return uniform_decode.uniform_decode_attention(
            q, new_k, new_v, float_k, float_v, float_table, float_len, body, body_table, body_len, formats, block_size,
            softcap, sink_logits, splits, precision=precision, float_scales=float_scales,
        )
    s, r, d = q.shape
    device = q.device
    q = q.contiguous().float()
    br, bd, fbs = query_rows(r), triton.next_power_of_2(d), float_k.shape[1]
    longest = int(float_table.shape[1]) + (int(body_table.shape[1]) if has_body else 0)
    splits = splits or splits_for(s, longest)
    m = torch.empty((s, splits, br), device=device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty((s, splits, br, bd), device=device, dtype=torch.float32)
    kf, vf = formats if has_body else (BodyFormat(16, False, 1), BodyFormat(16, False, 1))
    k_ptrs, k_srow, k_scol = _side(body[0] if has_body else None, kf, device)
    v_ptrs, v_srow, v_scol = _side(body[1] if has_body else None, vf, device)
    dummy_table = zeros(s, torch.int32, device)[:, None]  # (S, 1)
    btable = body_table if has_body else dummy_table
    blen = body_len if has_body else zeros(s, torch.int64, device)
    ftable = float_table if float_table.shape[1] else dummy_table
    group = stream_group if stream_group is not None else zeros(s, torch.int64, device)
    bs = block_size if has_body else 16
    rope_args, rope_constants = _rope_arguments(rope if has_body else None, s, device)
    if vf.qjl:
        raise ValueError("paged_decode_attention: values never carry the QJL residual (keys only)")
    q_body = q  # (S, R, D) the query body keys are scored against
    if kf.query_scale:  # keys hold k / s (TurboQuant channel_scale: query): q * s, the row of the stream's KV head
        q_body = (q * body[0]["channel_scale"].float()[group][:, None, :]).contiguous()
    if kf.rotated:
        q_body = rotated_query(q_body, body[0])
    q_sketch = sketched_query(q_body, body[0]) if kf.qjl and not kf.split else zeros(1, torch.float32, device)  # (S, R, D)
    qjl_ptrs = qjl_pointers(body[0] if has_body and kf.qjl else None, zeros(1, torch.float32, device))
    acc_rot = torch.zeros_like(acc) if vf.rotated else zeros(1, torch.float32, device)
    k_constants, v_constants = side_constants(kf, d), side_constants(vf, d)
    chunked = ("BLC", "BL"), ("BDOC", "BDO"), ("BDRC", "BDR")
    if num_stages is None and any(c[a] < c[b] for c in (k_constants, v_constants) for a, b in chunked):
        # a latent basis or a split placement read per block in chunks (`body_lowrank.reconstruct`, `body_split`):
        # software pipelining would prefetch every chunk of the next block at once (head_dim 256: 380-680 KB of
        # shared memory); one stage keeps one chunk
        num_stages = 1
    fks, fvs, fg = float_scale_arguments(float_k, float_scales, d, zeros(1, torch.float32, device))
    _decode_partials[(s, splits)](
        q, q_body, q_sketch, float_k, float_v, fks, fvs, ftable, ftable.stride(0), float_len, btable, btable.stride(0), blen, group,
        *k_ptrs, k_srow, k_scol, *qjl_ptrs, *v_ptrs, v_srow, v_scol, *rope_args,
        m, l, acc, acc_rot, r, float(softcap or 0.0),
        D=d, BR=br, BD=bd, FBS=fbs, FG=fg, BS=bs, TT=tile or token_tile(bs, bd, kf.bits != 16 or vf.bits != 16), SPLITS=splits,
        HAS_BODY=has_body, SOFTCAP=bool(softcap), **rope_constants, **_prefixed(k_constants, "K_"),
        **_prefixed(v_constants, "V_"), K_QJL=kf.qjl, K_QSCALED=kf.query_scale, num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )
    if vf.rotated:
        fold_rotated_values(acc, acc_rot, body[1])
    return merge_partials(m, l, acc, q, new_k, new_v, softcap, sink_logits)


def float_scale_arguments(float_k: torch.Tensor, float_scales, d: int, dummy: torch.Tensor) -> tuple:
    """(key scales, value scales, FG) the kernels take for an int8 float pool's scales (channels per scale FG; FG = 0
    and placeholders for float pools)."""
    if float_scales is None:
        if float_k.dtype == torch.int8:
            raise ValueError("int8 float pools are read with their scales: pass float_scales")
        return dummy, dummy, 0
    key_scales, value_scales = float_scales
    return key_scales, value_scales, d // key_scales.shape[-1]


@triton.jit
def float_slot_scaled(k, v, ks_ptr, vs_ptr, slot, c, mask, D: tl.constexpr, FG: tl.constexpr):
    """Float-slot codes k, v (T, BD) float32 of flat slots ``slot`` (T,) times their float16 scales ((cap x FBS,
    D / FG) per pool, one per FG channels of a token)."""
    offs = slot[:, None].to(tl.int64) * (D // FG) + (c // FG)[None, :]
    k = k * tl.load(ks_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = v * tl.load(vs_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return k, v


def merge_partials(m, l, acc, q, new_k, new_v, softcap, sink_logits) -> torch.Tensor:
    """Pass 2: (S, R, D) float32 from the partials m, l (S, SPLITS, BR), acc (S, SPLITS, BR, BD) of q (S, R, D)
    contiguous float32, the new token and an optional learned sink logit per row."""
    s, r, d = q.shape
    splits, br, bd = acc.shape[1], acc.shape[2], acc.shape[3]
    out = torch.empty((s, r, d), device=q.device, dtype=torch.float32)
    sink = sink_logits.contiguous().float() if sink_logits is not None else zeros(1, torch.float32, q.device)
    # partials per load, (SC, BD) tiles: fixed per head_dim (masked past SPLITS), so a stream whose split count grows
    # with its context does not recompile the merge at every power of two
    chunk = max(1, MERGE_VALUES // bd)
    _merge_partials[(s, r)](
        m, l, acc, q, new_k.contiguous().float(), new_v.contiguous().float(), sink, out, r, float(softcap or 0.0),
        D=d, BR=br, BD=bd, SPLITS=splits, SC=chunk, HAS_SINK=sink_logits is not None, SOFTCAP=bool(softcap),
    )
    return out
