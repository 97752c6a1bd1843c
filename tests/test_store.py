"""The paged store: honest bytes measured from outside, bounded reservations, amortized growth,
attention over the store equal to plain attention over what it holds, and flat memory at a fixed budget.

* for every bundled recipe, in float32 and float16 models: the bytes of every storage reachable
  from the cache equal ``reserved_nbytes()`` plus the per-model constants, the analytic size
  equals ``nbytes()``, and reserved <= 1.25 x used + one block per stream;
* attention computed over the store, chunk by chunk in each storage format, equals softmax
  attention over the decoded tokens;
* appends never copy the whole cache (pool growth is geometric) and freed blocks are reused.
"""

import dataclasses
import math

import pytest
import torch

from kvtool.capture import InputSecondMoments, QueryKeyMoments, stream_batches, stream_queries
from kvtool.calibration import (
    RangeStats, fit_layers, fit_palu_layers, fits_queries, needs_fit, needs_gradients, uses_palu,
)
from kvtool.models.adapter import adapter_for
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import CacheSpec, EvictionSpec, QuantSpec, Recipe, bundled_recipe_dir, load_recipe
from kvtool.runtime import paged_attention
from kvtool.runtime.attach import CompressedRuntime
from kvtool.runtime.memory import walked_nbytes
from kvtool.runtime.pool import BlockPool
from kvtool.sensitivity import SampleReservoir, stream_with_gradients
from tests.tiny_models import tiny_model, tiny_tokenizer_free_inputs

BUNDLED = sorted(p.stem for p in bundled_recipe_dir().glob("*.yaml"))
TINY_PROFILE = {
    "heads.policy": torch.tensor([[0, 2], [3, 4]]),
    "tokens.special": torch.tensor([1]),
    "tokens.punctuation": torch.tensor([5, 6, 7]),
    "layers.budget_weight": torch.tensor([1.2, 0.8], dtype=torch.float64),
}


def fitted_tensors(model, recipe: Recipe) -> list[dict] | None:
    """Fit a recipe's learned parts on random token windows of the model itself (mechanics only)."""
    if not needs_fit(recipe):
        return None
    adapter = adapter_for(model)
    gradients = needs_gradients(recipe)  # palu's gradient rank search reads the signed loss gradients
    reservoir = SampleReservoir(max_tokens=512, skip_first=recipe.cache.sink_tokens, keep_gradients=gradients)
    ranges = RangeStats(max_tokens=512, skip_first=recipe.cache.sink_tokens)
    windows = torch.randint(3, 128, (4, 96), generator=torch.Generator().manual_seed(0))
    moments = InputSecondMoments(adapter)
    with moments:
        if gradients:
            stream_with_gradients(model, adapter, windows, [reservoir])
        stream_batches(model, adapter, windows, [ranges] if gradients else [reservoir, ranges])
    queries = None
    if fits_queries(recipe):  # TurboQuant's channel_scale: query
        queries = QueryKeyMoments(skip_first=recipe.cache.sink_tokens)
        stream_queries(model, windows, queries.observe)
    geometry = adapter.geometry
    tensors = fit_layers(recipe, geometry.head_dim, geometry.num_layers, reservoir, ranges, queries)
    if uses_palu(recipe):
        for layer, palu in enumerate(fit_palu_layers(recipe, adapter, reservoir, moments)):
            tensors[layer].update(palu)
    return tensors


def bundled_runtime(model, name: str) -> CompressedRuntime:
    recipe = load_recipe(name)
    if recipe.evicts and recipe.eviction.budget_tokens is None:
        recipe = dataclasses.replace(recipe, eviction=dataclasses.replace(recipe.eviction, budget=0.5))
    return CompressedRuntime.from_recipe(model, recipe, fitted_tensors(model, recipe), profile=TINY_PROFILE)


def reservation_within_bound(cache) -> bool:
    for layer in cache.layers:
        for pool in (layer.store.float_pool, layer.store.body_pool):
            if pool is not None and pool.capacity > math.ceil(1.25 * pool.used) + layer.store.streams:
                return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", BUNDLED)
