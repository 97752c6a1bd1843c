"""Rank search for Palu: error-versus-rank curves and a joint allocation across layers and K/V.

`error_curve` measures, for one layer's K (or V), the (Fisher-weighted) squared
reconstruction error when every head group keeps r = 0..g*D basis columns.
`gradient_curve` measures the squared first-order loss change instead: each dropped basis
coordinate's value times the loss gradient's projection on that basis vector.
`allocate_ranks` spends a budget of kept dimensions across all (layer, part) keys,
greedily where the curves drop most ("fisher", "gradient") or the same fraction everywhere ("uniform").

Why ``gradient``: per-element Fisher weights ``g_i^2`` (KVQuant's diagonal) are blind to
direction. The loss gradient of a pre-RoPE key lies in the span of the (rotated) queries
that attend to it, the gradient of a value in the span of the output gradients, so error in
a direction the gradient is orthogonal to costs nothing, yet the diagonal weights charge
it the full ``sum_i g_i^2 e_i^2``. Projecting on the gradient (``(c_j a_j)^2`` per basis
coordinate j, `gradient_curve`) keeps that direction; RoPE is handled exactly because the
gradient is taken w.r.t. the pre-RoPE keys the cache stores. Measured at 50% kept
(whitened, per KV head, 16-bit latents; benchmarks/RESULTS.md "Palu rank allocation"):
perplexity delta uniform / fisher / gradient +17.4% / +23.1% / +14.3% on SmolLM2-135M,
+7.3% / +7.3% / +6.3% on Gemma-3-270M; the gradient search moves rank from keys to values.
It is not a sure win: at 30% reduction on Gemma-3-270M it lost to uniform ranks on the
test windows (+1.5% vs +0.9%) and won on held-out valid ones, and neither curve models the
quantization error of low-bit latents (3-bit + Hadamard: the gradient search lost to
uniform ranks on SmolLM2-135M).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Mapping

import torch

from kvtool.methods.lowrank.decompose import to_groups

_CHUNK_ELEMENTS = 1 << 23  # float32 elements per temporary of the weighted curve (32 MiB)


def error_curve(
    bases: torch.Tensor,
    samples: torch.Tensor,
    weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    exact: bool = False,
) -> torch.Tensor:
    """Error of keeping r = 0..g*D columns of every group's basis: (g*D + 1,) float64.

    bases: (G, g*D, g*D) orthonormal; samples, weights: (N, H, D); bias: (H*D,) / (G, g*D) / None.
    ``curve[r] = (1/N) * sum_{n, groups, i} w_{n,i} (x - x_hat_r)_{n,i}^2`` with
    ``x_hat_r = (x - b) U_r U_r^T + b`` (w = 1 without weights): the squared error per token,
    summed over the layer's groups (comparable across layers sampled with different N).

    With coordinates ``c = (x - b) U`` the residual is ``R_r = sum_{j >= r} c_j u_j^T`` and
    ``curve[r] = (1/N) sum_{j, k >= r} M_jk``, ``M_jk = sum_n c_nj c_nk sum_i w_ni U_ij U_ik``.
    Per-element Fisher weights in the original coordinates make M non-diagonal, so the error is
    not separable by coordinate. Default (``exact=False``): the diagonal of M only,
    ``curve[r] = (1/N) sum_{j >= r} sum_n c_nj^2 (w_n . U_:j^2)`` (one GEMM, a reverse cumsum).
    This is exact without weights, with weights constant per token and group (any basis), and
    with weights constant per coordinate across tokens when the basis decorrelates the samples
    (``sum_n c_nj c_nk = 0``, true of the sample-moment/whitened basis on its own samples).
    ``exact=True`` builds every residual ``R_r = R_{r+1} + c_r u_r^T`` (O(N * H*D * g*D)
    memory traffic; seconds to minutes per layer on a CPU) - for checks and small layers.
    Always non-increasing without weights.
    """
    groups, width, cols = bases.shape
    x = to_groups(samples.detach().float().cpu(), groups)  # (N, G, gD)
    n = x.shape[0]
    if x.shape[2] != width:
        raise ValueError(f"samples {tuple(samples.shape)} do not match bases {tuple(bases.shape)}")
    if cols != width:
        raise ValueError(f"error_curve needs the full square bases (G, {width}, {width}); got {tuple(bases.shape)}")
    u = bases.detach().float().cpu()
    b = torch.zeros(groups, width) if bias is None else bias.detach().float().cpu().reshape(groups, width)
    centred = x - b
    coords = torch.einsum("ngi,gij->ngj", centred, u)  # (N, G, gD)
    w = None
    if weights is not None:
        w = to_groups(weights.detach().float().cpu(), groups)
        if w.shape != x.shape:
            raise ValueError(f"weights {tuple(weights.shape)} do not match samples {tuple(samples.shape)}")
    if w is None or not exact:
        energy = coords.double().square()  # (N, G, gD)
        if w is not None:
            energy = energy * torch.einsum("ngi,gij->ngj", w.double(), u.double().square())
        per_coord = energy.sum(dim=(0, 1))  # (gD,) diagonal of M
        tail = torch.flip(torch.cumsum(torch.flip(per_coord, [0]), 0), [0])  # tail[r] = sum_{j >= r}
        return torch.cat([tail, tail.new_zeros(1)]) / n
    curve = torch.zeros(width + 1, dtype=torch.float64)
    residual = centred - torch.einsum("ngj,gij->ngi", coords, u)  # full-rank residual (~0)
    curve[width] = (w * residual.square()).sum(dtype=torch.float64)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, n * groups * width))
    hi = width
    while hi > 0:
        lo = max(0, hi - chunk)
        # parts[:, :, k] = c_{lo+k} u_{lo+k}^T, (N, G, k, gD); residual at rank r = residual_hi + sum_{j=r}^{hi-1} parts_j
        parts = coords[:, :, lo:hi, None] * u[:, :, lo:hi].transpose(1, 2)[None]
        steps = torch.flip(torch.cumsum(torch.flip(parts, [2]), 2), [2]) + residual[:, :, None, :]
        curve[lo:hi] = (w[:, :, None, :] * steps.square()).sum(dim=(0, 1, 3), dtype=torch.float64)
        residual = steps[:, :, 0]
        hi = lo
    return curve / n


def gradient_curve(
    bases: torch.Tensor,
    samples: torch.Tensor,
    gradients: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """First-order loss change of keeping r = 0..g*D columns of every group's basis: (g*D + 1,) float64.

    bases: (G, g*D, g*D) orthonormal; samples, gradients (signed dL/dx of the same tokens): (N, H, D);
    bias: (H*D,) / (G, g*D) / None. With coordinates ``c = (x - b) U`` and gradient projections
    ``a = g U`` (both (N, G, gD)), dropping coordinate j of token n changes the loss by
    ``-c_nj a_nj`` to first order, and

        ``curve[r] = (1/N) sum_{n, groups} sum_{j >= r} (c_nj a_nj)^2``

    - the per-token empirical Fisher block ``g g^T`` applied to the truncation error, keeping
    its diagonal in the basis (the cross terms between coordinates, products of different
    coordinates' loss changes, are left out so the curve is non-increasing). Unlike
    `error_curve`'s per-element weights ``g_i^2``, it sees direction: error along a basis vector
    the gradient is orthogonal to costs nothing (for pre-RoPE keys the gradient lies in the span
    of the RoPE-rotated queries that attend to the key).
    """
    groups, width, cols = bases.shape
    if cols != width:
        raise ValueError(f"gradient_curve needs the full square bases (G, {width}, {width}); got {tuple(bases.shape)}")
    if gradients.shape != samples.shape:
        raise ValueError(f"gradients {tuple(gradients.shape)} do not match samples {tuple(samples.shape)}")
    x = to_groups(samples.detach().float().cpu(), groups)  # (N, G, gD)
    g = to_groups(gradients.detach().float().cpu(), groups)  # (N, G, gD)
    if x.shape[2] != width:
        raise ValueError(f"samples {tuple(samples.shape)} do not match bases {tuple(bases.shape)}")
    u = bases.detach().float().cpu()
    b = torch.zeros(groups, width) if bias is None else bias.detach().float().cpu().reshape(groups, width)
    coords = torch.einsum("ngi,gij->ngj", x - b, u)  # (N, G, gD)
    slopes = torch.einsum("ngi,gij->ngj", g, u)  # (N, G, gD)
    per_coord = (coords.double() * slopes.double()).square().sum(dim=(0, 1))  # (gD,)
    tail = torch.flip(torch.cumsum(torch.flip(per_coord, [0]), 0), [0])  # tail[r] = sum_{j >= r}
    return torch.cat([tail, tail.new_zeros(1)]) / x.shape[0]


def _half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def allocate_ranks(
    curves: Mapping[Hashable, torch.Tensor],
    fraction: float | Mapping[Hashable, float],
    mode: str,
    costs: Mapping[Hashable, int] | None = None,
) -> dict[Hashable, int]:
    """Rank (per group) for every key, 1 <= rank <= full = len(curve) - 1.

    curves: key -> (full + 1,) error when keeping r = 0..full dims (`error_curve`);
    fraction: target kept fraction, one for all keys or per key; costs: key -> kept numbers
    per token per unit of rank (the key's number of head groups G; default 1).

    * ``uniform``: rank = round(fraction * full) (half up), clamped to [1, full].
    * ``fisher`` or ``gradient`` (the same greedy search; the modes differ in the curves `fit_palu`
      builds): budget = round(sum_k fraction_k * cost_k * full_k) kept numbers per token;
      every key starts at rank 1, then one rank at a time goes to the key whose curve drops
      most per unit cost for it (ties: the key earliest in ``curves``), until the budget is
      spent. With equal costs the budget is hit exactly (unless it is below one rank per key
      or above everything); with unequal costs it stops when no affordable step is left.
    """
    if mode not in ("fisher", "gradient", "uniform"):
        raise ValueError(f"rank allocation mode must be 'fisher', 'gradient' or 'uniform', got {mode!r}")
    keys = list(curves)
    full = {k: int(curves[k].numel()) - 1 for k in keys}
    for k in keys:
        if full[k] < 1:
            raise ValueError(f"curve of {k!r} needs at least 2 points (ranks 0 and 1)")
    frac = {k: float(fraction[k] if isinstance(fraction, Mapping) else fraction) for k in keys}
    for k, f in frac.items():
        if not 0 < f <= 1:
            raise ValueError(f"rank fraction of {k!r} must be in (0, 1], got {f}")
    cost = {k: int(costs[k]) if costs is not None else 1 for k in keys}
    if mode == "uniform":
        return {k: min(full[k], max(1, _half_up(frac[k] * full[k]))) for k in keys}
    budget = _half_up(sum(frac[k] * cost[k] * full[k] for k in keys))
    ranks = {k: 1 for k in keys}
    left = budget - sum(cost.values())
    values = {k: curves[k].detach().double().cpu().tolist() for k in keys}
    heap = [(-(values[k][1] - values[k][2]) / cost[k], i, k) for i, k in enumerate(keys) if full[k] > 1]
    heapq.heapify(heap)
    while heap and left > 0:
        _, i, k = heapq.heappop(heap)
        if cost[k] > left:
            continue  # the budget only shrinks: this key cannot grow any more
        ranks[k] += 1
        left -= cost[k]
        r = ranks[k]
        if r < full[k]:
            heapq.heappush(heap, (-(values[k][r] - values[k][r + 1]) / cost[k], i, k))
    return ranks
