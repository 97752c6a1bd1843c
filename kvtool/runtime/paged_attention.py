"""Attention over a layer's paged store, without rebuilding the float cache (the torch reference).

The queries of one forward attend to the tokens the store holds and to the new tokens of
this forward (which the store does not hold yet). Per stream (sequence, KV-head group):

    q (S, g, R, D) float32, R = G x t rows: the G query heads of each KV head, t new tokens
    stored tokens: walked chunk by chunk (`Chunk`), each at most a bounded number of
                   tokens per stream, read in its storage format (float blocks, or packed
                   codes through `BlockQuantizer.chunk_scores` / `chunk_values`)
    new tokens:    (S, g, t, D) float, with a per-sequence (t, t) causal/padding mask

GQA: the G query heads of a KV head are rows against that head's keys, which are read
once (never expanded). Softmax is online (flash-decoding): a running max ``m``, sum ``l``
and output ``acc`` per row, so temporaries are O(chunk), not O(tokens held). Policies
that score tokens by the attention they receive need the normalised probabilities:
`attend_scored` keeps one chunk's logits at a time twice over (max/sum pass, then the
output pass) and returns the attention each stored slot and each new token received,
summed over the rows of its stream (and over the last ``window`` query tokens).

Options per layer: attention-logit soft-capping (Gemma 2: ``cap * tanh(x / cap)``),
learned sink logits per query head (gpt-oss: an extra softmax term without a value) and
a sliding window (a stored token at position p is visible to a query at q when
p > q - window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

CHUNK_ELEMENTS = 1 << 20  # float32 elements of one chunk's largest temporary (4 MiB)
ROW_CHUNK = 512  # query rows per pass when all probabilities must be kept (scoring policies)


@dataclass
class Chunk:
    """A piece of the stored tokens of every stream.

    scores(q (S, g, R, D)) -> (S, g, R, C) float32 logits (q already scaled);
    values(p (S, g, R, C)) -> (S, g, R, D) float32; valid (S, C) bool;
    positions (S, C) int or None (needed for sliding windows); region/start locate it
    in the store for scores the caller accumulates.
    """

    scores: Callable[[torch.Tensor], torch.Tensor]
    values: Callable[[torch.Tensor], torch.Tensor]
    valid: torch.Tensor
    positions: torch.Tensor | None
    region: str
    start: int


@dataclass
class LayerOptions:
    """What the model's attention does beyond softmax(q k^T * scaling) v."""

    scaling: float
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # (H_q,) learned sink logits
    sliding_window: int | None = None


@dataclass
class Received:
    """Attention received per stored slot and per new token, summed over a stream's rows."""

    chunks: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)  # (region, start, (S, C))
    new: torch.Tensor | None = None  # (S, t)
    chunks_window: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)
    new_window: torch.Tensor | None = None


