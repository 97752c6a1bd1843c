"""``cache.float_dtype: float8_e4m3``: the float blocks (sinks, recent window, open block) in one byte per value.

Written saturating at +-448 (`store.to_float_slots`), read widened by the torch path, the CPU kernel (bytes decoded
in registers) and both Triton kernels (float8 loads); key summaries, token sums and the body formats' floats stay
float16. The bytes held are half the float blocks' 16-bit ones, measured, walked and predicted."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from kvtool.errors import RecipeError
from kvtool.recipe import CacheSpec, EvictionSpec, QuantSpec, Recipe, load_recipe
from kvtool.recipe_summary import window_summary
from kvtool.runtime.memory import walked_nbytes
from kvtool.runtime.store import to_float_slots, wide_float_dtype
from tests.test_float_block_size import (
    KIVI, WINDOWLESS, assert_predicted_bytes_match_held, assert_triton_matches_torch, generate, with_float_block,
)
from tests.test_kernels import build_case, devices
from tests.tiny_models import featured_model, tiny_model

needs_numba = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

FP8 = torch.float8_e4m3fn


def in_float8(recipe: Recipe) -> Recipe:
    return dataclasses.replace(recipe, name=f"{recipe.name}-f8", cache=dataclasses.replace(recipe.cache, float_dtype="float8_e4m3"))


FLOAT_ONLY = Recipe(name="float-only", keys=QuantSpec(method="none", bits=16, path="keys"),
                    values=QuantSpec(method="none", bits=16, axis="token", path="values"))
H2O_FLOAT = dataclasses.replace(  # scored eviction of a float store: evicted slots refilled in place (`fill_holes`)
    FLOAT_ONLY, name="h2o-float", eviction=EvictionSpec(policy="h2o", budget_tokens=48, sink_tokens=2, window=8))


# --- the recipe and the store ---------------------------------------------------------------------------------------

def test_the_recipe_takes_float8_e4m3_and_names_the_choices_otherwise():
    assert in_float8(KIVI).cache.float_dtype == "float8_e4m3"
    with pytest.raises(RecipeError, match="float8_e4m3"):
        CacheSpec(float_dtype="float8")
    assert "float8_e4m3" in window_summary(in_float8(KIVI))


def test_float8_slots_saturate_instead_of_turning_into_nan():
    x = torch.tensor([1000.0, -1000.0, 448.0, 0.1, -3e-4, 0.0])
    stored = to_float_slots(x, FP8)
    assert stored.dtype == FP8 and torch.isfinite(stored.float()).all()
    assert stored.float().tolist()[:3] == [448.0, -448.0, 448.0]
    assert torch.equal(stored.float()[3:], x[3:].to(FP8).float())
    assert wide_float_dtype(FP8) == torch.float16 and wide_float_dtype(torch.bfloat16) == torch.bfloat16


def test_the_float_pool_is_float8_and_what_sits_beside_it_is_float16():
    model = tiny_model("llama", kv_heads=2)
    _, cache = generate(model, in_float8(load_recipe("rocketkv")), tokens=8)  # key summaries and token sums
    for layer in cache.layers:
        tensors = layer.store.float_pool.tensors
        assert tensors["k"].dtype == FP8 and tensors["v"].dtype == FP8
        beside = [name for name in ("kmax", "kmin", "ksum", "vsum") if name in tensors]
        assert beside and all(tensors[name].dtype == torch.float16 for name in beside)
    _, cache = generate(model, in_float8(KIVI), tokens=8)
    for layer in cache.layers:
        assert layer.store.float_pool.tensors["k"].dtype == FP8
        assert layer.store.body_pool.tensors["k.scale"].dtype == torch.float16  # the format's floats


@pytest.mark.parametrize("summaries", [{"summary_tokens": 4, "unread": "drop"}, {}], ids=["max-min", "sums"])
def test_summaries_written_with_each_token_equal_the_ones_recomputed_from_the_slots(summaries):
    """A decode step folds its key into the block's max / min (or its key and value into the block's sums) as stored
    (rounded to float8), so the running summaries equal a recomputation from what the slots hold (the sums up to
    float16 rounding)."""
    model = tiny_model("llama", kv_heads=2)
    base = load_recipe("rocketkv")
    recipe = in_float8(dataclasses.replace(
        base, sparse_attention=dataclasses.replace(base.sparse_attention, min_tokens=16, **summaries)))
    expected = ["kmax", "kmin"] if summaries else ["ksum", "vsum"]
    _, cache = generate(model, recipe, tokens=12, batch=1)
    compared = 0
    for layer in cache.layers:
        store = layer.store
        if store._summaries_stale:
            continue
        names = [name for name in ("kmax", "kmin", "ksum", "vsum") if name in store.float_pool.tensors]
        assert set(expected) <= set(names)
        used = store.float_pool.in_use
        running = {name: store.float_pool.tensors[name][used].float() for name in names}
        store.refresh_summaries()
        for name, before in running.items():
            exact = name in ("kmax", "kmin")
            torch.testing.assert_close(before, store.float_pool.tensors[name][used].float(),
                                       rtol=0 if exact else 2e-3, atol=0 if exact else 2e-2)
        compared += 1
    assert compared > 0


# --- kernels against the dense reference ---------------------------------------------------------------------------

@needs_numba
@pytest.mark.parametrize("side", ["uniform-2", "uniform-4", "turboquant-2.5-3.5"])
@pytest.mark.parametrize("fbs", [4, 16])
def test_cpu_kernel_reads_float8_blocks(side, fbs):
    from kvtool.runtime.kernels.cpu_decode import covers, cpu_decode_attention
    from tests.test_cpu_decode import _cpu_args

    args, reference = build_case(side, 64, 4, "cpu", seed=fbs + 5, fbs=fbs, float_dtype=FP8)
    assert covers(args["formats"], FP8, 64) is None
    torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("side, kernel", [("float", "auto"), ("float", "general"), ("uniform-4", "auto"),
                                          ("uniform-4", "general"), ("turboquant-2.5-3.5", "auto")])
def test_triton_kernels_read_float8_blocks(side, kernel, device):
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    args, reference = build_case(side, 64, 4, device, softcap=5.0, sinks=True, seed=11, fbs=8, float_dtype=FP8)
    for splits in (1, 3):
        out = paged_decode_attention(**args, splits=splits, kernel=kernel)
        torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("device", devices())
def test_the_tiled_kernels_half_products_widen_float8_to_float16(device):
    """precision "half" multiplies float16 operands: float8 tiles are widened (exactly) first, never multiplied as
    float8 with the query cast down to float8."""
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    args, reference = build_case("uniform-4", 64, 4, device, seed=12, fbs=8, float_dtype=FP8)
    out = paged_decode_attention(**args, kernel="auto", precision="half")
    torch.testing.assert_close(out.cpu(), reference, rtol=2e-2, atol=2e-2)
    half_args, _ = build_case("uniform-4", 64, 4, device, seed=12, fbs=8, float_dtype=torch.float16)
    half_args["float_k"], half_args["float_v"] = args["float_k"].half(), args["float_v"].half()  # the same values
    same = paged_decode_attention(**half_args, kernel="auto", precision="half")
    torch.testing.assert_close(out, same, rtol=0, atol=0)


# --- generation --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [WINDOWLESS, KIVI, FLOAT_ONLY, H2O_FLOAT], ids=lambda r: r.name)
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_float8_blocks_hold_half_the_float_bytes_and_generate_close_to_float16(recipe, family):
    """The same tokens held, the float blocks' K/V in half the bytes (measured = analytic = walked), logits close to
    16-bit float blocks' and not equal to them (the bytes really are float8)."""
    model = featured_model(family) if family != "llama" else tiny_model("llama", kv_heads=2)
    base, base_cache = generate(model, recipe)
    small, cache = generate(model, in_float8(recipe))
    assert cache.memory_report()["kept_tokens"] == base_cache.memory_report()["kept_tokens"]
    saved = sum(layer.store.float_pool.used * layer.store.float_pool.tensors["k"][0].numel() * 2 for layer in cache.layers)
    assert saved > 0 and base_cache.nbytes() - cache.nbytes() == saved  # K and V: one byte per value instead of two
    assert cache.nbytes() == cache.expected_nbytes()
    assert walked_nbytes(cache) == cache.reserved_nbytes() + cache.constant_nbytes()
    # logits while both generated the same tokens: the prefill's equal (new tokens attend to each other at the model's
    # precision), the decode steps' close (they read the float8 slots) and not equal
    ours, theirs = torch.stack(small.logits), torch.stack(base.logits)  # (steps, B, V)
    prompt = base.sequences.shape[1] - ours.shape[0]
    differs = (small.sequences[:, prompt:] != base.sequences[:, prompt:]).any(dim=0).nonzero()
    steps = int(differs[0]) + 1 if differs.numel() else ours.shape[0]
    assert steps >= 2 and torch.equal(ours[0], theirs[0])
    diff = (ours[1:steps] - theirs[1:steps]).abs().max()
    assert 0 < diff < 0.3 * theirs.abs().max(), (steps, diff)  # tiny random models: 3% per value adds up


