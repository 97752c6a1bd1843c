"""``cache.float_block_size``: float blocks of 2 to 64 tokens instead of 16.

A float block is held whole once it has a token, so a window-less quantized stream (its sinks and its open block's
0 .. block_size - 1 newest tokens in 16 bits) wastes fewer slots with smaller float blocks. The same tokens are held
at the same precision: the attention is the same, only the bytes change. Every reader is checked at other sizes: the
torch path, the CPU kernel and the Triton kernel (interpreter; CUDA with the ``gpu`` marker), against the dense
reference and against generation at the default size; bytes held = bytes predicted.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from kvtool.errors import RecipeError
from kvtool.models.cache_argument import with_cache
from kvtool.plan import predict_cache_bytes
from kvtool.recipe import CacheSpec, QuantSpec, Recipe, dump_recipe, load_recipe, recipe_from_dict
from kvtool.recipe_summary import window_summary
from kvtool.runtime.attach import CompressedRuntime
from tests.test_kernels import devices
from tests.tiny_models import featured_model, tiny_model, tiny_tokenizer_free_inputs

needs_numba = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

KEYS_35 = dict(method="turboquant", bits=3, extra_bits=0.5, outlier_channel_fraction=0.25, norm_bits=8)
VALUES_25 = dict(method="turboquant", bits=2, extra_bits=0.5, outlier_channel_fraction=0.5, norm_bits=8)
WINDOWLESS = Recipe(  # turboquant-k3.5-v2.5-n8's shape: sinks + the open block are the whole float region
    name="tq-windowless", keys=QuantSpec(**KEYS_35, path="keys"), values=QuantSpec(**VALUES_25, path="values"),
    cache=CacheSpec(sink_tokens=2, recent_tokens=0, block_size=16),
)
KIVI = Recipe(name="kivi-4-window", keys=QuantSpec(bits=4, path="keys"), values=QuantSpec(bits=4, axis="token", path="values"),
              cache=CacheSpec(sink_tokens=4, recent_tokens=24, block_size=32))


def with_float_block(recipe: Recipe, fbs: int) -> Recipe:
    return dataclasses.replace(recipe, name=f"{recipe.name}-fb{fbs}", cache=dataclasses.replace(recipe.cache, float_block_size=fbs))


def generate(model, recipe, backend="torch", tokens=24, batch=2, seq=70):
    ids, mask = tiny_tokenizer_free_inputs(batch=batch, seq=seq)
    cache = CompressedRuntime.from_recipe(model, recipe, backend=backend).new_cache()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **with_cache(cache), max_new_tokens=tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out, cache


# --- the recipe ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [1, 3, 12, 128, 0, -4, 4.0, True, "8"])
def test_float_block_size_must_be_a_power_of_two_from_2_to_64(value):
    with pytest.raises(RecipeError, match="cache.float_block_size"):
        CacheSpec(float_block_size=value)


def load_recipe_text(text: str) -> Recipe:
    import yaml

    return recipe_from_dict(yaml.safe_load(text))


def test_float_block_size_round_trips_through_a_recipe_dict_and_defaults_to_16():
    recipe = with_float_block(WINDOWLESS, 4)
    assert load_recipe_text(dump_recipe(recipe)).cache.float_block_size == 4
    assert CacheSpec().float_block_size == 16
    assert load_recipe("kivi-4bit").cache.float_block_size == 16
    assert "float blocks of 4" in window_summary(recipe) and "float blocks" not in window_summary(WINDOWLESS)


def test_sparse_attention_summaries_must_fit_a_float_block():
    base = load_recipe("rocketkv")
    eight = dataclasses.replace(base.sparse_attention, summary_tokens=8, unread="drop")
    with_cache = lambda fbs: dataclasses.replace(base.cache, float_block_size=fbs)  # noqa: E731
    assert dataclasses.replace(base, sparse_attention=eight, cache=with_cache(8)).cache.float_block_size == 8
    with pytest.raises(RecipeError, match="summary_tokens.*float_block_size"):
        dataclasses.replace(base, sparse_attention=eight, cache=with_cache(4))


# --- the kernels against the dense reference ---------------------------------------------------------------------

CPU_KERNEL_SIDES = ["uniform-2", "uniform-4", "turboquant-2.5-3.5"]  # the CPU kernel reads quantized bodies only


@needs_numba
@pytest.mark.parametrize("side", CPU_KERNEL_SIDES)
@pytest.mark.parametrize("fbs", [2, 4, 32])
def test_cpu_kernel_reads_float_blocks_of_any_size(side, fbs):
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention
    from tests.test_cpu_decode import _cpu_args
    from tests.test_kernels import build_case

    args, reference = build_case(side, 64, 4, "cpu", seed=fbs + 1, fbs=fbs)
    assert args["float_k"].shape[1] == fbs
    torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("side, kernel", [("float", "auto"), ("uniform-4", "auto"), ("uniform-4", "general"),
                                          ("turboquant-2.5-3.5", "auto")])
@pytest.mark.parametrize("fbs", [2, 4, 32])
def test_triton_kernels_read_float_blocks_of_any_size(side, kernel, fbs, device):
    """The tiled kernel (float, uniform: several float blocks per tile) and the general one (one block at a time)."""
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention
    from tests.test_kernels import build_case

    args, reference = build_case(side, 64, 4, device, softcap=5.0, sinks=True, seed=fbs + 2, fbs=fbs)
    for splits in (1, 3):
        out = paged_decode_attention(**args, splits=splits, kernel=kernel)
        torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)


# --- generation: the same attention, fewer bytes -----------------------------------------------------------------

@pytest.mark.parametrize("recipe", [WINDOWLESS, KIVI, load_recipe("h2o"), load_recipe("uncompressed")], ids=lambda r: r.name)
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_smaller_float_blocks_generate_the_same_and_hold_what_they_predict(recipe, family):
    """Same tokens and logits as 16-token float blocks (the same tokens are held in 16 bits; only the blocks around
    them change), measured bytes = the analytic count, and never more bytes than at 16."""
    model = featured_model(family) if family != "llama" else tiny_model("llama", kv_heads=2)
    base, base_cache = generate(model, recipe)
    for fbs in (2, 4):
        small, cache = generate(model, with_float_block(recipe, fbs))
        assert all(layer.store.fbs == fbs and layer.store.float_pool.tensors["k"].shape[1] == fbs for layer in cache.layers)
        assert torch.equal(base.sequences, small.sequences)
        torch.testing.assert_close(torch.stack(small.logits), torch.stack(base.logits), rtol=1e-4, atol=1e-4)
        assert cache.nbytes() == cache.expected_nbytes()
        assert cache.nbytes() <= base_cache.nbytes()
        assert cache.memory_report()["kept_tokens"] == base_cache.memory_report()["kept_tokens"]


def test_a_windowless_stream_holds_its_open_tokens_in_fewer_slots():
    """Sinks 2 + 0..15 open tokens: 16-token float blocks hold 16 or 32 slots a stream, 4-token ones the tokens
    rounded up to 4; the bytes saved are exactly the slots not held."""
    model = tiny_model("llama", kv_heads=2)
    _, at16 = generate(model, WINDOWLESS, batch=1, seq=37, tokens=1)
    _, at4 = generate(model, with_float_block(WINDOWLESS, 4), batch=1, seq=37, tokens=1)
    for big, small in zip(at16.layers, at4.layers):
        assert (big.store.float_len == small.store.float_len).all() and (big.store.float_len == 2 + (37 - 2) % 16).all()
        assert big.store.float_pool.used == big.store.streams * 1  # 5 tokens: one block of 16
        assert small.store.float_pool.used == small.store.streams * 2  # two blocks of 4
    head_dim = at16.layers[0].store.layout.head_dim
    per_slot = 2 * head_dim * 2  # K and V in fp16
    layers, streams = len(at16.layers), at16.layers[0].store.streams
    # the second float block's table entry costs nothing here: block tables are at least 4 columns wide
    assert at16.nbytes() - at4.nbytes() == layers * streams * (16 - 8) * per_slot


def assert_predicted_bytes_match_held(model, recipe: Recipe) -> None:
    """`kvtool plan`'s prediction within 2% of the bytes a prefill of 37 x 1 and 200 x 3 tokens holds."""
    runtime = CompressedRuntime.from_recipe(model, recipe)
    for context, batch in [(37, 1), (200, 3)]:
        cache = runtime.new_cache()
        ids = torch.randint(3, 100, (batch, context), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            runtime.model(input_ids=ids, **with_cache(cache), use_cache=True)
        held = cache.nbytes()
        assert abs(predict_cache_bytes(runtime, context, batch) - held) <= 0.02 * held, (recipe.name, context, held)


def test_predicted_bytes_follow_the_float_block_size():
    model = tiny_model("llama")
    for recipe in (WINDOWLESS, KIVI):
        for fbs in (2, 4, 16):
            assert_predicted_bytes_match_held(model, with_float_block(recipe, fbs))


@needs_numba
def test_numba_generation_with_4_token_float_blocks_equals_torch():
    from tests.test_cpu_decode import _assert_numba_matches_torch

    model = tiny_model("llama", kv_heads=2)
    _assert_numba_matches_torch(model, with_float_block(WINDOWLESS, 4), 12)
    _assert_numba_matches_torch(model, with_float_block(KIVI, 2), 12)


@needs_triton
@pytest.mark.parametrize("device", devices())
def test_triton_generation_with_4_token_float_blocks_equals_torch(device):
    model = tiny_model("llama", kv_heads=2).to(device)
    for recipe in (with_float_block(WINDOWLESS, 4), with_float_block(KIVI, 4)):
        assert_triton_matches_torch(model, recipe)


def assert_triton_matches_torch(model, recipe: Recipe) -> None:
    """16 greedy tokens: the Triton backend ran in at least 5 decode steps of every layer and gives the torch
    backend's tokens and logits."""
    by_torch, _ = generate(model, recipe, "torch", tokens=16)
    by_triton, cache = generate(model, recipe, "triton", tokens=16)
    assert cache.memory_report()["backend"] == "triton"
    assert cache.memory_report()["kernel_steps"] >= 5 * model.config.num_hidden_layers
    assert torch.equal(by_torch.sequences, by_triton.sequences)
    torch.testing.assert_close(torch.stack(by_triton.logits), torch.stack(by_torch.logits), rtol=1e-3, atol=1e-3)
