"""Palu's ``gradient`` rank search: the curve against brute force, direction awareness, the greedy optimum.

The ``gradient`` curve weighs each basis coordinate's truncation error by the loss gradient's
projection on it (`rank_search.gradient_curve`); ``fisher`` weighs each element by its squared
gradient (`rank_search.error_curve`). Helpers (the small linear model) come from test_palu.py.
"""

import itertools

import pytest
import torch

from kvtool.errors import DataError
from kvtool.methods.lowrank.decompose import group_bases, to_groups
from kvtool.methods.lowrank.palu import fit_palu
from kvtool.methods.lowrank.rank_search import allocate_ranks, gradient_curve
from kvtool.sensitivity import SampleReservoir, stream_with_gradients
from tests.test_palu import D, H, gen, linear_model, moment, part_entry, recipe, spec


def whitened_bases(x, w, groups_of: int = 2) -> torch.Tensor:
    bases, _ = group_bases(num_kv_heads=H, head_dim=D, group_heads=groups_of, whiten=True, weight=w, input_second_moment=moment(x))
    return bases  # (G, g*D, g*D)


def test_gradient_curve_matches_brute_force():
    x, w, b, k = linear_model()
    bases = whitened_bases(x, w)
    grads = torch.randn(k.shape, generator=gen(3), dtype=torch.float64)  # (N, H, D)
    curve = gradient_curve(bases, k, grads, b)
    assert curve.shape == (2 * D + 1,) and curve.dtype == torch.float64
    kg, gg, bg = to_groups(k, 2), to_groups(grads, 2), b.reshape(2, 2 * D)  # (N, G, gD)
    for r in (0, 1, 9, 2 * D - 1, 2 * D):
        brute = 0.0
        for j in range(r, 2 * D):
            u = bases[:, :, j].double()  # (G, gD)
            c = ((kg - bg) * u).sum(-1)  # (N, G)
            a = (gg * u).sum(-1)
            brute += float((c * a).square().sum())
        assert float(curve[r]) == pytest.approx(brute / k.shape[0], rel=1e-5, abs=1e-12)
    assert (curve[:-1] >= curve[1:]).all() and float(curve[-1]) == 0.0


def test_gradient_curve_is_the_squared_first_order_loss_change_for_a_one_direction_gradient():
    """When each token's gradient lies along one basis vector, no cross terms exist: curve[r] = mean (g . error_r)^2."""
    x, w, b, k = linear_model()
    bases = whitened_bases(x, w, groups_of=H)  # one group: (1, H*D, H*D)
    n = k.shape[0]
    direction = torch.randint(0, H * D, (n,), generator=gen(5))
    scale = torch.randn(n, generator=gen(6), dtype=torch.float64)
    grads = (scale[:, None] * bases[0].double().T[direction]).reshape(n, H, D)  # g_n = s_n u_{j_n}
    curve = gradient_curve(bases, k, grads, b)
    centred = k.reshape(n, -1) - b  # (N, H*D)
    for r in (0, 7, 40, H * D):
        u = bases[0, :, :r].double()
        error = centred - centred @ u @ u.T  # (N, H*D) truncation error at rank r
        loss_change = (grads.reshape(n, -1) * error).sum(-1)  # (N,)
        assert float(curve[r]) == pytest.approx(float(loss_change.square().mean()), rel=1e-5, abs=1e-12)


def test_gradient_curve_checks_shapes():
    x, w, b, k = linear_model()
    bases = whitened_bases(x, w)
    with pytest.raises(ValueError, match="gradients"):
        gradient_curve(bases, k, k[:10], b)
    with pytest.raises(ValueError, match="full square bases"):
        gradient_curve(bases[:, :, :5], k, k, b)


def _gradients_in_top_directions(x, w, b, k, kept: int) -> torch.Tensor:
    """Per-token gradients (N, H, D) in the span of each head's first ``kept`` whitened basis vectors."""
    bases, _ = group_bases(num_kv_heads=H, head_dim=D, group_heads=1, whiten=True, weight=w, input_second_moment=moment(x))
    coeffs = torch.randn(k.shape[0], H, kept, generator=gen(8), dtype=torch.float64)
    return torch.einsum("nhr,hir->nhi", coeffs, bases[:, :, :kept].double())  # (N, H, D)