def test_predicted_bytes_follow_float8_blocks():
    model = tiny_model("llama")
    for recipe in (WINDOWLESS, KIVI, FLOAT_ONLY):
        assert_predicted_bytes_match_held(model, in_float8(with_float_block(recipe, 4)))


@needs_numba
@pytest.mark.parametrize("recipe", [WINDOWLESS, KIVI, FLOAT_ONLY, H2O_FLOAT], ids=lambda r: r.name)
def test_numba_generation_with_float8_blocks_equals_torch(recipe):
    """The kernel attends to the step's token as its float8 slot holds it (as the torch path reads it back) and writes
    the same bytes."""
    from tests.test_cpu_decode import _assert_numba_matches_torch

    steps = {"h2o-float": 12, "float-only": 23}.get(recipe.name, 12)
    _assert_numba_matches_torch(tiny_model("llama", kv_heads=2), in_float8(recipe), steps)


@needs_triton
@pytest.mark.parametrize("device", devices())
def test_triton_generation_with_float8_blocks_equals_torch(device):
    model = tiny_model("llama", kv_heads=2).to(device)
    for recipe in (in_float8(with_float_block(WINDOWLESS, 4)), in_float8(KIVI), in_float8(FLOAT_ONLY)):
        assert_triton_matches_torch(model, recipe)


@needs_triton
@pytest.mark.parametrize("device", devices())
def test_the_sparse_kernel_reads_float8_pools(device):
    """RocketKV's stage 2 reads listed float slots in place: float8 pools too."""
    from kvtool.runtime.kernels.sparse_decode import sparse_decode_attention
    from tests.test_kernels import sparse_listing

    g = torch.Generator().manual_seed(7)
    k_pool, v_pool, slots, valid, q, new_k, new_v = sparse_listing(g, device, 64, 4)
    k_pool, v_pool = k_pool.to(FP8), v_pool.to(FP8)
    out = sparse_decode_attention(q.to(device), new_k.to(device), new_v.to(device), k_pool, v_pool, slots.to(device),
                                  valid.to(device), None, None).cpu()
    for stream in range(slots.shape[0]):
        ids = slots[stream][valid[stream]]
        keys = torch.cat([k_pool.cpu()[ids].float(), new_k[stream : stream + 1]])
        values = torch.cat([v_pool.cpu()[ids].float(), new_v[stream : stream + 1]])
        want = torch.softmax(q[stream] @ keys.T, dim=-1) @ values
        torch.testing.assert_close(out[stream], want, rtol=1e-4, atol=1e-5)
