"""Calibrated (static) ranges shared by `fp8` and `int_static`: amax or MSE-optimal clipping.

`kvtool calibrate` streams every calibration token through a `RangeStats` observer
(`kvtool.calibration`), which keeps per layer, KV head and channel the running min and
max of keys (after RoPE, or before with ``pre_rope``) and values past the sink tokens,
plus a bounded random sample of token rows. A static method reduces them to its
granularity:

* ``layer``:   one range per layer      -> tensors of shape (1, 1)
* ``head``:    one range per KV head    -> (H_kv, 1)
* ``channel``: one per KV head, channel -> (H_kv, D)

``scale_fit: mse`` then shrinks each range by the clip ratio r in `CLIP_RATIOS` whose
quantize-dequantize round trip has the least squared error on the sample (r = 1 is
the plain range, so MSE never does worse than amax on the sample).
"""

from __future__ import annotations

from typing import Callable

import torch

from kvtool.errors import ArtifactError

CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(21))  # 1.0, 0.975, ..., 0.5


def reduce_range(lo: torch.Tensor, hi: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (H, D) min/max -> the granularity's (1, 1), (H, 1) or (H, D) min/max."""
    if granularity == "channel":
        return lo, hi
    if granularity == "head":
        return lo.amin(dim=-1, keepdim=True), hi.amax(dim=-1, keepdim=True)
    return lo.amin().reshape(1, 1), hi.amax().reshape(1, 1)


def reduce_error(err: torch.Tensor, granularity: str) -> torch.Tensor:
    """Squared errors (N, H, D) -> summed at the granularity's shape."""
    if granularity == "channel":
        return err.sum(dim=0)
    if granularity == "head":
        return err.sum(dim=(0, 2))[:, None]
    return err.sum().reshape(1, 1)


def mse_clip(
    lo: torch.Tensor,
    hi: torch.Tensor,
    samples: torch.Tensor,
    granularity: str,
    roundtrip: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shrink each range about its midpoint by the clip ratio with the least squared error on ``samples``.

    lo, hi: granularity-shaped ranges; samples (N, H, D) float32; roundtrip(x, lo, hi) quantizes and
    dequantizes x (N, H, D) with ranges broadcast against (H, D).
    """
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best_err = best_lo = best_hi = None
    for ratio in CLIP_RATIOS:
        c_lo, c_hi = mid - ratio * half, mid + ratio * half
        err = reduce_error((roundtrip(samples, c_lo, c_hi) - samples).square(), granularity)
        if best_err is None:
            best_err, best_lo, best_hi = err, c_lo.expand_as(err).clone(), c_hi.expand_as(err).clone()
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo = torch.where(better, c_lo.expand_as(err), best_lo)
        best_hi = torch.where(better, c_hi.expand_as(err), best_hi)
    return best_lo, best_hi


def per_block(table: torch.Tensor, group: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Granularity-shaped table (1 or H, 1 or D) -> (N, 1, 1 or D): the row of each block's KV head."""
    table = table.to(device)
    rows = table[group.to(device)] if table.shape[0] > 1 else table.expand(group.numel(), -1)
    return rows[:, None, :]


def require_fitted(fitted: dict[str, torch.Tensor], names: tuple[str, ...], method: str, path: str, head_dim: int) -> None:
    """A clear error when a static method is used without (or with a mismatched) calibration."""
    missing = [name for name in names if name not in fitted]
    if missing:
        raise ArtifactError(
            f"the {method} method with static scales needs calibrated tensors ({', '.join(missing)}) for '{path}' but "
            f"none were given: run kvtool calibrate with this recipe and use the artifact it writes"
        )
    for name in names:
        t = fitted[name]
        if t.dim() != 2 or t.shape[-1] not in (1, head_dim):
            raise ArtifactError(
                f"{method} tensor '{path}.{name}' has shape {tuple(t.shape)}, expected (1 or H_kv, 1 or {head_dim}): "
                "the artifact is for another model or recipe; run kvtool calibrate again"
            )


def check_heads(table: torch.Tensor, num_kv_heads: int, method: str, path: str) -> None:
    if table.shape[0] not in (1, num_kv_heads):
        raise ArtifactError(
            f"{method} scales for '{path}' cover {table.shape[0]} KV heads, the model has {num_kv_heads}: "
            "the artifact is for another model; run kvtool calibrate again"
        )