def test_walked_bytes_equal_the_cache_report_for_every_bundled_recipe(name, dtype):
    model = tiny_model("llama").to(dtype)
    cache = bundled_runtime(model, name).new_cache()
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=90)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, **with_cache(cache), max_new_tokens=40,
                       min_new_tokens=40, do_sample=False, pad_token_id=0)
    walked = walked_nbytes(cache)
    assert walked == cache.reserved_nbytes() + cache.constant_nbytes(), "memory the cache does not report"
    assert cache.nbytes() == cache.expected_nbytes()
    assert cache.nbytes() <= cache.reserved_nbytes()
    assert reservation_within_bound(cache)
    assert walked_nbytes(cache.constant_roots()) == cache.constant_nbytes()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["kivi-4bit", "kivi-2bit", "uncompressed", "streamingllm", "h2o"])
def test_cuda_allocator_sees_what_the_cache_reports(name):
    """On CUDA, the allocator's delta over a cache's life equals its reserved bytes (constants are the runtime's)."""
    model = tiny_model("llama").half().cuda()
    runtime = bundled_runtime(model, name)
    ids, mask = (x.cuda() for x in tiny_tokenizer_free_inputs(batch=2, seq=90))
    warm = runtime.new_cache()  # builds the runtime's shared formats once
    with torch.no_grad():
        model(ids, attention_mask=mask, **with_cache(warm))
    del warm
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache = runtime.new_cache()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **with_cache(cache), max_new_tokens=20,
                             min_new_tokens=20, do_sample=False, pad_token_id=0)
    del out
    torch.cuda.synchronize()
    delta = torch.cuda.memory_allocated() - before
    tracked = cache.reserved_nbytes()
    assert abs(delta - tracked) <= 0.02 * tracked + 64 * 1024, (delta, tracked)  # device copies of small host tables


def test_a_cache_does_not_keep_the_prefill_tensors_alive():
    """With no sinks and the model's own float dtype, nothing may be a view of the incoming K/V."""
    from kvtool.runtime.attach import uncompressed_recipe

    model = tiny_model("llama")
    cache = CompressedRuntime.from_recipe(model, uncompressed_recipe("model")).new_cache()
    ids = torch.randint(3, 128, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, **with_cache(cache))
    assert walked_nbytes(cache) == cache.reserved_nbytes() + cache.constant_nbytes()
    assert cache.reserved_nbytes() < 1.3 * cache.nbytes() + 4 * 16 * 32 * 4 * 2 * 2


def test_pool_grows_geometrically_and_reuses_freed_blocks():
    pool = BlockPool({"x": ((4,), torch.float32)}, "cpu")
    growths, last = 0, 0
    for _ in range(1000):
        pool.allocate(1)
        if pool.capacity != last:
            growths, last = growths + 1, pool.capacity
    assert pool.used == 1000 and pool.capacity <= 1.25 * 1000 + 1
    assert growths <= math.ceil(math.log(1000) / math.log(1.25)) + 1  # amortized O(1) appends
    pool.release(torch.arange(10, 20))
    reused = pool.allocate(10)
    assert sorted(reused.tolist()) == list(range(10, 20)) and pool.capacity == last


def test_pool_shrinks_after_many_blocks_are_freed():
    pool = BlockPool({"x": ((4,), torch.float32)}, "cpu")
    ids = pool.allocate(400)
    pool.tensors["x"][ids] = ids[:, None].float()
    pool.release(ids[:300])
    old, new, capacity = pool.shrink_plan(slack_blocks=2)
    pool.apply_moves(old, new, capacity)
    assert pool.capacity <= 1.25 * pool.used + 2 and pool.used == 100
    assert sorted(pool.tensors["x"][pool.in_use][:, 0].long().tolist()) == list(range(300, 400))  # data moved with them


def test_beam_duplicates_get_their_own_blocks_and_nothing_leaks():
    model = tiny_model("llama")
    recipe = Recipe(name="q4", cache=CacheSpec(sink_tokens=2, recent_tokens=8))
    cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
    ids = torch.randint(3, 128, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, **with_cache(cache))
        before = cache.nbytes()
        cache.reorder_cache(torch.tensor([1, 1]))  # both rows become copies of sequence 1
        logits = model(ids[1:, -1:].expand(2, 1), **with_cache(cache)).logits  # the same next token for both
    assert torch.allclose(logits[0], logits[1], atol=1e-5)
    assert cache.nbytes() == cache.expected_nbytes() and abs(cache.nbytes() - before) < 0.05 * before
    assert reservation_within_bound(cache)
    cache.batch_select_indices(torch.tensor([0]))
    assert cache.nbytes() == cache.expected_nbytes() and cache.nbytes() < 0.6 * before
    assert reservation_within_bound(cache)


