"""Perplexity through the real runtime.

Each window of T tokens is split into a prefill of P tokens, written into a
fresh cache in one forward, and a continuation that is decoded: token t is fed
alone (``chunk=1``, the default) and scores token t+1, attending to everything
before it *as the cache stores it*. With ``chunk=c > 1``, c tokens are fed per
forward: faster, but tokens of one chunk see each other uncompressed, which
hides damage, so results say ``exact_decoding: false``.

Scored tokens: positions P+1 .. T-1 of each window (T - P - 1 per window). The
prediction of token P comes from the prefill forward, where the prompt sees
itself uncompressed, so it is not scored.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Callable

import torch
import torch.nn.functional as F

from kvtool.capture import Progress, no_progress
from kvtool.errors import RuntimeConfigError
from kvtool.models.cache_argument import with_cache
from kvtool.models.logits_argument import last_logits_only


@dataclass(frozen=True)
class PerplexityResult:
    """Perplexity of the scored tokens and what the cache held at the end of each window."""

    ppl: float
    nll: float  # mean negative log-likelihood (nats per token)
    scored_tokens: int
    windows: int
    seq_len: int
    prefill: int
    chunk: int
    exact_decoding: bool
    cache_bytes: int  # bytes held after the last token of a batch of windows, summed over windows
    expected_cache_bytes: int
    reserved_cache_bytes: int  # bytes the cache's block pools had allocated at the end (>= cache_bytes)
    fp16_cache_bytes: int  # a 16-bit cache for the same tokens
    bits_per_element: float
    bytes_per_token: float  # cache bytes per token held (all layers, K and V)
    decode_tokens_per_s: float
    kept_fraction: float = 1.0  # tokens held / tokens seen at the end (eviction), averaged over windows
    # bytes held / a 16-bit cache's for the same tokens after every decode step, averaged over the steps and windows
    # (None: the cache does not count its bytes). Blocks freed whole (sliding windows, eviction) and the fp16 open
    # block make the bytes at one moment swing with their phase; this is the figure to compare recipes by.
    held_fraction_mean: float | None = None
    sparse_read_fraction: float = 1.0  # stored tokens decode steps read / tokens held (sparse attention)
    # (N, S) float32 NLL of every scored token, windows in order: for paired deltas (`kvtool.eval.paired_delta`)
    token_nll: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        """Every field but the per-token NLLs (JSON-able)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "token_nll"}


def _check_args(windows: torch.Tensor, prefill: int, chunk: int) -> None:
    t = windows.shape[1]
    if not 1 <= prefill <= t - 2:
        raise RuntimeConfigError(f"--prefill {prefill} must be between 1 and seq_len - 2 = {t - 2}")
    if chunk < 1:
        raise RuntimeConfigError(f"--chunk {chunk} must be >= 1")


@torch.no_grad()
def _score_batch(model, ids: torch.Tensor, caches: list, prefill: int, chunk: int,
                 on_steps: list | None = None) -> list[tuple[float, int, float, torch.Tensor, float | None]]:
    """Prefill then decode one batch of windows (b, T) into every cache, the caches taking turns step by step.

    Returns (sum NLL, scored tokens, decode seconds, per-token NLL (b, S), mean over the steps of the bytes held /
    a 16-bit cache's, or None where the cache does not count them) per cache. Decode step s
    runs for cache 0, then cache 1, ..., before step s + 1: the caches' timed steps meet the same
    machine load.
    """
    for cache in caches:
        model(input_ids=ids[:, :prefill], **with_cache(cache), use_cache=True, **last_logits_only(model))  # logits unread
    totals = [[0.0, 0, 0.0] for _ in caches]  # NLL, tokens, seconds
    held = [[] if hasattr(cache, "fp16_nbytes") else None for cache in caches]  # per cache: bytes held / 16-bit, per step
    per_token = [[] for _ in caches]  # per cache: (b, c) NLL per step
    last = ids.shape[1] - 1
    for start in range(prefill, last, chunk):
        end = min(start + chunk, last)
        targets = ids[:, start + 1 : end + 1]  # (b, c)
        for row, cache in enumerate(caches):
            step_start = time.perf_counter()
            logits = model(input_ids=ids[:, start:end], **with_cache(cache), use_cache=True).logits  # (b, c, V)
            token_nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")  # (b * c,)
            nll = token_nll.sum().item()
            seconds = time.perf_counter() - step_start
            per_token[row].append(token_nll.view(targets.shape).cpu())
            totals[row][0] += nll
            totals[row][1] += targets.numel()
            totals[row][2] += seconds
            if held[row] is not None:  # after the timed step: reading the bytes is not decoding
                held[row].append(cache.nbytes() / max(cache.fp16_nbytes(), 1))
            if on_steps is not None and on_steps[row] is not None:  # per-step progress and timing
                on_steps[row](targets.numel(), seconds)
    return [(*total, torch.cat(steps, dim=1), sum(h) / len(h) if h else None)
            for total, steps, h in zip(totals, per_token, held)]


