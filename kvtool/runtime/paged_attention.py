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

# float32 elements of one chunk's largest temporary (8 MiB). On CPU a chunk costs ~30 tensor operations per
# layer whatever its size, so fewer, larger chunks decode faster (SmolLM2-135M at 8K: one chunk instead of two,
# 1.36 -> 1.17 ms per layer at 2 threads); the bound keeps temporaries O(chunk), not O(tokens held).
CHUNK_ELEMENTS = 1 << 21
ROW_CHUNK = 512  # query rows per pass when all probabilities must be kept (scoring policies)
REUSE_ELEMENTS = 1 << 22  # stored tokens x D a scored pass keeps read for its second pass (16 MiB)


@dataclass
class Chunk:
    """A piece of the stored tokens of every stream.

    scores(q (S, g, R, D)) -> (S, g, R, C) float32 logits (q already scaled);
    values(p (S, g, R, C)) -> (S, g, R, D) float32; valid (S, C) bool, or None when every
    slot holds a token;
    positions (S, C) int or None (needed for sliding windows); region/start locate it
    in the store for scores the caller accumulates; floats() -> keys, values (S, g, C, D)
    float32, the chunk decoded once (keys in the query's domain), for forwards of many rows
    (`prefill_attention.attend_many`).
    """

    scores: Callable[[torch.Tensor], torch.Tensor]
    values: Callable[[torch.Tensor], torch.Tensor]
    valid: torch.Tensor | None
    positions: torch.Tensor | None
    region: str
    start: int
    floats: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None


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
    observer: object | None = None  # the policy's window observer (CAKE, PyramidInfer), fed every probability block