# --- attention over the store equals plain attention over what it holds ---------------------------

FORMATS = {
    "float": dict(keys=QuantSpec(method="none", bits=16, path="keys"), values=QuantSpec(method="none", bits=16, axis="token", path="values")),
    "uniform-2": dict(keys=QuantSpec(bits=2, path="keys"), values=QuantSpec(bits=2, axis="token", path="values")),
    "uniform-3": dict(keys=QuantSpec(bits=3, path="keys"), values=QuantSpec(bits=3, axis="token", group_size=16, path="values")),
    "uniform-4-pre-rope": dict(keys=QuantSpec(bits=4, pre_rope=True, path="keys"), values=QuantSpec(bits=4, axis="token", path="values")),
    "uniform-8-token-keys": dict(keys=QuantSpec(bits=8, axis="token", path="keys"), values=QuantSpec(bits=8, axis="channel", path="values")),
    "nuq-3": dict(keys=QuantSpec(method="nuq", bits=3, pre_rope=True, codebook="kmeans", path="keys"),
                  values=QuantSpec(method="nuq", bits=3, axis="token", codebook="kmeans", path="values")),
    "palu-joint": dict(keys=QuantSpec(method="palu", bits=16, pre_rope=True, rank_fraction=0.75, group_heads=0, rank_allocation="uniform", path="keys"),
                       values=QuantSpec(method="palu", bits=3, hadamard=True, axis="token", rank_fraction=0.75, group_heads=0, rank_allocation="uniform", path="values")),
    "fp8-e4m3-block": dict(keys=QuantSpec(method="fp8", bits=8, granularity="block", path="keys"),
                           values=QuantSpec(method="fp8", bits=8, fp8_format="e5m2", granularity="block", axis="token", path="values")),
    "fp8-static": dict(keys=QuantSpec(method="fp8", bits=8, granularity="head", path="keys"),
                       values=QuantSpec(method="fp8", bits=8, granularity="layer", scale_fit="mse", axis="token", path="values")),
    "int-static": dict(keys=QuantSpec(method="int_static", bits=4, granularity="channel", path="keys"),
                       values=QuantSpec(method="int_static", bits=3, granularity="head", scale_fit="mse", axis="token", path="values")),
    "int-static-pre-rope": dict(keys=QuantSpec(method="int_static", bits=8, granularity="channel", pre_rope=True, path="keys"),
                                values=QuantSpec(method="int_static", bits=4, granularity="channel", scale_fit="mse", axis="token", path="values")),
    "palu-keys-turboquant-values": dict(keys=QuantSpec(method="palu", bits=3, pre_rope=True, rank_fraction=0.5, group_heads=0, rank_allocation="uniform",
                                                      rotate_basis=True, group_size=256, path="keys"),
                                        values=QuantSpec(method="turboquant", bits=2, extra_bits=0.5, norm_bits=8, axis="token", path="values")),
    "turboquant-qjl": dict(keys=QuantSpec(method="turboquant", bits=3, qjl=True, path="keys"),
                           values=QuantSpec(method="turboquant", bits=2, extra_bits=0.5, axis="token", path="values")),
}


