"""Dense-and-sparse split (KVQuant): the few elements that would stretch a quantization range are kept sparse.

Per block of one (sequence, head) stream, exactly ``k = ceil(f * S * D)`` elements with
the largest outlier score are stored as (position, fp16 value) pairs; the dense rest is
quantized with a tight range. Positions are flat token-major indices ``s * D + d``
stored in int16 as ``index - 32768``, so a block may hold up to 65536 elements.
"""

from __future__ import annotations

import math

import torch

INDEX_OFFSET = 32768
MAX_BLOCK_ELEMENTS = 65536  # flat indices 0..65535 fit int16 after the offset
_EPS = 1e-6


def outlier_count(fraction: float, numel: int) -> int:
    """k = ceil(fraction * numel), 0 for fraction 0 (rounded first so 0.01 * 3200 is 32, not 33)."""
    if fraction <= 0:
        return 0
    return min(numel, math.ceil(round(fraction * numel, 6)))


def encode_index(index: torch.Tensor) -> torch.Tensor:
    """Flat indices in [0, 65536) -> int16 storage."""
    return (index.to(torch.int32) - INDEX_OFFSET).to(torch.int16)


def decode_index(stored: torch.Tensor) -> torch.Tensor:
    """int16 storage -> flat int64 indices."""
    return stored.to(torch.int64) + INDEX_OFFSET


def top_outliers(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest scores along the last dim: (sorted flat indices (..., k) int64, mask like ``score``)."""
    index = score.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    mask = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, index, True)
    return index, mask


def token_zscore(grouped: torch.Tensor) -> torch.Tensor:
    """|x - mean| / (std + eps) within the last dim (a token's group of channels)."""
    deviation = grouped - grouped.mean(dim=-1, keepdim=True)
    std = deviation.square().mean(dim=-1, keepdim=True).sqrt()  # population std (no warning on empty blocks)
    return deviation.abs() / (std + _EPS)


def dense_range(grouped: torch.Tensor, outlier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) over the last dim of the non-outlier elements; (0, 0) for a group that is all outliers."""
    lo = grouped.masked_fill(outlier, math.inf).amin(dim=-1)
    hi = grouped.masked_fill(outlier, -math.inf).amax(dim=-1)
    empty = ~torch.isfinite(lo)
    return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)


def scatter_outliers(flat: torch.Tensor, stored_index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Write the sparse values into ``flat`` (..., S*D) at their stored positions (in place) and return it."""
    return flat.scatter_(-1, decode_index(stored_index), values.to(flat.dtype))