def chunk_tokens(streams: int, heads: int, rows: int, head_dim: int, block: int) -> int:
    """Tokens per stream per chunk: a multiple of ``block`` keeping temporaries near CHUNK_ELEMENTS."""
    per_token = streams * heads * max(rows, head_dim)
    return max(block, CHUNK_ELEMENTS // per_token // block * block)


def _logits(scores: torch.Tensor, options: LayerOptions) -> torch.Tensor:
    if options.softcap:
        scores = options.softcap * torch.tanh(scores / options.softcap)
    return scores


def _visible(chunk: Chunk, query_pos: torch.Tensor | None, options: LayerOptions, rows_shape) -> torch.Tensor:
    """(S, 1, R, C) or (S, 1, 1, C) bool: which stored tokens each row may see."""
    visible = chunk.valid[:, None, None, :]
    if options.sliding_window and chunk.positions is not None and query_pos is not None:
        window = chunk.positions[:, None, None, :] > query_pos[:, None, :, None] - options.sliding_window  # (S,1,R,C)
        visible = visible & window
    return visible


def new_token_logits(q: torch.Tensor, new_k: torch.Tensor, new_mask: torch.Tensor, options: LayerOptions):
    """Logits of rows against the new tokens (S, g, R, t) and their visibility (S, 1, R, t)."""
    logits = _logits(torch.matmul(q, new_k.transpose(-1, -2)), options)
    return logits, new_mask[:, None]


def attend(
    q: torch.Tensor,  # (S, g, R, D) float32, scaled
    new_k: torch.Tensor,  # (S, g, t, D) float32
    new_v: torch.Tensor,
    new_mask: torch.Tensor,  # (S, R, t) bool: row may see new token
    chunks: Iterator[Chunk],
    options: LayerOptions,
    query_pos: torch.Tensor | None = None,  # (S, R) positions of each row's token
    sink_logits: torch.Tensor | None = None,  # (S, g, R)
) -> torch.Tensor:
    """Online-softmax attention of the rows over stored chunks and the new tokens: (S, g, R, D) float32."""
    s, g, r, d = q.shape
    m = torch.full((s, g, r, 1), -math.inf, device=q.device)
    l = torch.zeros((s, g, r, 1), device=q.device)
    acc = torch.zeros((s, g, r, d), device=q.device)
    if sink_logits is not None:
        m, l = sink_logits[..., None].clone(), torch.ones_like(l)

    def update(logits, visible, values):
        nonlocal m, l, acc
        logits = logits.masked_fill(~visible, -math.inf)
        m_new = torch.maximum(m, logits.amax(dim=-1, keepdim=True))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(logits - safe)
        correction = torch.exp(m - safe)
        l = l * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + values(p)
        m = m_new

    for chunk in chunks:
        update(_logits(chunk.scores(q), options), _visible(chunk, query_pos, options, (s, g, r)), chunk.values)
    logits, visible = new_token_logits(q, new_k, new_mask, options)
    update(logits, visible, lambda p: torch.matmul(p, new_v))
    return acc / l.clamp(min=1e-30)


def attend_scored(
    q: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    new_mask: torch.Tensor,
    chunks: Callable[[], Iterator[Chunk]],
    options: LayerOptions,
    window_rows: torch.Tensor | None = None,  # (R,) bool: rows of the last ``window`` query tokens
    query_pos: torch.Tensor | None = None,
    sink_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Received]:
    """Attention with normalised probabilities: output (S, g, R, D) and the attention every token received.

    Two passes per block of rows: the first finds each row's max and sum (online), the second
    forms the probabilities chunk by chunk, accumulates the output and sums them per token.
    Logits of the first pass are kept for the second when they are small (decoding), else the
    second pass recomputes them, so memory stays O(chunk).
    """
    s, g, r, d = q.shape
    out = torch.empty((s, g, r, d), device=q.device)
    totals: dict[tuple[str, int], torch.Tensor] = {}
    totals_window: dict[tuple[str, int], torch.Tensor] = {}
    new_total = torch.zeros(s, new_k.shape[2], device=q.device)
    new_window = torch.zeros_like(new_total)
    for lo in range(0, r, ROW_CHUNK):
        hi = min(r, lo + ROW_CHUNK)
        qr, mask_r = q[:, :, lo:hi], new_mask[:, lo:hi]
        pos_r = None if query_pos is None else query_pos[:, lo:hi]
        m = torch.full((s, g, hi - lo, 1), -math.inf, device=q.device)
        l = torch.zeros_like(m)
        if sink_logits is not None:
            m, l = sink_logits[:, :, lo:hi, None].clone(), torch.ones_like(l)
        kept, kept_elements = [], 0

        def masked_logits(chunk):
            logits = _logits(chunk.scores(qr), options)
            return logits.masked_fill(~_visible(chunk, pos_r, options, None), -math.inf)

        def absorb(logits):
            nonlocal m, l
            m_new = torch.maximum(m, logits.amax(dim=-1, keepdim=True))
            safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            l = l * torch.exp(m - safe) + torch.exp(logits - safe).sum(dim=-1, keepdim=True)
            m = m_new

        for chunk in chunks():  # pass 1: row maxima and sums
            logits = masked_logits(chunk)
            absorb(logits)
            kept_elements += logits.numel()
            kept.append(logits if kept_elements <= CHUNK_ELEMENTS else None)
        new_logits, new_visible = new_token_logits(qr, new_k, mask_r, options)
        new_logits = new_logits.masked_fill(~new_visible, -math.inf)
        absorb(new_logits)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        inv = 1.0 / l.clamp(min=1e-30)
        p_new = torch.exp(new_logits - m) * inv
        acc = torch.matmul(p_new, new_v)
        in_window = None if window_rows is None else window_rows[lo:hi].to(q.dtype)[None, None, :, None]
        for chunk, logits in zip(chunks(), kept):  # pass 2: probabilities, output, received
            p = torch.exp((masked_logits(chunk) if logits is None else logits) - m) * inv
            acc = acc + chunk.values(p)
            key = (chunk.region, chunk.start)
            totals[key] = totals.get(key, 0) + p.sum(dim=(1, 2))
            if in_window is not None:
                totals_window[key] = totals_window.get(key, 0) + (p * in_window).sum(dim=(1, 2))
        new_total += p_new.sum(dim=(1, 2))
        if in_window is not None:
            new_window += (p_new * in_window).sum(dim=(1, 2))
        out[:, :, lo:hi] = acc
    received = Received(chunks=[(region, start, t) for (region, start), t in totals.items()], new=new_total)
    if window_rows is not None:
        received.chunks_window = [(region, start, t) for (region, start), t in totals_window.items()]
        received.new_window = new_window
    return out, received