def perplexity(
    model,
    windows: torch.Tensor,
    new_cache: Callable[[], object],
    *,
    prefill: int,
    chunk: int = 1,
    batch_size: int = 4,
    progress: Progress = no_progress,
    on_step: Callable[[int, float], None] | None = None,
) -> PerplexityResult:
    """Perplexity of windows (N, T) with caches from ``new_cache()`` (one per batch of windows).

    ``on_step(tokens, seconds)`` is called after every decode forward with the tokens it scored
    and the seconds it took (per-token progress bars, repeated timings).
    """
    (result,) = perplexities(model, windows, [new_cache], prefill=prefill, chunk=chunk, batch_size=batch_size,
                             progress=progress, on_steps=[on_step])
    return result


def perplexities(
    model,
    windows: torch.Tensor,
    new_caches: list[Callable[[], object]],
    *,
    prefill: int,
    chunk: int = 1,
    batch_size: int = 4,
    progress: Progress = no_progress,
    on_steps: list[Callable[[int, float], None] | None] | None = None,
) -> list[PerplexityResult]:
    """`perplexity` for several caches at once, interleaved step by step (`_score_batch`), so their speeds compare.

    Every cache sees the same windows, batches and steps; results come back in the order of ``new_caches``.
    """
    _check_args(windows, prefill, chunk)
    device = next(model.parameters()).device
    rows = [_Totals() for _ in new_caches]
    batches = windows.split(batch_size)
    for batch in progress(batches, "scoring through the cache", len(batches)):
        caches = [new_cache() for new_cache in new_caches]
        scored = _score_batch(model, batch.to(device), caches, prefill, chunk, on_steps)
        for totals, cache, (nll, count, seconds, token_nll, held) in zip(rows, caches, scored):
            totals.add(cache, nll, count, seconds, batch.shape[0], token_nll, held)
    return [totals.result(windows, prefill, chunk) for totals in rows]


class _Totals:
    """One cache's sums over batches of windows."""

    def __init__(self) -> None:
        self.nll = self.seconds = self.kept = 0.0
        self.count = self.held = self.expected = self.fp16 = self.reserved = 0
        self.tokens_read = self.tokens_held = 0
        self.token_nll: list[torch.Tensor] = []  # (b, S) per batch
        self.held_fraction: list[tuple[float, int]] | None = []  # (mean over a batch's steps, its windows)

    def add(self, cache, nll: float, count: int, seconds: float, windows: int, token_nll: torch.Tensor,
            held_fraction: float | None = None) -> None:
        self.nll, self.count, self.seconds = self.nll + nll, self.count + count, self.seconds + seconds
        self.token_nll.append(token_nll)
        if held_fraction is None:
            self.held_fraction = None
        elif self.held_fraction is not None:
            self.held_fraction.append((held_fraction, windows))
        self.held, self.expected = self.held + cache.nbytes(), self.expected + cache.expected_nbytes()
        self.fp16, self.reserved = self.fp16 + cache.fp16_nbytes(), self.reserved + cache.reserved_nbytes()
        self.kept += (cache.kept_fraction() if hasattr(cache, "kept_fraction") else 1.0) * windows
        context = getattr(cache, "context", None)
        if context is not None:
            self.tokens_read += context.sparse_read_tokens
            self.tokens_held += context.sparse_held_tokens

    def result(self, windows: torch.Tensor, prefill: int, chunk: int) -> PerplexityResult:
        mean = self.nll / self.count
        tokens_held = windows.shape[0] * (windows.shape[1] - 1)
        return PerplexityResult(
            ppl=math.exp(mean),
            nll=mean,
            scored_tokens=self.count,
            windows=windows.shape[0],
            seq_len=windows.shape[1],
            prefill=prefill,
            chunk=chunk,
            exact_decoding=chunk == 1,
            cache_bytes=self.held,
            expected_cache_bytes=self.expected,
            reserved_cache_bytes=self.reserved,
            fp16_cache_bytes=self.fp16,
            bits_per_element=16 * self.held / self.fp16,
            bytes_per_token=self.held / tokens_held,
            decode_tokens_per_s=self.count / self.seconds if self.seconds else 0.0,
            kept_fraction=self.kept / windows.shape[0],
            held_fraction_mean=(sum(f * n for f, n in self.held_fraction) / sum(n for _, n in self.held_fraction)
                                if self.held_fraction else None),
            sparse_read_fraction=self.tokens_read / self.tokens_held if self.tokens_held else 1.0,
            token_nll=torch.cat(self.token_nll),
        )
