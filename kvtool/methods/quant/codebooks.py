"""Codebooks of non-uniform quantization (KVQuant's nuq), all in the normalised domain [-1, 1].

A codebook is a sorted float32 vector of ``2**bits`` reconstruction levels shared by
every head and channel of one layer. A normalised value is encoded as the index of
its nearest level (`nearest_codes`) and decoded by a table lookup.

Kinds (``QuantSpec.codebook``):

* ``uniform``: evenly spaced levels from -1 to 1;
* ``nf``: normal-float: quantiles of N(0, 1) at evenly spaced probabilities, scaled
  so the extreme levels are -1 and 1;
* ``kmeans``: 1-D k-means (scikit-learn) of the normalised calibration samples,
  run on a fine weighted histogram of them (8192 bins over [-1, 1]) so the fit costs
  milliseconds whatever the sample count, and is deterministic (``random_state=0``);
* ``fisher-kmeans``: the same, each sample weighted by its Fisher sensitivity.

Q-Norm (`qnorm_correct`) then shifts and scales the levels so that dequantized
calibration samples (each at its nearest *corrected* level, as the encoder does) keep
the samples' (weighted) mean and standard deviation.
"""

from __future__ import annotations

import math
import warnings

import torch

HISTOGRAM_BINS = 8192  # k-means runs on a weighted histogram of [-1, 1]: bin width 2.4e-4, any sample count
KMEANS_INITS = 10
MAX_QNORM_SAMPLES = 100_000  # Q-Norm's search quantizes this many samples (deterministic subsample)
QNORM_FIXED_POINT = 8  # one-step moment matches before the pattern search
QNORM_STEPS = 40  # pattern-search iterations (4 quantizations each)


def uniform_codebook(bits: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 2**bits, dtype=torch.float32)


def nf_codebook(bits: int) -> torch.Tensor:
    n = 2**bits
    delta = 0.5 / n
    probs = torch.linspace(delta, 1.0 - delta, n, dtype=torch.float64)
    levels = torch.distributions.Normal(0.0, 1.0).icdf(probs)
    return (levels / levels.abs().max()).to(torch.float32)