def chunk_tokens(streams: int, heads: int, rows: int, head_dim: int, block: int) -> int:
    """Tokens per stream per chunk: a multiple of ``block`` keeping temporaries near CHUNK_ELEMENTS."""
    per_token = streams * heads * max(rows, head_dim)
    return max(block, CHUNK_ELEMENTS // per_token // block * block)


def _logits(scores: torch.Tensor, options: LayerOptions) -> torch.Tensor:
    if options.softcap:
        scores = options.softcap * torch.tanh(scores / options.softcap)
    return scores


def chunk_visibility(chunk: Chunk, query_pos, options: LayerOptions) -> torch.Tensor | None:
    """(S, 1, 1 or R, C) bool: which stored tokens of the chunk each row may see, or None for all."""
    visible = None if chunk.valid is None else chunk.valid[:, None, None, :]
    if options.sliding_window and chunk.positions is not None and query_pos is not None:
        window = chunk.positions[:, None, None, :] > query_pos[:, None, :, None] - options.sliding_window  # (S,1,R,C)
        visible = window if visible is None else visible & window
    return visible


def _masked_logits(chunk: Chunk, q: torch.Tensor, query_pos, options: LayerOptions) -> torch.Tensor:
    """(S, g, R, C) logits of the rows against a stored chunk, -inf where a row may not see a token."""
    logits = _logits(chunk.scores(q), options)
    visible = chunk_visibility(chunk, query_pos, options)
    return logits if visible is None else logits.masked_fill(~visible, -math.inf)


def _new_logits(q, new_k, new_mask, options) -> torch.Tensor:
    """(S, g, R, t) logits of the rows against the new tokens, -inf where masked."""
    logits = _logits(torch.matmul(q, new_k.transpose(-1, -2)), options)
    return logits.masked_fill(~new_mask[:, None], -math.inf)


class OnlineSoftmax:
    """Running max, sum and output per row; absorbs groups of logit pieces at once."""

    def __init__(self, shape, device, sink_logits: torch.Tensor | None) -> None:
        s, g, r, d = shape
        self.m = torch.full((s, g, r, 1), -math.inf, device=device)
        self.l = torch.zeros((s, g, r, 1), device=device)
        self.acc = torch.zeros((s, g, r, d), device=device)
        self.fresh = sink_logits is None  # no term absorbed yet
        if sink_logits is not None:  # a learned sink: one more softmax term, with no value
            self.m, self.l = sink_logits[..., None].clone(), torch.ones_like(self.l)

    def absorb(self, pieces: list[tuple[torch.Tensor, Callable]]) -> None:
        """pieces: (logits (S, g, R, C_i), values(p (S, g, R, C_i)) -> (S, g, R, D))."""
        logits = pieces[0][0] if len(pieces) == 1 else torch.cat([p[0] for p in pieces], dim=-1)
        if self.fresh:  # the first update (a decode step's only one): nothing to correct
            m_new = logits.amax(dim=-1, keepdim=True)
            p = torch.exp(logits - m_new.nan_to_num(0.0, neginf=0.0))  # rows that see nothing: all 0
            self.l = p.sum(dim=-1, keepdim=True)
            self.fresh = False
        else:
            m_new = torch.maximum(self.m, logits.amax(dim=-1, keepdim=True))
            safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = torch.exp(logits - safe)
            correction = torch.exp(self.m - safe)
            self.l = self.l * correction + p.sum(dim=-1, keepdim=True)
            self.acc = self.acc * correction
        offset = 0
        for piece, values in pieces:
            width = piece.shape[-1]
            self.acc = self.acc + values(p[..., offset : offset + width])
            offset += width
        self.m = m_new

    def result(self) -> torch.Tensor:
        return self.acc / self.l.clamp(min=1e-30)


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
    """Online-softmax attention of the rows over stored chunks and the new tokens: (S, g, R, D) float32.

    Chunks are absorbed in groups whose logits stay under CHUNK_ELEMENTS (one softmax update
    per group), so a decode step over a short cache is one update, a long one a few.
    """
    state = OnlineSoftmax(q.shape, q.device, sink_logits)
    pending, elements = [], 0
    for chunk in chunks:
        logits = _masked_logits(chunk, q, query_pos, options)
        pending.append((logits, chunk.values))
        elements += logits.numel()
        if elements >= CHUNK_ELEMENTS:
            state.absorb(pending)
            pending, elements = [], 0
    pending.append((_new_logits(q, new_k, new_mask, options), lambda p: torch.matmul(p, new_v)))
    state.absorb(pending)
    return state.result()


def attend_stored(
    q: torch.Tensor,  # (S, g, R, D) float32, scaled
    chunks: Iterator[Chunk],
    options: LayerOptions,
    sink_logits: torch.Tensor | None = None,  # (S, g, R)
    scored: bool = False,
) -> tuple[torch.Tensor, list[tuple[str, int, torch.Tensor]] | None]:
    """Attention of a decode step whose new token is already in the store: (S, g, R, D) float32, and with
    ``scored`` the attention every stored slot received, summed over its stream's rows [(region, start, (S, C))].

    One softmax over every chunk's logits at once (the caller makes sure they are few: S x g x R x tokens
    held under CHUNK_ELEMENTS, and what the chunks' values hold until then under REUSE_ELEMENTS); no
    new-token piece, no running max: the short path of `attend`. Every row sees at least its own token,
    so no row is empty.
    """
    # (values, region, start, logits) per chunk: a chunk's keys are freed once its logits exist
    pieces = [(chunk.values, chunk.region, chunk.start, _masked_logits(chunk, q, None, options)) for chunk in chunks]
    logits = pieces[0][3] if len(pieces) == 1 else torch.cat([piece[3] for piece in pieces], dim=-1)
    if sink_logits is not None:  # a learned sink: one more softmax term, with no value
        logits = torch.cat([logits, sink_logits[..., None]], dim=-1)
    p = torch.softmax(logits, dim=-1)
    out, offset, received = None, 0, [] if scored else None
    for values, region, start, piece in pieces:
        width = piece.shape[-1]
        p_chunk = p if len(pieces) == 1 and sink_logits is None else p[..., offset : offset + width]
        part = values(p_chunk)
        out = part if out is None else out + part
        if scored:
            received.append((region, start, p_chunk.sum(dim=(1, 2))))
        offset += width
    return out, received


def any_stream(rows: torch.Tensor) -> torch.Tensor:
    """(R,) bool: the rows in the window of any stream, from window rows (R,) or per stream (S, R)."""
    return rows.any(dim=0) if rows.dim() == 2 else rows


def row_runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """(lo, hi) of every run of consecutive True entries of ``rows`` (R,) bool: the window rows of each query head."""
    edges = torch.diff(rows.to(torch.int8), prepend=rows.new_zeros(1, dtype=torch.int8), append=rows.new_zeros(1, dtype=torch.int8))
    starts, ends = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends))


