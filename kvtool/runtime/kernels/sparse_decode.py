"""Triton decode attention over a chosen subset of the float slots (RocketKV's stage 2 read).

The torch path (`KvtoolLayer._sparse_chunks` over `paged_attention.attend`) is the reference.
Per stream (one sequence x one KV head): R query rows (the GQA group's query heads, already
multiplied by the softmax scale) attend to the float-pool slots `slots` (S, K) lists (flat slot
ids ``block * FBS + offset``, as `LayerStore.float_slot_ids` gives them) where `valid` (S, K) is
set, and to the step's own new token. The selection itself (which summary groups; torch) costs
one read of the key summaries; this kernel then reads only the chosen keys and values, in place.

Pass 1 (`_sparse_partials`): grid (S, SPLITS); program (s, p) walks tiles p, p + SPLITS, ... of
``TILE`` listed slots with an online softmax (and, for ``unread: estimate``, sums the keys and
values it reads). Pass 2 is the dense kernel's `merge_partials` (the new token, a learned sink
logit, the partials); the unread tokens' estimate (`kvtool.methods.sparse.rocketkv.unread_term`,
from those sums, or `unread_blocks_term`, from the store's block sums alone, computed before the kernel
runs) joins it as one more partial: max = its logit, sum = 1, output = its value.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from kvtool.runtime.kernels.decode_attention import (
    _absorb, float_scale_arguments, float_slot_scaled, merge_partials, query_rows, splits_for, store_partials, stream_rows,
    zeros,
)

TILE = 16  # listed slots per online-softmax update


@triton.jit
def _sparse_partials(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slot_ptr, valid_ptr, K, m_out, l_out, acc_out, ksum_out, vsum_out, R, softcap,
    D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, FG: tl.constexpr, TILE: tl.constexpr, SPLITS, SOFTCAP: tl.constexpr,
    SUM_READ: tl.constexpr,
):
    s = tl.program_id(0)
    split = tl.program_id(1)
    q, r, c, cmask, m, l, acc = stream_rows(q_ptr, s, R, D, BR, BD)
    t = tl.arange(0, TILE)
    ksum = tl.zeros((BD,), tl.float32)
    vsum = tl.zeros((BD,), tl.float32)
    for tile in range(split, tl.cdiv(K, TILE), SPLITS):
        j = tile * TILE + t  # (TILE,) positions in the stream's list
        inside = j < K
        slot = tl.load(slot_ptr + s * K + j, mask=inside, other=0).to(tl.int64)
        valid = tl.load(valid_ptr + s * K + j, mask=inside, other=0) != 0
        kv_mask = valid[:, None] & cmask[None, :]
        offs = slot[:, None] * D + c[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)  # (TILE, BD)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        if FG > 0:  # int8 slots: codes times their scales
            k, v = float_slot_scaled(k, v, ks_ptr, vs_ptr, slot, c, kv_mask, D, FG)
        m, l, acc = _absorb(q, k, v, valid, m, l, acc, SOFTCAP, softcap)
        if SUM_READ:
            ksum += tl.sum(k, axis=0)  # invalid slots loaded as 0
            vsum += tl.sum(v, axis=0)
    store_partials(m_out, l_out, acc_out, s, split, r, c, m, l, acc, BR, BD, SPLITS)
    if SUM_READ:
        tl.store(ksum_out + (s * SPLITS + split) * BD + c, ksum)
        tl.store(vsum_out + (s * SPLITS + split) * BD + c, vsum)


def sparse_decode_attention(
    q: torch.Tensor,  # (S, R, D) float32, already multiplied by the softmax scale
    new_k: torch.Tensor,  # (S, D) float32: this step's token, attended to by every row
    new_v: torch.Tensor,  # (S, D) float32
    float_k: torch.Tensor,  # (cap * FBS, D) float pool keys, one head per stream, flat per slot
    float_v: torch.Tensor,
    slots: torch.Tensor,  # (S, K) int64 flat slot ids to read
    valid: torch.Tensor,  # (S, K) bool: the listed slot holds a token this step reads
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,  # (S, R) learned sink logits
    splits: int | None = None,
    unread: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    | tuple[torch.Tensor, torch.Tensor] | None = None,
    float_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8 float pools: (key, value) (cap * FBS, D / G)
) -> torch.Tensor:
    """Attention output (S, R, D) float32 of one decode step over the listed slots and the new token.

    unread (``sparse_attention.unread: estimate``): (sum of the keys read (S, D), of the values read (S, D)) ->
    (logit (S, R), value (S, D)) of one more softmax term standing for the held tokens not listed (-inf: none); or
    (``unread: estimate_blocks``) that term itself, (logit (S, R), value (S, R, D)), known before the kernel runs."""
    s, r, d = q.shape
    device = q.device
    q = q.contiguous().float()
    k_count = slots.shape[1]
    br, bd = query_rows(r), triton.next_power_of_2(d)
    splits = splits or splits_for(s, triton.cdiv(max(k_count, 1), TILE))
    m = torch.empty((s, splits, br), device=device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty((s, splits, br, bd), device=device, dtype=torch.float32)
    slot_list = slots.contiguous() if k_count else zeros(s, torch.int64, device)[:, None]
    valid_list = valid.to(torch.int8).contiguous() if k_count else zeros(s, torch.int8, device)[:, None]
    sum_read = callable(unread)
    sums = torch.empty((2, s, splits, bd), device=device, dtype=torch.float32) if sum_read else m[None]
    fks, fvs, fg = float_scale_arguments(float_k, float_scales, d, m)
    _sparse_partials[(s, splits)](
        q, float_k, float_v, fks, fvs, slot_list, valid_list, slot_list.shape[1], m, l, acc, sums[0], sums[-1], r,
        float(softcap or 0.0), D=d, BR=br, BD=bd, FG=fg, TILE=TILE, SPLITS=splits, SOFTCAP=bool(softcap),
        SUM_READ=sum_read,
    )
    if sum_read:
        read = sums.sum(dim=2)[..., :d]  # (2, S, D): keys and values read
        m, l, acc = _with_term(m, l, acc, *unread(read[0], read[1]), r, d)
    elif unread is not None:
        m, l, acc = _with_term(m, l, acc, *unread, r, d)
    return merge_partials(m, l, acc, q, new_k, new_v, softcap, sink_logits)


def _with_term(m, l, acc, logit: torch.Tensor, value: torch.Tensor, r: int, d: int):
    """The partials (S, SPLITS, BR[, BD]) and one more, a single term: max = logit (S, R), sum = 1, output = value (S, D)
    (the same for every row) or (S, R, D)."""
    s, _, br, bd = acc.shape
    m_extra = torch.full((s, 1, br), float("-inf"), device=m.device)
    m_extra[:, 0, :r] = logit.float()
    acc_extra = torch.zeros((s, 1, br, bd), device=m.device)
    acc_extra[:, 0, :r, :d] = value.float()[:, None, :] if value.dim() == 2 else value.float()
    l_extra = torch.ones((s, 1, br), device=m.device)
    return (torch.cat([m, m_extra], dim=1).contiguous(), torch.cat([l, l_extra], dim=1).contiguous(),
            torch.cat([acc, acc_extra], dim=1).contiguous())
