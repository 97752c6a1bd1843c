"""Per-layer budget weights (`kvtool.methods.budget.pyramid`): PyramidKV's pyramid and weights fitted from a profile."""

from __future__ import annotations

import pytest
import torch

from kvtool.errors import ArtifactError, RecipeError
from kvtool.methods.budget.pyramid import fitted_weights, layer_budgets, pyramid_weights
from kvtool.recipe import EvictionSpec


@pytest.mark.parametrize("layers, slope", [(6, 0.5), (32, 0.3), (2, 0.9), (7, 0.0)])
def test_pyramid_weights_mean_one_and_decreasing(layers, slope):
    w = pyramid_weights(layers, slope)
    assert w.shape == (layers,) and w.dtype == torch.float32
    assert float(w.double().mean()) == pytest.approx(1.0, abs=1e-6)
    assert w[0] == pytest.approx(1 + slope) and w[-1] == pytest.approx(1 - slope)
    steps = w.diff()
    assert (steps < 0).all() if slope > 0 else torch.allclose(w, torch.ones(layers))
    assert torch.allclose(steps, steps[0].expand_as(steps), atol=1e-6)  # arithmetic sequence


def test_pyramid_single_layer():
    assert pyramid_weights(1, 0.5).tolist() == [1.0]


def test_fitted_weights_follow_need():
    need = torch.tensor([0.9, 0.6, 0.5, 0.3, 0.45, 0.2])
    w = fitted_weights(need)
    assert float(w.double().mean()) == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(w.argsort(), need.argsort())  # larger need, larger budget
    assert torch.allclose(w, need / need.mean(), atol=1e-6)  # proportional when nothing is clamped


def test_fitted_weights_clamped():
    w = fitted_weights(torch.tensor([1.0] + [1e-4] * 7))  # one layer needs everything
    assert float(w.mean()) == pytest.approx(1.0, abs=1e-6)
    assert w.max() / w.min() == pytest.approx(4.0 / 0.25, rel=1e-5)  # clamp then renormalise keeps the ratio


@pytest.mark.parametrize("need", [torch.tensor([0.5, 0.0]), torch.tensor([0.5, float("nan")]), torch.tensor([])])
def test_fitted_weights_reject_bad_need(need):
    with pytest.raises(ArtifactError, match="kvtool profile"):
        fitted_weights(need)


def test_layer_budgets_per_mode():
    assert torch.equal(layer_budgets(EvictionSpec(layer_budgets="uniform"), 4), torch.ones(4))
    pyramid = layer_budgets(EvictionSpec(layer_budgets="pyramid", pyramid_slope=0.25), 4)
    assert torch.allclose(pyramid, pyramid_weights(4, 0.25))
    fitted = torch.tensor([2.0, 1.0, 1.0, 1.0])
    assert torch.allclose(layer_budgets(EvictionSpec(layer_budgets="profile"), 4, fitted), fitted / fitted.mean())


def test_layer_budgets_profile_needs_a_fitted_profile():
    with pytest.raises(RecipeError, match="kvtool profile"):
        layer_budgets(EvictionSpec(layer_budgets="profile"), 4)
    with pytest.raises(ArtifactError, match="6 layers"):
        layer_budgets(EvictionSpec(layer_budgets="profile"), 6, torch.ones(4))