class ReceivedTally:
    """Sums, per stream, the probabilities each stored slot and each new token receive, block of rows by block of
    rows (and over the rows of the last ``window`` query tokens; the policy's observer sees every block).

    all_rows False: only the window rows' sums are kept (the blocks then hold window rows only); `received` has no
    all-rows sums (``chunks`` empty, ``new`` zeros)."""

    def __init__(self, s: int, t: int, device, window_rows: torch.Tensor | None, observe, all_rows: bool = True) -> None:
        self.totals: dict[tuple[str, int], torch.Tensor] = {}
        self.totals_window: dict[tuple[str, int], torch.Tensor] = {}
        self.new = torch.zeros(s, t, device=device)
        self.new_window = torch.zeros_like(self.new)
        self.window_rows, self.observe, self.all_rows = window_rows, observe, all_rows
        # window_rows (R,) bool, or (S, R) bool: each stream its own window (rows past it count 0 there)
        self.stream_rows = window_rows.float() if window_rows is not None and window_rows.dim() == 2 else None  # (S, R)
        self.window_runs = None if window_rows is None else row_runs(any_stream(window_rows))  # [(lo, hi)] one per query head

    def _window_sum(self, p: torch.Tensor, lo: int, hi: int) -> torch.Tensor | None:
        """(S, C) sum of p (S, g, hi - lo, C) over its rows that are window rows, or None when it has none."""
        total = None
        for run_lo, run_hi in self.window_runs or ():
            a, b = max(lo, run_lo), min(hi, run_hi)
            if a < b:
                rows = p[:, :, a - lo : b - lo]  # (S, g, b - a, C)
                if self.stream_rows is not None:
                    rows = rows * self.stream_rows[:, None, a:b, None]
                part = rows.sum(dim=(1, 2))
                total = part if total is None else total + part
        return total

    def add(self, chunk: Chunk, p: torch.Tensor, lo: int, hi: int) -> None:
        """p (S, g, hi - lo, C): rows lo..hi against a stored chunk."""
        key = (chunk.region, chunk.start)
        if self.all_rows:
            self.totals[key] = self.totals.get(key, 0) + p.sum(dim=(1, 2))
        if self.observe is not None:
            self.observe(chunk.region, chunk.start, p, lo, hi)
        in_window = self._window_sum(p, lo, hi)
        if in_window is not None:
            self.totals_window[key] = self.totals_window.get(key, 0) + in_window

    def add_new(self, p_new: torch.Tensor, lo: int, hi: int) -> None:
        """p_new (S, g, hi - lo, w): rows lo..hi against the first w <= t new tokens (the rows see none after them)."""
        w = p_new.shape[-1]
        if self.all_rows:
            self.new[:, :w] += p_new.sum(dim=(1, 2))
        if self.observe is not None:
            padded = p_new if w == self.new.shape[1] else torch.nn.functional.pad(p_new, (0, self.new.shape[1] - w))
            self.observe("new", 0, padded, lo, hi)  # (S, g, hi - lo, t)
        in_window = self._window_sum(p_new, lo, hi)
        if in_window is not None:
            self.new_window[:, :w] += in_window

    def received(self) -> Received:
        out = Received(chunks=[(region, start, t) for (region, start), t in self.totals.items()], new=self.new, observer=self.observe)
        if self.window_rows is not None:
            out.chunks_window = [(region, start, t) for (region, start), t in self.totals_window.items()]
            out.new_window = self.new_window
        return out


