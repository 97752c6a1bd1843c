"""`EvictionSpec.pooling_mode`: max or mean pooling of token scores over neighbouring positions.

Max pooling lets every token within kernel // 2 of a peak take the peak's score, so a multi-token span
(a pass key's digits) survives whole; mean pooling spreads the peak over the kernel and lowers it. The
oracle is torch's own 1-D pooling over a dense row (positions no stream holds: -inf for max, 0 for mean).
"""

import types

import pytest
import torch

from kvtool.methods.evict.base import policy_class
from kvtool.methods.evict.snapkv import pool_by_position
from kvtool.recipe import EvictionSpec


def scattered(scores, positions, width, empty):
    dense = torch.full((scores.shape[0], width), empty)
    return dense.scatter(1, positions, scores)


@pytest.mark.parametrize("mean", [False, True])
def test_pooling_by_position_is_torchs_pooling_over_the_positions_held(mean):
    gen = torch.Generator().manual_seed(3)
    positions = torch.tensor([[0, 1, 2, 5, 6, 9, 10, 11], [0, 3, 4, 5, 7, 8, 9, 12]])  # (S, N) with gaps (evicted)
    scores = torch.rand(positions.shape, generator=gen)
    valid = torch.ones_like(positions, dtype=torch.bool)
    valid[1, -1] = False  # a padded slot: neither scored nor counted
    for kernel in (1, 3, 5):
        got = pool_by_position(scores, positions, valid, kernel, mean=mean)
        dense = scattered(scores.masked_fill(~valid, 0.0 if mean else -torch.inf), positions, 13, 0.0 if mean else -torch.inf)
        pool = torch.nn.functional.avg_pool1d if mean else torch.nn.functional.max_pool1d
        expected = pool(dense[:, None], kernel, stride=1, padding=kernel // 2)[:, 0].gather(1, positions)
        assert torch.allclose(got[valid], expected[valid]), kernel


def test_max_keeps_a_peaks_neighbours_at_its_score_and_mean_spreads_it():
    positions = torch.arange(9)[None]
    scores = torch.zeros(1, 9)
    scores[0, 4] = 1.0  # one peak: the token a question attends to
    valid = torch.ones_like(positions, dtype=torch.bool)
    top = pool_by_position(scores, positions, valid, 5)
    assert top[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0]
    spread = pool_by_position(scores, positions, valid, 5, mean=True)
    assert torch.allclose(spread[0], torch.tensor([0, 0, 0.2, 0.2, 0.2, 0.2, 0.2, 0, 0]))


@pytest.mark.parametrize(("policy", "mode", "mean"), [
    ("snapkv", "auto", False), ("snapkv", "max", False), ("snapkv", "mean", True),
    ("rocketkv", "auto", False), ("rocketkv", "mean", True),
])
def test_snapkv_family_pools_as_the_recipe_says(policy, mode, mean):
    spec = EvictionSpec(policy=policy, pooling=5, pooling_mode=mode)
    positions = torch.arange(12)[None]
    window_attention = torch.rand(1, 12, generator=torch.Generator().manual_seed(0))
    view = types.SimpleNamespace(window_attention=window_attention, attention=None, positions=positions,
                                 valid=torch.ones_like(positions, dtype=torch.bool), layer=0,
                                 heads=torch.zeros(1, dtype=torch.long), length=torch.tensor([12]))
    scores = policy_class(policy)(spec).token_scores(view)
    assert torch.equal(scores, pool_by_position(window_attention, positions, view.valid, 5, mean=mean))


def test_an_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(Exception, match=r"eviction\.pooling_mode'.*'median' is not one of \['auto', 'max', 'mean'\]"):
        EvictionSpec(policy="snapkv", pooling_mode="median")


def test_the_recipe_summary_names_the_pooling_each_recipe_uses():
    from kvtool.recipe import load_recipe
    from kvtool.recipe_summary import eviction_summary

    assert "mean pooling 5" in eviction_summary(load_recipe("cake"))  # the paper's
    assert "max pooling 7" in eviction_summary(load_recipe("cake-maxpool"))
    assert "max pooling 7" in eviction_summary(load_recipe("snapkv"))
