"""Per-layer token budgets (PyramidKV, Cai et al. 2024; PyramidInfer): weights that multiply the mean budget.

Lower layers spread attention widely, upper layers concentrate it, so a fixed
mean budget is better spent unevenly. Every function here returns one weight per
layer with mean 1: the cache gives layer l ``weight[l] x budget`` tokens, so the
total is the same as a uniform budget.

* ``uniform``: all ones.
* ``pyramid``: PyramidKV's arithmetic sequence from 1 + slope (bottom layer) to
  1 - slope (top layer).
* ``profile``: fitted by `kvtool profile` from each layer's measured need (the
  fraction of tokens that holds attention mass T), stored as ``layers.budget_weight``.
* `pyramidinfer_weights`: PyramidInfer's cosine retention schedule (used by the
  ``pyramidinfer`` eviction policy, not a ``layer_budgets`` value).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvtool.errors import ArtifactError, RecipeError
from kvtool.recipe import EvictionSpec

MIN_WEIGHT, MAX_WEIGHT = 0.25, 4.0


def pyramid_weights(num_layers: int, slope: float) -> Tensor:
    """(L,) float32 linear from 1 + slope at layer 0 to 1 - slope at the last layer, mean 1."""
    weights = torch.linspace(1 + slope, 1 - slope, num_layers, dtype=torch.float64)  # (L,)
    return (weights / weights.mean()).float()


def pyramidinfer_weights(num_layers: int, decay: float) -> Tensor:
    """(L,) float32 PyramidInfer's depth schedule (Yang et al., Findings of ACL 2024), mean 1.

    Layer l keeps r_l of what layer l-1 kept, r_l = decay + (1 - decay) (1 + cos(pi l / L)) / 2
    (the paper's cosine strategy: 1 at the bottom, close to ``decay`` at the top); layer l's
    share is the running product r_0 ... r_l, rescaled to mean 1. Non-increasing with depth.
    """
    depth = torch.arange(num_layers, dtype=torch.float64)  # (L,)
    ratio = decay + (1 - decay) * (1 + torch.cos(math.pi * depth / num_layers)) / 2
    kept = torch.cumprod(ratio, dim=0)
    return (kept / kept.mean()).float()


def fitted_weights(need: Tensor) -> Tensor:
    """(L,) float32 weights proportional to each layer's need (L,), clamped to [0.25, 4], mean 1.

    need: per layer the mean fraction of tokens needed to reach attention mass T
    (``layers.attention_need`` of a profile); larger need gets a larger budget.
    """
    need = need.detach().to(torch.float64).cpu()  # (L,)
    if need.ndim != 1 or need.numel() == 0 or not bool(torch.isfinite(need).all()) or bool((need <= 0).any()):
        raise ArtifactError(
            f"the profile's per-layer attention need must be positive and finite, got {need.tolist()}; "
            "re-run `kvtool profile`"
        )
    weights = (need / need.mean()).clamp(MIN_WEIGHT, MAX_WEIGHT)  # (L,)
    return (weights / weights.mean()).float()


def layer_budgets(spec: EvictionSpec, num_layers: int, fitted: Tensor | None = None) -> Tensor:
    """(L,) float32 per-layer budget weights (mean 1) for ``spec.layer_budgets``.

    fitted: the profile's ``layers.budget_weight`` (L,), needed by ``profile``.
    """
    if spec.layer_budgets == "uniform":
        return torch.ones(num_layers)
    if spec.layer_budgets == "pyramid":
        return pyramid_weights(num_layers, spec.pyramid_slope)
    if fitted is None:
        raise RecipeError(
            "recipe field 'eviction.layer_budgets': 'profile' needs per-layer weights fitted on calibration text: "
            "run `kvtool profile` and pass the profile (`kvtool export --profile PROFILE`), "
            "or use layer_budgets: pyramid"
        )
    if tuple(fitted.shape) != (num_layers,):
        raise ArtifactError(
            f"the profile's layer budget weights have shape {tuple(fitted.shape)} but the model has {num_layers} layers: "
            "the profile is for another model; re-run `kvtool profile` on this one"
        )
    fitted = fitted.detach().to(torch.float64).cpu()
    return (fitted / fitted.mean()).float()