def nearest_codes(xn: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index (int64) of the nearest codebook level for every element of ``xn`` (ties go to the lower level)."""
    codebook = codebook.to(device=xn.device, dtype=torch.float32)
    boundaries = (codebook[1:] + codebook[:-1]) / 2
    return torch.bucketize(xn.float().contiguous(), boundaries)


def lookup(codebook: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """codebook (L,) levels, codes (...) integer indices -> (...) levels: the decode table lookup.

    ``index_select`` on the flat codes: on CPU about 7x faster than ``codebook[codes.long()]`` (advanced indexing)
    for the (blocks, tokens, channels) code tensors of a decode step, with the same values.
    """
    return codebook.index_select(0, codes.reshape(-1).int()).view(codes.shape)


def _histogram(values: torch.Tensor, weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D samples in [-1, 1] -> (weighted mean position, total weight) of each non-empty bin.

    k-means on these points equals k-means on the samples up to the bin width (only a
    cluster boundary falling inside a bin can differ), at a cost independent of the count.
    """
    x = values.double()
    w = torch.ones_like(x) if weights is None else weights.double()
    bins = ((x.clamp(-1, 1) + 1) * (HISTOGRAM_BINS / 2)).long().clamp_(0, HISTOGRAM_BINS - 1)
    mass = torch.zeros(HISTOGRAM_BINS, dtype=torch.float64).index_add_(0, bins, w)
    moment = torch.zeros(HISTOGRAM_BINS, dtype=torch.float64).index_add_(0, bins, w * x)
    used = mass > 0
    return moment[used] / mass[used], mass[used]


def kmeans_codebook(values: torch.Tensor, bits: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted (weighted) k-means centroids of 1-D ``values`` in [-1, 1]; uniform if there is too little data."""
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning
    from threadpoolctl import threadpool_limits

    n = 2**bits
    values = values.detach().float().flatten().cpu().clamp(-1, 1)
    if weights is not None:
        weights = weights.detach().float().flatten().cpu()
        if not torch.isfinite(weights).all() or weights.sum() <= 0:
            weights = None
    points, mass = _histogram(values, weights)
    if points.numel() < n:
        return uniform_codebook(bits)
    model = KMeans(n_clusters=n, n_init=KMEANS_INITS, random_state=0)
    with warnings.catch_warnings(), threadpool_limits(1):  # a few thousand points: threads only cost
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(points.numpy().reshape(-1, 1), sample_weight=(mass / mass.mean()).numpy())
    centroids = torch.from_numpy(model.cluster_centers_.reshape(-1)).to(torch.float32)
    return centroids.sort().values


def qnorm_correct(codebook: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Affine correction ``a * codebook + b`` so quantize-dequantize of ``values`` keeps their (weighted) mean and std.

    The encoder assigns each value to the nearest level of the *corrected* codebook, so the
    one-step moment match (made with the old codebook's assignments) is only the start: a
    pattern search over (log a, b) then minimises the relative moment mismatch under
    nearest-level assignment (it is piecewise constant, so no gradients). Exact on smooth
    data; on lumpy data (mass on a few values) the best reachable match.
    """
    x = values.detach().float().flatten().cpu()
    w = torch.ones_like(x) if weights is None else weights.detach().float().flatten().cpu()
    if not torch.isfinite(w).all() or w.sum() <= 0:
        w = torch.ones_like(x)
    if x.numel() > MAX_QNORM_SAMPLES:
        keep = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))[:MAX_QNORM_SAMPLES]
        x, w = x[keep], w[keep]
    w = (w / w.sum()).double()
    mean_x = (w * x.double()).sum().item()
    std_x = (w * (x.double() - mean_x).square()).sum().sqrt().item()
    base = codebook.double()
    if x.numel() < 2 or std_x <= 1e-9 or (base[-1] - base[0]).item() <= 1e-9:
        return codebook

    def moments(log_a: float, b: float) -> tuple[float, float]:
        levels = (math.exp(log_a) * base + b).float()
        q = levels[nearest_codes(x, levels)].double()
        mean = (w * q).sum()
        return mean.item(), (w * (q - mean).square()).sum().sqrt().item()

    def mismatch(point: tuple[float, float]) -> float:
        mean, std = moments(*point)
        return ((mean - mean_x) / std_x) ** 2 + ((std - std_x) / std_x) ** 2

    # Fixed-point iterations of the one-step match (re-assigning each time), then a pattern search.
    candidates, point = [(0.0, 0.0)], (0.0, 0.0)
    for _ in range(QNORM_FIXED_POINT):
        mean_q, std_q = moments(*point)
        if std_q <= 1e-12:
            break
        a = std_x / std_q  # q -> a * (q - mean_q) + mean_x matches both moments for these assignments
        point = (point[0] + math.log(a), a * (point[1] - mean_q) + mean_x)
        candidates.append(point)
    best = min(candidates, key=mismatch)
    best_cost, step_a, step_b = mismatch(best), 0.25, 0.25 * std_x
    for _ in range(QNORM_STEPS):
        if best_cost < 1e-10:
            break
        moves = [(best[0] + da, best[1] + db) for da, db in ((step_a, 0), (-step_a, 0), (0, step_b), (0, -step_b))]
        cost, point = min((mismatch(p), p) for p in moves)
        if cost < best_cost:
            best_cost, best = cost, point
        else:
            step_a, step_b = step_a / 2, step_b / 2
    return (math.exp(best[0]) * base + best[1]).to(torch.float32)


def fit_codebook(
    kind: str, bits: int, values: torch.Tensor, weights: torch.Tensor | None = None, qnorm: bool = False
) -> torch.Tensor:
    """A layer's codebook of ``kind`` from its normalised dense calibration ``values`` (1-D), sorted, float32.

    ``weights`` (same shape, Fisher sensitivities) are used by ``fisher-kmeans`` (and its
    Q-Norm); ``fisher-kmeans`` without weights falls back to unweighted k-means.
    """
    values = values.detach().float().flatten().cpu()
    used = weights.detach().float().flatten().cpu() if (weights is not None and kind == "fisher-kmeans") else None
    if kind == "uniform":
        codebook = uniform_codebook(bits)
    elif kind == "nf":
        codebook = nf_codebook(bits)
    elif kind in ("kmeans", "fisher-kmeans"):
        codebook = kmeans_codebook(values, bits, used)
    else:
        raise ValueError(f"unknown codebook kind '{kind}'")
    if qnorm:
        codebook = qnorm_correct(codebook, values, used)
    return codebook.sort().values.contiguous()
