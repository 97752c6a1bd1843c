"""Inner-product error of stored keys against real queries (`kvtool.eval.inner_product`), on a tiny random Llama.

The measurement must read exactly 0 for a cache that stores keys as they are, see through a
pre-RoPE round trip at the true positions, detect a planted bias and shrink, and reproduce
the known behaviour of TurboQuant's codes: Lloyd-Max cells shrink q . k by about their
distortion (0.1175 of the energy at 2 bits for a Gaussian coordinate), and the QJL residual
removes the shrink at the price of variance.
"""

import dataclasses

import pytest
import torch

from kvtool.eval.inner_product import InnerProductError, inner_product_error
from kvtool.recipe import load_recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")  # 2 layers, 4 query heads, 2 KV heads (GQA), head_dim 32


@pytest.fixture(scope="module")
def windows():
    return torch.randint(3, 128, (2, 160), generator=torch.Generator().manual_seed(0))  # (N, T)


def summary(model, windows, recipe, batch_size: int = 1) -> dict:
    return inner_product_error(CompressedRuntime.from_recipe(model, recipe), windows, batch_size).summary()


def turboquant_keys(bits: int, qjl: bool):
    recipe = load_recipe("turboquant-3bit")
    return dataclasses.replace(recipe, keys=dataclasses.replace(recipe.keys, bits=bits, qjl=qjl))


def test_uncompressed_keys_give_exactly_zero(model, windows):
    result = summary(model, windows, uncompressed_recipe())
    for stat in ("bias", "abs_bias", "shrink", "error_var", "rel_mse"):
        assert result[stat] == 0.0, stat
    # 2 windows x query positions past the 4 sinks, against the 128 body keys before them
    assert result["pairs"] == 2 * sum(min(i - 4, 128) for i in range(5, 160))


def test_pre_rope_keys_are_rotated_at_their_true_positions(model, windows):
    recipe = uncompressed_recipe()
    recipe = dataclasses.replace(recipe, keys=dataclasses.replace(recipe.keys, pre_rope=True))
    assert summary(model, windows, recipe)["rel_mse"] < 1e-10  # RoPE undone and redone: float rounding only


def test_batches_give_the_same_figures(model, windows):
    one, two = summary(model, windows, load_recipe("kivi-2bit")), summary(model, windows, load_recipe("kivi-2bit"), batch_size=2)
    assert one == pytest.approx(two, rel=1e-9, abs=1e-12)


def test_a_planted_bias_and_shrink_are_measured():
    generator = torch.Generator().manual_seed(0)
    exact = torch.randn(3, 50, 60, generator=generator) * 2 + 1  # (H_q, t, T)
    pairs = torch.rand(1, 50, 60, generator=generator) < 0.5
    std = torch.stack([exact[h][pairs[0]].double().std(unbiased=False) for h in range(3)])  # (H_q,)
    estimate = 0.9 * exact + 0.5 * std.float()[:, None, None]
    estimate = torch.where(pairs, estimate, torch.full_like(exact, 1e6))  # pairs not counted must not matter
    error = InnerProductError()
    error.add(0, exact, estimate, pairs)
    heads = error.per_head()
    torch.testing.assert_close(heads["shrink"], torch.full((1, 3), -0.1, dtype=torch.float64), atol=1e-5, rtol=0)
    expected_bias = (0.5 * std - 0.1 * torch.stack([exact[h][pairs[0]].double().mean() for h in range(3)])) / std
    torch.testing.assert_close(heads["bias"], expected_bias[None], atol=1e-5, rtol=0)
    torch.testing.assert_close(heads["error_var"], torch.full((1, 3), 0.01, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(heads["rel_mse"], heads["error_var"] + heads["bias"].square(), atol=1e-9, rtol=0)


def test_turboquant_codes_shrink_and_qjl_removes_the_shrink(model, windows):
    codes_2bit = summary(model, windows, turboquant_keys(2, qjl=False))
    codes_3bit = summary(model, windows, turboquant_keys(3, qjl=False))
    qjl_3bit = summary(model, windows, turboquant_keys(3, qjl=True))  # 2-bit codes + 1-bit QJL residual
    assert -0.14 < codes_2bit["shrink"] < -0.08  # ~ the 2-bit Lloyd-Max distortion
    assert -0.05 < codes_3bit["shrink"] < -0.02
    assert abs(qjl_3bit["shrink"]) < 0.03  # unbiased estimator of q . k ...
    assert qjl_3bit["error_var"] > codes_3bit["error_var"]  # ... with more variance than 3-bit codes