def attend_scored(
    q: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    new_mask: torch.Tensor,
    chunks: Callable[[], Iterator[Chunk]],
    options: LayerOptions,
    window_rows: torch.Tensor | None = None,  # (R,) or (S, R) bool: rows of the last ``window`` query tokens (per stream)
    query_pos: torch.Tensor | None = None,
    sink_logits: torch.Tensor | None = None,
    observe=None,  # policy hook: observe(region, start, p (S, g, rows lo:hi, C), lo, hi) for stored chunks and "new"
) -> tuple[torch.Tensor, Received]:
    """Attention with normalised probabilities: output (S, g, R, D) and the attention every token received.

    Two passes per block of rows: the first finds each row's max and sum (online), the second
    forms the probabilities chunk by chunk, accumulates the output and sums them per token.
    Logits of the first pass are kept for the second when they are small (decoding), else the
    second pass recomputes them, so memory stays O(chunk); the chunks read by the first pass are
    kept for the second while they stay under REUSE_ELEMENTS (a decode step reads the store once).
    """
    s, g, r, d = q.shape
    out = torch.empty((s, g, r, d), device=q.device)
    tally = ReceivedTally(s, new_k.shape[2], q.device, window_rows, observe)
    for lo in range(0, r, ROW_CHUNK):
        hi = min(r, lo + ROW_CHUNK)
        qr, mask_r = q[:, :, lo:hi], new_mask[:, lo:hi]
        pos_r = None if query_pos is None else query_pos[:, lo:hi]
        sink_r = None if sink_logits is None else sink_logits[:, :, lo:hi]
        kept, held, elements, held_elements = [], [], 0, 0
        for chunk in chunks():  # pass 1: logits (kept while small), chunks read (kept while small)
            logits = _masked_logits(chunk, qr, pos_r, options)
            elements += logits.numel()
            kept.append(logits if elements <= CHUNK_ELEMENTS else None)
            held_elements += s * g * logits.shape[-1] * d
            held.append(chunk if held_elements <= REUSE_ELEMENTS else None)
        second = held if all(c is not None for c in held) else None  # decoding: pass 2 reads nothing again
        new_logits = _new_logits(qr, new_k, mask_r, options)
        m, l = _max_and_sum([x for x in kept if x is not None] + [new_logits], sink_r)
        if any(x is None for x in kept):  # large: the maxima of the chunks not kept, chunk by chunk
            m, l = _rescan(chunks(), kept, qr, pos_r, options, m, l)
        inv = 1.0 / l.clamp(min=1e-30)
        p_new = torch.exp(new_logits - m) * inv
        acc = torch.matmul(p_new, new_v)
        for chunk, logits in zip(chunks() if second is None else second, kept):  # pass 2: probabilities, output, received
            p = torch.exp((_masked_logits(chunk, qr, pos_r, options) if logits is None else logits) - m) * inv
            acc = acc + chunk.values(p)
            tally.add(chunk, p, lo, hi)
        tally.add_new(p_new, lo, hi)
        out[:, :, lo:hi] = acc
    return out, tally.received()


def _max_and_sum(pieces: list[torch.Tensor], sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max and sum of exp over logit pieces (S, g, R, C_i) (and a sink logit (S, g, R))."""
    logits = torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]
    m = logits.amax(dim=-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink[..., None])
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    l = torch.exp(logits - m).sum(dim=-1, keepdim=True)
    if sink is not None:
        l = l + torch.exp(sink[..., None] - m)
    return m, l


def _rescan(chunks, kept, q, query_pos, options, m, l):
    """Fold the chunks whose logits were not kept into the running (max, sum)."""
    for chunk, logits in zip(chunks, kept):
        if logits is not None:
            continue
        logits = _masked_logits(chunk, q, query_pos, options)
        m_new = torch.maximum(m, logits.amax(dim=-1, keepdim=True))
        m_new = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        l = l * torch.exp(m - m_new) + torch.exp(logits - m_new).sum(dim=-1, keepdim=True)
        m = m_new
    return m, l
