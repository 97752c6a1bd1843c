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
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kvtool.capture import Progress, no_progress
from kvtool.errors import RuntimeConfigError


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

    def to_dict(self) -> dict:
        return asdict(self)


def _check_args(windows: torch.Tensor, prefill: int, chunk: int) -> None:
    t = windows.shape[1]
    if not 1 <= prefill <= t - 2:
        raise RuntimeConfigError(f"--prefill {prefill} must be between 1 and seq_len - 2 = {t - 2}")
    if chunk < 1:
        raise RuntimeConfigError(f"--chunk {chunk} must be >= 1")


@torch.no_grad()
def _score_batch(model, ids: torch.Tensor, cache, prefill: int, chunk: int, on_step=None) -> tuple[float, int, float]:
    """Prefill then decode one batch of windows (b, T); return (sum NLL, scored tokens, decode seconds)."""
    model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True)
    total, count, start_time = 0.0, 0, time.perf_counter()
    last = ids.shape[1] - 1
    for start in range(prefill, last, chunk):
        step_start = time.perf_counter()
        end = min(start + chunk, last)
        logits = model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True).logits  # (b, c, V)
        targets = ids[:, start + 1 : end + 1]  # (b, c)
        total += F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum").item()
        count += targets.numel()
        if on_step is not None:  # per-step progress and timing (kvtool.eval.ppl_report)
            on_step(targets.numel(), time.perf_counter() - step_start)
    return total, count, time.perf_counter() - start_time


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
    _check_args(windows, prefill, chunk)
    device = next(model.parameters()).device
    nll = seconds = kept = 0.0
    count = held = expected = fp16 = reserved = 0
    batches = windows.split(batch_size)
    for batch in progress(batches, "scoring through the cache", len(batches)):
        cache = new_cache()
        batch_nll, batch_count, batch_seconds = _score_batch(model, batch.to(device), cache, prefill, chunk, on_step)
        nll, count, seconds = nll + batch_nll, count + batch_count, seconds + batch_seconds
        held, expected, fp16 = held + cache.nbytes(), expected + cache.expected_nbytes(), fp16 + cache.fp16_nbytes()
        reserved += cache.reserved_nbytes()
        kept += (cache.kept_fraction() if hasattr(cache, "kept_fraction") else 1.0) * batch.shape[0]
    mean = nll / count
    tokens_held = windows.shape[0] * (windows.shape[1] - 1)
    return PerplexityResult(
        ppl=math.exp(mean),
        nll=mean,
        scored_tokens=count,
        windows=windows.shape[0],
        seq_len=windows.shape[1],
        prefill=prefill,
        chunk=chunk,
        exact_decoding=chunk == 1,
        cache_bytes=held,
        expected_cache_bytes=expected,
        reserved_cache_bytes=reserved,
        fp16_cache_bytes=fp16,
        bits_per_element=16 * held / fp16,
        bytes_per_token=held / tokens_held,
        decode_tokens_per_s=count / seconds if seconds else 0.0,
        kept_fraction=kept / windows.shape[0],
    )