def test_gradient_ranks_starve_a_part_whose_error_the_loss_does_not_see():
    """Keys' gradients lie in their first 3 basis directions (error beyond them leaves the loss unchanged to
    first order): the ``gradient`` search gives keys rank 3 and the rest to values; per-element ``fisher``
    weights (the squares of the same gradients, spread over every element) cannot see that and keep more."""
    x, w_keys, b_keys, keys = linear_model(seed=0)
    _, w_values, b_values, _ = linear_model(seed=1)
    values = (x @ w_values.T + b_values).reshape(-1, H, D)
    key_grads = _gradients_in_top_directions(x, w_keys, b_keys, keys, kept=3)
    value_grads = torch.randn(values.shape, generator=gen(9), dtype=torch.float64)  # sees every direction
    entry = {
        "keys": {**part_entry(x, w_keys, b_keys, keys, weights=key_grads.square().float()), "gradients": key_grads.float()},
        "values": {**part_entry(x, w_values, b_values, values, weights=value_grads.square().float()),
                   "gradients": value_grads.float()},
    }

    def ranks(mode: str) -> dict[str, int]:
        fitted = fit_palu(recipe(keys=spec("keys", rank_allocation=mode), values=spec("values", rank_allocation=mode)), [entry])
        return {part: fitted[0][f"{part}.basis"].shape[-1] for part in ("keys", "values")}

    by_gradient, by_fisher = ranks("gradient"), ranks("fisher")
    assert by_gradient == {"keys": 3, "values": D - 3}  # budget D/2 per part and head, all of it where it matters
    assert by_fisher["keys"] > 3


def test_fit_palu_gradient_needs_gradients():
    x, w, b, k = linear_model()
    with pytest.raises(DataError, match="needs the loss gradients"):
        fit_palu(recipe(keys=spec(rank_allocation="gradient")), [{"keys": part_entry(x, w, b, k)}])
    with pytest.raises(DataError, match="needs the loss gradients"):
        entry = {**part_entry(x, w, b, k), "gradients": torch.ones(3, H, D)}
        fit_palu(recipe(keys=spec(rank_allocation="gradient")), [{"keys": entry}])


def _convex_curve(generator: torch.Generator, full: int, scale: float) -> torch.Tensor:
    """(full + 1,) non-increasing with shrinking drops (diminishing returns), ending at 0."""
    drops = torch.rand(full, generator=generator, dtype=torch.float64).sort(descending=True).values * scale
    return torch.cat([torch.flip(torch.cumsum(torch.flip(drops, [0]), 0), [0]), torch.zeros(1, dtype=torch.float64)])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["fisher", "gradient"])
def test_greedy_allocation_equals_brute_force_on_convex_curves(seed, mode):
    """With diminishing returns the greedy search reaches the least total error of all allocations of the budget."""
    g = gen(seed)
    curves = {key: _convex_curve(g, 6, scale) for key, scale in (("a", 1.0), ("b", 3.0), ("c", 0.2))}
    ranks = allocate_ranks(curves, 0.5, mode)
    assert sum(ranks.values()) == 9
    best = min(
        sum(float(curves[key][r]) for key, r in zip(curves, combo))
        for combo in itertools.product(range(1, 7), repeat=3)
        if sum(combo) == 9
    )
    assert sum(float(curves[key][r]) for key, r in ranks.items()) == pytest.approx(best, rel=1e-12)


def test_reservoir_keeps_gradients_of_its_sampled_rows():
    """stream_with_gradients feeds signed gradients; the kept ones square to the kept Fisher weights, row for row."""
    from kvtool.models.adapter import adapter_for
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    adapter = adapter_for(model)
    windows = torch.randint(3, 128, (3, 12), generator=gen(0))
    reservoir = SampleReservoir(max_tokens=20, seed=0, skip_first=1, keep_gradients=True)
    stream_with_gradients(model, adapter, windows, [reservoir])
    for part in ("keys_pre_rope", "values"):
        rows, fisher = reservoir.samples(1, part)
        grads = reservoir.gradients(1, part)
        assert grads.shape == rows.shape == (20, *rows.shape[1:])
        torch.testing.assert_close(grads.square(), fisher)
        assert (grads < 0).any() and (grads > 0).any()  # signed
    fisher_only = SampleReservoir(max_tokens=20, seed=0, skip_first=1)  # keeps the Fisher weights it is fed
    stream_with_gradients(model, adapter, windows, [fisher_only])
    for layer in (0, 1):
        for part in ("keys_pre_rope", "values"):
            for ours, theirs in zip(reservoir.samples(layer, part), fisher_only.samples(layer, part)):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=0)  # same rows, Fisher = the kept gradients squared
    plain = SampleReservoir(max_tokens=20, seed=0)
    stream_with_gradients(model, adapter, windows, [plain])
    assert plain.gradients(0, "values") is None
    with pytest.raises(ValueError, match="keeps signed gradients"):
        SampleReservoir(keep_gradients=True).observe_gradients(0, *(torch.ones(1, 1, 2, 2),) * 4)
