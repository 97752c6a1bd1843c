"""How sure a perplexity delta is: a paired confidence interval over the same scored tokens.

Two caches scored on the same windows give per-token negative log-likelihoods ``base`` and
``other``, both (N, S): N windows, S scored tokens each, in text order. The perplexity ratio is
``exp(mean(other - base))``. The differences of neighbouring tokens are correlated (one bad
eviction hurts the next few predictions), so the standard error comes from *batch means*: each
window's differences are cut into contiguous blocks of ``block_tokens`` and the blocks, not the
tokens, are treated as independent (ratio estimator of the mean, since the last block of a
window may be shorter). The interval is normal at 95% (z = 1.96), mapped through ``exp`` to
percent, so it is asymmetric around the delta like the ratio it describes.

Read a delta whose interval straddles a target as "not resolved by these tokens", not as met.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtool.errors import RuntimeConfigError

BLOCK_TOKENS = 32  # tokens per batch-means block: longer than the correlation of per-token damage seen in practice
Z_95 = 1.959963984540054


@dataclass(frozen=True)
class PairedDelta:
    """Perplexity change of ``other`` against ``base`` in percent, with its interval."""

    delta_pct: float
    low_pct: float | None  # None with fewer than two blocks: no interval
    high_pct: float | None
    blocks: int
    block_tokens: int
    scored_tokens: int

    def to_dict(self) -> dict:
        return {"delta_pct": self.delta_pct, "delta_ci95_pct": None if self.low_pct is None else [self.low_pct, self.high_pct],
                "delta_blocks": self.blocks, "delta_block_tokens": self.block_tokens}


def paired_delta(base: torch.Tensor, other: torch.Tensor, block_tokens: int = BLOCK_TOKENS) -> PairedDelta:
    """Paired delta of per-token NLLs ``other`` against ``base``, both (N, S) over the same tokens."""
    if base.shape != other.shape or base.dim() != 2:
        raise RuntimeConfigError(f"paired perplexity needs the same (windows, tokens) scored twice; got {tuple(base.shape)} "
                                 f"and {tuple(other.shape)}: score both caches on the same windows, prefill and chunk")
    if base.numel() == 0:
        raise RuntimeConfigError("paired perplexity got no scored tokens: use longer windows or a shorter prefill")
    if block_tokens < 1:
        raise RuntimeConfigError(f"block_tokens {block_tokens} must be >= 1")
    diff = other.double() - base.double()  # (N, S)
    starts = range(0, diff.shape[1], block_tokens)
    sums = torch.stack([diff[:, s : s + block_tokens].sum(dim=1) for s in starts], dim=1).flatten()  # (N * B,)
    counts = torch.tensor([min(block_tokens, diff.shape[1] - s) for s in starts], dtype=torch.float64).repeat(diff.shape[0])
    mean = sums.sum().item() / counts.sum().item()
    percent = lambda nats: 100 * math.expm1(nats)  # noqa: E731
    blocks = sums.numel()
    if blocks < 2:
        return PairedDelta(percent(mean), None, None, blocks, block_tokens, diff.numel())
    residual = sums - mean * counts  # (N * B,)
    se = math.sqrt(blocks / (blocks - 1) * (residual**2).sum().item()) / counts.sum().item()
    return PairedDelta(percent(mean), percent(mean - Z_95 * se), percent(mean + Z_95 * se), blocks, block_tokens, diff.numel())
