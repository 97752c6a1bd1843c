"""Attention of a forward of many new tokens (prefill) over the store: fused SDPA per chunk, merged by log-sum-exp.

A prefill chunk of t tokens has R = G x t query rows per stream, many more than a block has
tokens: the algebra of `paged_attention.attend` (logits per chunk, an online softmax in
Python-level tensor ops) then costs far more than the stored tokens' decoding. Here every
stored chunk is decoded once to a float temporary (`Chunk.floats`: (S, g, C, D), at most
CHUNK_ELEMENTS elements) and handed to torch's fused CPU attention kernel (the flash kernel
`scaled_dot_product_attention` runs on CPU, called as the aten op because the public function
does not return the log-sum-exp), which returns the normalised output and each row's
log-sum-exp; the new tokens attend to themselves the same
way (causal, or their (t, t) mask), with the query heads of a sequence as SDPA heads. The
pieces are merged exactly (an online softmax over (output, log-sum-exp) pairs):

    m = max(m, lse_i),  l = l e^(m_old - m) + e^(lse_i - m),  acc = acc e^(m_old - m) + out_i e^(lse_i - m)

and the result is acc / l. A row that sees nothing in a piece gets lse = -inf there (the
kernel reports 0 for such rows). Learned sink logits (gpt-oss) are one more term without a
value, as in `OnlineSoftmax`. Soft-capping cannot be expressed to the kernel: those layers,
and devices without the kernel, keep `attend` (`covers`).

Policies that score tokens by the attention they receive (`attend_many_scored`) get the
probabilities in a second walk over the store, ``p = exp(logit - lse)`` with the merged
log-sum-exp: no max/sum pass, no value contraction (`paged_attention.attend_scored` needs both).
Each stored chunk is decoded once more and its probabilities are formed a few rows at a time
(PROBABILITY_ELEMENTS: the block stays in cache while it is formed, exponentiated in place and
summed), against the new tokens only up to the last one the rows may see (causal: half of
them on average). Only the rows the policy reads are formed: every row for the all-query sum
(`StreamView.attention`), or only the last ``window`` query tokens' rows for policies that read
nothing else of a forward of many tokens (TOVA, RocketKV: `EvictionPolicy.attention_from`).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch

from kvtool.runtime.paged_attention import (
    Chunk, LayerOptions, OnlineSoftmax, Received, ReceivedTally, any_stream, chunk_visibility, row_runs,
)

PROBABILITY_ELEMENTS = 1 << 18  # float32 elements of one block of probabilities (1 MiB: formed and summed in cache)
MIN_ROWS = 32  # rows per block of probabilities at least (a matmul of fewer rows runs slowly)

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def covers(q: torch.Tensor, t: int, options: LayerOptions) -> bool:
    """This forward's attention may take `attend_many`: several new tokens, as many rows per stream as a
    head has channels (fewer rows: the chunk algebra reads less), no soft-capping, on CPU."""
    rows, head_dim = q.shape[2], q.shape[3]
    return _FLASH is not None and q.device.type == "cpu" and t > 1 and rows >= head_dim and options.softcap is None


class LseMerge(OnlineSoftmax):
    """Exact merge of attention pieces given as (normalised output, log-sum-exp) per row: `OnlineSoftmax`'s state
    (running max m, sum l, output acc; a learned sink as one more term), each piece one weighted term."""

    def absorb(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """out (S, g, R, D) normalised over the piece, lse (S, g, R) (-inf: the row saw nothing in it)."""
        lse = lse[..., None]
        m_new = torch.maximum(self.m, lse)
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        old, new = torch.exp(self.m - safe), torch.exp(lse - safe)  # (S, g, R, 1)
        self.acc = self.acc * old + out * new
        self.l = self.l * old + new
        self.m = m_new


def _flash(q, k, v, additive_mask=None, causal=False) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention (B, H, L, D) x (B, H, C, D), q already scaled: (out (B, H, L, D), lse (B, H, L)).

    The kernel does not check shapes (mismatched heads crash the process): checked here. The mask is float,
    broadcastable to (B, H, L, C)."""
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3] or k.shape[3] != q.shape[3]:
        raise ValueError(f"fused attention needs q, k, v of the same (B, H) and D; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    return _FLASH(q, k, v, is_causal=causal, attn_mask=additive_mask, scale=1.0)


def _additive(visible: torch.Tensor) -> torch.Tensor:
    """bool visibility -> float32 additive mask (0 where visible, -inf elsewhere)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, -math.inf)


def _stored_piece(q: torch.Tensor, chunk: Chunk, query_pos, options: LayerOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the rows q (S, g, R, D) over one stored chunk: (out (S, g, R, D), lse (S, g, R))."""
    k, v = chunk.floats()  # (S, g, C, D) float32: the KV head read once by its G query heads (rows)
    visible = chunk_visibility(chunk, query_pos, options)
    if visible is None:
        return _flash(q, k, v)
    out, lse = _flash(q, k, v, _additive(visible))
    seen = visible.any(dim=-1)  # (S, 1, 1 or R)
    return out, lse.masked_fill(~seen, -math.inf)


def _new_piece(q, new_k, new_v, new_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the rows q (S, g, R, D), R = G x t, over the new tokens (S, g, t, D): (out, lse) as `_stored_piece`.

    new_mask (B, t, t) bool per sequence (S = B x streams per sequence), or None for plain causal attention."""
    s, g, r, d = q.shape
    t = new_k.shape[2]
    heads = g * (r // t)  # query heads per stream
    expand = lambda x: x[:, :, None].expand(s, g, r // t, t, d).reshape(s, heads, t, d)  # noqa: E731  (S, g G, t, D)
    k, v = expand(new_k), expand(new_v)
    if new_mask is None:
        out, lse = _flash(q.reshape(s, heads, t, d), k, v, causal=True)  # every row sees at least itself
        return out.reshape(s, g, r, d), lse.reshape(s, g, r)
    b = new_mask.shape[0]
    per_sequence = s * heads // b  # query heads of a sequence: its streams' heads, sequence-major
    out, lse = _flash(
        q.reshape(b, per_sequence, t, d), k.reshape(b, per_sequence, t, d), v.reshape(b, per_sequence, t, d),
        _additive(new_mask[:, None]),
    )
    lse = lse.masked_fill(~new_mask.any(dim=-1)[:, None], -math.inf)  # padding rows see no new token
    return out.reshape(s, g, r, d), lse.reshape(s, g, r)


def _fused_rows(q: torch.Tensor, options: LayerOptions) -> int:
    """Rows to size the fused pass's chunks for: the decoded K/V bound them, unless a sliding window needs an
    (S, 1, R, C) mask per chunk."""
    return q.shape[2] if options.sliding_window else 1


def _merged(q, new_k, new_v, new_mask, chunks, options, query_pos, sink_logits) -> LseMerge:
    merged = LseMerge(q.shape, q.device, sink_logits)
    for chunk in chunks:
        merged.absorb(*_stored_piece(q, chunk, query_pos, options))
    merged.absorb(*_new_piece(q, new_k, new_v, new_mask))
    return merged


def attend_many(
    q: torch.Tensor,  # (S, g, R, D) float32, scaled; R = G x t rows, head-major
    new_k: torch.Tensor,  # (S, g, t, D) float32
    new_v: torch.Tensor,
    new_mask: torch.Tensor | None,  # (B, t, t) bool: new token i may see new token j; None: plain causal
    chunks: Callable[[int], Iterator[Chunk]],  # the store's chunks, sized for this many rows
    options: LayerOptions,
    query_pos: torch.Tensor | None = None,  # (S, R) positions of each row's token (sliding windows)
    sink_logits: torch.Tensor | None = None,  # (S, g, R)
) -> torch.Tensor:
    """Attention of many rows over the stored chunks and the new tokens: (S, g, R, D) float32, equal to
    `paged_attention.attend` up to float rounding (see the module docstring)."""
    return _merged(q, new_k, new_v, new_mask, chunks(_fused_rows(q, options)), options, query_pos, sink_logits).result()


def attend_many_scored(
    q: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    new_mask: torch.Tensor | None,
    stream_mask: torch.Tensor,  # (S, R, t) bool: row may see new token (new_mask per stream row)
    chunks: Callable[[int], Iterator[Chunk]],
    options: LayerOptions,
    window_rows: torch.Tensor | None = None,  # (R,) or (S, R) bool: rows of the last ``window`` query tokens (per stream)
    query_pos: torch.Tensor | None = None,
    sink_logits: torch.Tensor | None = None,
    observe=None,  # the policy's observer, as for `paged_attention.attend_scored`
    all_rows: bool = True,  # False: only the window rows' sums (`Received.chunks` empty, `Received.new` zeros)
) -> tuple[torch.Tensor, Received]:
    """`attend_many` plus the attention every stored slot and new token received (as `attend_scored`).

    The fused pass gives the output and each row's log-sum-exp, so the probabilities come in one more walk
    over the store, ``p = exp(logit - lse)`` (`_tally_received`): no max/sum pass and no value contraction.
    Without ``all_rows`` only the window rows are formed (and the observer sees only those)."""
    if not all_rows and window_rows is None:
        raise ValueError("attend_many_scored: all_rows=False needs window_rows (the rows whose sums are kept)")
    s, g, r, _ = q.shape
    merged = _merged(q, new_k, new_v, new_mask, chunks(_fused_rows(q, options)), options, query_pos, sink_logits)
    lse = merged.m + torch.log(merged.l)  # (S, g, R, 1), -inf for a row that saw nothing (its logits are all -inf)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    tally = ReceivedTally(s, new_k.shape[2], q.device, window_rows, observe, all_rows)
    spans = [(0, r)] if all_rows else row_runs(any_stream(window_rows))  # the rows whose probabilities are formed
    _tally_received(tally, q, lse, spans, new_k, new_mask, stream_mask, chunks(_fused_rows(q, options)), options, query_pos)
    return merged.result(), tally.received()


def _row_blocks(spans: list[tuple[int, int]], rows: int) -> Iterator[tuple[int, int]]:
    """(lo, hi) blocks of at most ``rows`` rows covering the spans."""
    for lo, hi in spans:
        for start in range(lo, hi, rows):
            yield start, min(hi, start + rows)


def _new_extent(new_mask: torch.Tensor | None, r: int, t: int) -> list[int]:
    """Per row (head-major: its token is row % t), 1 + the last new token it may see in any sequence (0: none).

    new_mask (B, t, t) bool, or None for plain causal attention (token i sees tokens 0..i)."""
    if new_mask is None:
        per_token = list(range(1, t + 1))
    else:
        last = torch.arange(1, t + 1, dtype=torch.int32, device=new_mask.device).masked_fill(~new_mask.any(dim=0), 0)
        per_token = last.amax(dim=1).tolist()  # (t,)
    return [per_token[row % t] for row in range(r)]


def _tally_received(tally: ReceivedTally, q, lse, spans, new_k, new_mask, stream_mask, chunks: Iterator[Chunk], options,
                    query_pos) -> None:
    """Add to ``tally`` the probabilities ``exp(logit - lse)`` of the rows in ``spans`` over every stored chunk (each
    decoded once) and over the new tokens, in blocks of rows of about PROBABILITY_ELEMENTS.

    q (S, g, R, D) scaled, lse (S, g, R, 1) the merged log-sum-exp (0 for rows that see nothing: their logits are
    -inf), new_mask (B, t, t) or None (plain causal), stream_mask (S, R, t) the same per stream row. No soft-capping
    (`covers`)."""
    s, g = q.shape[:2]
    for chunk in chunks:
        keys_t = chunk.floats()[0].transpose(-1, -2)  # (S, g, D, C)
        rows = max(MIN_ROWS, PROBABILITY_ELEMENTS // (s * g * keys_t.shape[-1]))
        for lo, hi in _row_blocks(spans, rows):
            logits = torch.matmul(q[:, :, lo:hi], keys_t)  # (S, g, rows, C)
            visible = chunk_visibility(chunk, None if query_pos is None else query_pos[:, lo:hi], options)
            if visible is not None:
                logits.masked_fill_(~visible, -math.inf)
            tally.add(chunk, logits.sub_(lse[:, :, lo:hi]).exp_(), lo, hi)
    t = new_k.shape[2]
    extent = _new_extent(new_mask, q.shape[2], t)
    rows = max(MIN_ROWS, PROBABILITY_ELEMENTS // (s * g * t))
    for lo, hi in _row_blocks(spans, rows):
        w = max(extent[lo:hi])  # the rows see none of the new tokens after the w-th (causal: the last row's token + 1)
        if w == 0:
            continue
        logits = torch.matmul(q[:, :, lo:hi], new_k[:, :, :w].transpose(-1, -2))  # (S, g, rows, w)
        logits.masked_fill_(~stream_mask[:, None, lo:hi, :w], -math.inf)
        tally.add_new(logits.sub_(lse[:, :, lo:hi]).exp_(), lo, hi)
