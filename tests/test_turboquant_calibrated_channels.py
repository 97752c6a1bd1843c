"""TurboQuant's outlier split over calibrated channels (``outlier_channels: calibrated``).

`kvtool calibrate` picks, per layer and KV head, the channels the outlier instance codes (the largest mean squares of
what the codes hold); blocks then store no mask, and every block of a stream shares one channel order, so the CPU
kernel rotates the query once per stream. Checked: the recipe, the fit, the artifact check, the bytes, the torch
path against the dense reference, the CPU and Triton kernels against it, generation on every backend, calibration end
to end.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from kvtool.calibration import fit_layers, fits_queries
from kvtool.capture import QueryKeyMoments
from kvtool.errors import ArtifactError, RecipeError
from kvtool.methods.base import BlockQuantizer
from kvtool.methods.quant.turboquant import TurboQuantizer, pack_mask, unpack_mask
from kvtool.recipe import CacheSpec, QuantSpec, Recipe
from kvtool.recipe_summary import tensor_summary
from tests.test_kernels import add_sides, devices

needs_numba = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

D, S = 64, 16
KEYS = dict(method="turboquant", bits=3, extra_bits=0.5, outlier_channel_fraction=0.25, outlier_channels="calibrated")
VALUES = dict(method="turboquant", bits=2, extra_bits=0.5, outlier_channel_fraction=0.5, outlier_channels="calibrated")


def static_mask(heads: int, channels: list[list[int]]) -> torch.Tensor:
    mask = torch.zeros(heads, D, dtype=torch.bool)
    for h, picked in enumerate(channels):
        mask[h, picked] = True
    return pack_mask(mask)


def calibrated(spec: dict, mask: torch.Tensor, path="keys") -> TurboQuantizer:
    return TurboQuantizer(QuantSpec(**spec, path=path), D, S, torch.float32, {"outlier_channels": mask})


# --- the recipe and the fit ----------------------------------------------------------------------------------------

def test_calibrated_channels_need_turboquant_with_a_split_and_a_calibration():
    spec = QuantSpec(**KEYS, path="keys")
    assert spec.learns_from_data
    recipe = Recipe(name="x", keys=spec, values=QuantSpec(**VALUES, path="values"), cache=CacheSpec(block_size=16))
    assert fits_queries(recipe)
    with pytest.raises(RecipeError, match="outlier_channels"):
        QuantSpec(method="turboquant", bits=3, outlier_channels="calibrated", path="keys")  # no split
    with pytest.raises(RecipeError, match="outlier_channels"):
        QuantSpec(method="uniform", bits=4, outlier_channels="calibrated", path="keys")
    with pytest.raises(RecipeError, match="outlier_channels"):
        QuantSpec(**{**KEYS, "outlier_channels": "static"}, path="keys")
    assert tensor_summary(spec) == "turboquant 3.5-bit, 25% outlier channels at 5-bit calibrated per KV head"
    eighth = QuantSpec(**{**KEYS, "extra_bits": 0.25, "outlier_channel_fraction": 0.125}, path="keys")
    assert tensor_summary(eighth) == "turboquant 3.25-bit, 12.5% outlier channels at 5-bit calibrated per KV head"
    with pytest.raises(RecipeError, match="kvtool calibrate"):  # a runtime without the fitted channels
        TurboQuantizer(spec, D, S, torch.float32)


def test_the_fit_picks_each_heads_channels_with_the_largest_mean_squares_of_what_the_codes_hold():
    g = torch.Generator().manual_seed(0)
    keys, queries, values = (torch.rand(2, D, generator=g) for _ in range(3))
    keys[0, [3, 9]] += 10  # head 0's key outliers; values' are elsewhere
    values[1, [50, 60]] += 10
    k_spec, v_spec = QuantSpec(**KEYS, path="keys"), QuantSpec(**VALUES, path="values")
    fitted = TurboQuantizer.fit_queries(k_spec, D, keys, queries)
    mask = unpack_mask(fitted["outlier_channels"])  # (2, D)
    assert mask.shape == (2, D) and mask.sum(dim=-1).tolist() == [16, 16]
    assert torch.equal(mask[0], keys[0] >= keys[0].topk(16).values[-1])
    assert mask[0, [3, 9]].all()
    fitted = TurboQuantizer.fit_queries(v_spec, D, keys, queries, value_square_mean=values)
    mask = unpack_mask(fitted["outlier_channels"])
    assert mask.sum(dim=-1).tolist() == [32, 32] and mask[1, [50, 60]].all()
    # with the query scale, the codes hold k / s: the channels of k / s, not of k
    scaled = TurboQuantizer.fit_queries(QuantSpec(**KEYS, channel_scale="query", path="keys"), D, keys, queries)
    held = keys / scaled["channel_scale"].square()
    assert torch.equal(unpack_mask(scaled["outlier_channels"])[1], held[1] >= held[1].topk(16).values[-1])


def test_query_key_moments_also_hold_the_values_mean_squares():
    moments = QueryKeyMoments(skip_first=1)
    q, k, v = torch.randn(2, 4, 5, D), torch.randn(2, 2, 5, D), torch.randn(2, 2, 5, D)
    moments.observe(0, q, k, 1.0, v)
    moments.observe(0, q, k, 1.0, v)
    torch.testing.assert_close(moments.value_moments(0), v[:, :, 1:].square().mean(dim=(0, 2)))
    recipe = Recipe(name="x", keys=QuantSpec(**KEYS, path="keys"), values=QuantSpec(**VALUES, path="values"),
                    cache=CacheSpec(block_size=16))
    fitted = fit_layers(recipe, D, 1, queries=moments)[0]
    assert set(fitted) == {"keys.outlier_channels", "values.outlier_channels"}
    top = v[:, :, 1:].square().mean(dim=(0, 2)).topk(32, dim=-1).indices  # (2, 32)
    assert all(unpack_mask(fitted["values.outlier_channels"])[h, top[h]].all() for h in range(2))


def test_an_artifacts_channels_are_checked_against_the_model():
    q = calibrated(KEYS, static_mask(2, [list(range(16)), list(range(16, 32))]))
    q.check_kv_heads(2)
    with pytest.raises(ArtifactError, match="outlier channels"):
        q.check_kv_heads(3)  # another model's KV heads
    wrong_count = calibrated(KEYS, static_mask(2, [list(range(16)), list(range(15))]))
    with pytest.raises(ArtifactError, match="16 per KV head"):
        wrong_count.check_kv_heads(2)


# --- storage and the torch path ---------------------------------------------------------------------------------

def test_blocks_store_no_mask_and_code_exactly_what_a_block_mask_on_the_same_channels_codes():
    channels = [[1, 5, 7, 8, 11, 20, 21, 30, 33, 40, 41, 50, 52, 60, 61, 63], list(range(0, 64, 4))]
    fixed = calibrated(KEYS, static_mask(2, channels))
    per_block = TurboQuantizer(QuantSpec(**{**KEYS, "outlier_channels": "block"}, path="keys"), D, S, torch.float32)
    assert "outlier_mask" not in fixed.block_spec() and "outlier_mask" in per_block.block_spec()
    assert per_block.block_nbytes() - fixed.block_nbytes() == D // 8
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 1, S, D, generator=g)
    group = torch.tensor([0, 1, 1, 0])
    for block, head in enumerate(group.tolist()):  # each block's own top channels are its head's calibrated ones
        x[block, 0][:, channels[head]] *= 6
    a, b = fixed.encode_blocks(x, group), per_block.encode_blocks(x, group)
    assert torch.equal(unpack_mask(b["outlier_mask"]), unpack_mask(static_mask(2, channels))[group])
    for name, t in a.items():
        assert torch.equal(t, b[name]), name
    torch.testing.assert_close(fixed.decode_blocks(a, group), per_block.decode_blocks(b, group))


def test_attention_in_the_rotated_domains_equals_attention_over_decoded_blocks():
    q = calibrated(KEYS, static_mask(2, [list(range(0, 64, 4)), list(range(16))]))
    v = calibrated(VALUES, static_mask(2, [list(range(32)), list(range(1, 64, 2))]), path="values")
    x = torch.randn(6, 1, S, D) * 2 + 0.5
    group_blocks = torch.tensor([0, 0, 0, 1, 1, 1])  # stream 0 on head 0, stream 1 on head 1
    group = torch.tensor([0, 1])
    for quantizer in (q, v):
        blocks = quantizer.encode_blocks(x, group_blocks)
        chunk = {name: t.reshape(2, 3, *t.shape[1:]) for name, t in blocks.items()}  # (Sc=2, nb=3, ...)
        query = torch.randn(2, 1, 4, D)
        torch.testing.assert_close(quantizer.chunk_scores(query, chunk, group),
                                   BlockQuantizer.chunk_scores(quantizer, query, chunk, group), atol=1e-4, rtol=1e-4)
        probs = torch.softmax(torch.randn(2, 1, 4, 3 * S), dim=-1)
        torch.testing.assert_close(quantizer.chunk_values(probs, chunk, group),
                                   BlockQuantizer.chunk_values(quantizer, probs, chunk, group), atol=1e-5, rtol=1e-4)


# --- the kernels against the dense reference ---------------------------------------------------------------------

SIDES = {
    "turboquant-calibrated-channels": (QuantSpec(**KEYS, path="keys"), QuantSpec(**VALUES, path="values")),
    "turboquant-calibrated-channels-norm8-quarter": (
        QuantSpec(**{**KEYS, "extra_bits": 0.25, "outlier_channel_fraction": 0.125}, norm_bits=8, path="keys"),
        QuantSpec(**VALUES, norm_bits=8, path="values")),
    "turboquant-calibrated-channels-query-scale": (QuantSpec(**KEYS, channel_scale="query", path="keys"),
                                                   QuantSpec(method="turboquant", bits=2, extra_bits=0.5, path="values")),
}
QJL_SIDES = {"turboquant-calibrated-channels-qjl": (QuantSpec(**KEYS, qjl=True, path="keys"), QuantSpec(**VALUES, path="values"))}


@pytest.fixture
def sides(monkeypatch):
    add_sides(monkeypatch, {**SIDES, **QJL_SIDES})


@needs_numba
@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("head_dim, gqa, bs", [(64, 4, 32), (256, 1, 16), (128, 8, 16)])
def test_cpu_kernel_reads_calibrated_channels_as_the_dense_reference(side, head_dim, gqa, bs, sides):
    from kvtool.runtime.kernels.cpu_decode import covers, cpu_decode_attention
    from tests.test_cpu_decode import _cpu_args
    from tests.test_kernels import build_case

    args, reference = build_case(side, head_dim, gqa, "cpu", seed=head_dim + gqa + bs, bs=bs)
    assert any(fmt.static_mask for fmt in args["formats"])
    assert covers(args["formats"], torch.float16, head_dim) is None
    torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("side", [*SIDES, *QJL_SIDES])
@pytest.mark.parametrize("head_dim, gqa, bs", [(64, 4, 32), (256, 1, 16)])
def test_triton_kernel_reads_calibrated_channels_as_the_dense_reference(side, head_dim, gqa, bs, device, sides):
    """Under the interpreter on CPU (CI), on CUDA with the ``gpu`` marker; splits over streams and sinks too."""
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention
    from tests.test_kernels import build_case

    args, reference = build_case(side, head_dim, gqa, device, seed=head_dim + gqa + bs + 5, bs=bs)
    for splits in (1, 3):
        out = paged_decode_attention(**args, splits=splits, kernel="general")
        torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)


# --- generation ----------------------------------------------------------------------------------------------------

RECIPE = Recipe(
    name="tq-calibrated", keys=QuantSpec(**KEYS, norm_bits=8, path="keys"), values=QuantSpec(**VALUES, norm_bits=8, path="values"),
    cache=CacheSpec(sink_tokens=2, recent_tokens=0, block_size=16, float_block_size=4),
)


def _calibrated_runtime(model, recipe, backend):
    """A runtime with channels fitted on random text through the real calibration path (`QueryKeyMoments`)."""
    from kvtool.capture import stream_queries
    from kvtool.models.adapter import adapter_for
    from kvtool.runtime.attach import CompressedRuntime

    moments = QueryKeyMoments(skip_first=recipe.cache.sink_tokens)
    windows = torch.randint(3, 100, (2, 48), generator=torch.Generator().manual_seed(0))
    stream_queries(model, windows, moments.observe, batch_size=2)
    geometry = adapter_for(model).geometry
    fitted = fit_layers(recipe, geometry.head_dim, geometry.num_layers, queries=moments)
    return CompressedRuntime.from_recipe(model, recipe, layer_tensors=fitted, backend=backend)


def _generate(runtime, ids, mask, tokens=24):
    from kvtool.models.cache_argument import with_cache

    cache = runtime.new_cache()
    with torch.no_grad():
        out = runtime.model.generate(ids, attention_mask=mask, **with_cache(cache), max_new_tokens=tokens, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True)
    return out, cache


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_kernels_generate_the_torch_paths_tokens_and_hold_no_masks(family):
    from tests.tiny_models import featured_model, tiny_model, tiny_tokenizer_free_inputs

    model = tiny_model("llama", kv_heads=2) if family == "llama" else featured_model(family)
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=70)
    by_torch, torch_cache = _generate(_calibrated_runtime(model, RECIPE, "torch"), ids, mask)
    backends = [b for b, m in (("numba", "numba"), ("triton", "triton")) if importlib.util.find_spec(m) is not None]
    for backend in backends:
        out, cache = _generate(_calibrated_runtime(model, RECIPE, backend), ids, mask)
        report = cache.memory_report()
        assert report["backend"] == backend and report["kernel_steps"] >= 10 * model.config.num_hidden_layers
        assert torch.equal(by_torch.sequences, out.sequences)
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(by_torch.logits), rtol=2e-3, atol=2e-3)
        assert report["cache_bytes"] == torch_cache.memory_report()["cache_bytes"]
    blocks = sum(int(layer.store.body_len.sum()) for layer in torch_cache.layers)
    assert blocks > 0
    assert all("k.outlier_mask" not in layer.store.body_pool.tensors for layer in torch_cache.layers)
    per_block = dataclasses.replace(RECIPE, keys=dataclasses.replace(RECIPE.keys, outlier_channels="block"),
                                    values=dataclasses.replace(RECIPE.values, outlier_channels="block"))
    from kvtool.runtime.attach import CompressedRuntime

    _, block_cache = _generate(CompressedRuntime.from_recipe(model, per_block), ids, mask)
    assert [int(layer.store.body_len.sum()) for layer in block_cache.layers] == [
        int(layer.store.body_len.sum()) for layer in torch_cache.layers]
    head_dim = torch_cache.layers[0].store.layout.head_dim
    saved = block_cache.memory_report()["cache_bytes"] - torch_cache.memory_report()["cache_bytes"]
    assert saved == blocks * 2 * head_dim // 8  # two masks (keys, values) of D bits per block


def test_a_runtime_without_an_artifact_is_refused_with_the_fix():
    from kvtool.runtime.attach import CompressedRuntime
    from tests.tiny_models import tiny_model

    with pytest.raises(RecipeError, match="calibrated outlier_channels.*kvtool calibrate"):
        CompressedRuntime.from_recipe(tiny_model("llama", kv_heads=2), RECIPE)