@pytest.mark.parametrize("chunk_elements", [1 << 20, 256])  # one chunk, or many (online softmax across chunks)
@pytest.mark.parametrize("name", list(FORMATS))
def test_attention_over_the_store_equals_attention_over_the_decoded_tokens(name, chunk_elements, monkeypatch):
    monkeypatch.setattr(paged_attention, "CHUNK_ELEMENTS", chunk_elements)
    model = tiny_model("llama")
    recipe = Recipe(name=name, cache=CacheSpec(sink_tokens=3, recent_tokens=8, float_dtype="model"), **FORMATS[name])
    cache = CompressedRuntime.from_recipe(model, recipe, fitted_tensors(model, recipe)).new_cache()
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=110)
    captured = {}
    layer = cache.layers[1]
    original = layer.attend

    def spy(module, query, key, value, attention_mask, scaling, **kwargs):
        keys, values, _, valid = layer.decoded()  # what the store holds, before this forward's tokens
        out = original(module, query, key, value, attention_mask, scaling, **kwargs)
        captured.update(query=query, keys=keys, values=values, valid=valid, new_k=key, new_v=value, scaling=scaling, out=out)
        return out

    with torch.no_grad():
        model(ids, attention_mask=mask, **with_cache(cache))
        layer.attend = spy
        model(ids[:, -1:], attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1), **with_cache(cache))
    c = captured
    if layer.store.layout.quantized:
        assert int(layer.store.body_len.min()) >= 2  # the body (in its format) really took part
    else:
        assert int(layer.store.body_len.max()) == 0 and int(layer.store.float_len.min()) >= 100  # float: one region
    keys = torch.cat([c["keys"], c["new_k"].float()], dim=2)  # (B, H, T+1, D)
    values = torch.cat([c["values"], c["new_v"].float()], dim=2)
    valid = torch.cat([c["valid"], torch.ones_like(c["valid"][..., :1])], dim=2)  # (B, H, T+1)
    reference = torch.nn.functional.scaled_dot_product_attention(
        c["query"].float(), keys.repeat_interleave(2, dim=1), values.repeat_interleave(2, dim=1),
        attn_mask=valid.repeat_interleave(2, dim=1)[:, :, None, :], scale=c["scaling"],
    )  # (B, H_q, 1, D)
    torch.testing.assert_close(c["out"].float(), reference.transpose(1, 2), rtol=1e-4, atol=1e-5)


# --- memory at a fixed budget stays flat over a long generation ---------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("interval, steps", [(16, 20_000), (1, 2_000)])
def test_a_fixed_budget_holds_flat_bytes_over_20k_generated_tokens(interval, steps):
    """Default interval 16: bytes move between the budget's blocks and one block more, never beyond;
    interval 1 (evict at every step): exactly flat. Reserved bytes are flat in both."""
    model = tiny_model("llama", layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, max_position_embeddings=32768)
    recipe = Recipe(
        name="window", keys=QuantSpec(method="none", bits=16, path="keys"), values=QuantSpec(method="none", bits=16, axis="token", path="values"),
        cache=CacheSpec(float_dtype="float16"),
        eviction=EvictionSpec(policy="h2o", budget_tokens=256, sink_tokens=4, window=16, interval=interval),
    )
    cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
    token = torch.randint(3, 128, (1, 1), generator=torch.Generator().manual_seed(0))
    held, reserved, kept = [], [], []
    with torch.no_grad():
        for step in range(steps):
            token = model(token, **with_cache(cache)).logits[:, -1:].argmax(-1)
            if step >= 256 + interval:
                held.append(cache.nbytes())
                reserved.append(cache.reserved_nbytes())
                kept.append(cache.kept_tokens())
    assert cache.get_seq_length() == steps
    assert len(set(reserved)) == 1, "reserved memory moved while the budget was full"
    assert min(kept) == 256 and max(kept) == 256 + interval - 1, (min(kept), max(kept))
    block = cache.layers[0].store.float_pool.block_nbytes()
    assert sorted(set(held)) == ([held[0]] if interval == 1 else [min(held), min(held) + block]), "held bytes moved beyond one block"


def test_storage_bytes_count_host_views_of_tensors_once():
    """A numpy view of a tensor's memory (`BlockPool.host_flat`, reshaped or as bytes) is that tensor's storage, counted
    once beside the tensor; a numpy slice counts its owner; an array over a foreign buffer counts itself."""
    import numpy as np

    from kvtool.runtime.memory import storage_nbytes

    t = torch.zeros(100)
    as_bytes = t.view(torch.uint8).numpy().reshape(50, 8)
    assert storage_nbytes([t, t.numpy(), as_bytes]) == storage_nbytes([as_bytes]) == 400
    owner = np.zeros(10)
    assert storage_nbytes([owner[2:5]]) == storage_nbytes([owner, owner[2:5]]) == 80
    assert storage_nbytes([np.frombuffer(b"abcdefgh", dtype=np.uint8)]) == 8
