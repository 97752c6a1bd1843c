"""FP8 (e4m3 / e5m2, dynamic per block or calibrated per layer / head) and static INT quantizers."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import DynamicCache

from kvtool.calibration import RangeStats, fit_layers, range_parts
from kvtool.capture import ChannelStats, stream_batches
from kvtool.errors import ArtifactError, RecipeError
from kvtool.methods.quant.fp8 import Fp8Quantizer
from kvtool.methods.quant.int_static import IntStaticQuantizer
from kvtool.models.adapter import adapter_for
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import QuantSpec, load_recipe
from kvtool.runtime.attach import CompressedRuntime
from tests.tiny_models import tiny_model

D, S = 64, 32


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(10 * torch.log10(x.square().sum() / (y.float() - x).square().sum()))


def heavy_tailed(shape, seed=0) -> torch.Tensor:
    """Gaussian K/V-like data with a few outlier channels (as real keys have)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 3] *= 10
    x[..., 17] += 4
    return x


def fp8(granularity="block", fmt="e4m3", fitted=None, scale_fit="amax") -> Fp8Quantizer:
    spec = QuantSpec(method="fp8", bits=8, fp8_format=fmt, granularity=granularity, scale_fit=scale_fit, path="keys")
    return Fp8Quantizer(spec, D, S, torch.float32, fitted)


@pytest.mark.parametrize("fmt, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_with_unit_scale_is_exactly_torch_float8_casting(fmt, dtype):
    x = heavy_tailed((1, 2, 3, S, D))  # within range: |x| < 448
    q = fp8("layer", fmt, fitted={"scale": torch.ones(1, 1)})
    storage = q.encode(x)
    assert storage["codes"].dtype == torch.uint8 and storage["codes"].shape == (1, 2, 3, S, D)
    torch.testing.assert_close(storage["codes"].view(dtype).float(), x.to(dtype).float(), rtol=0, atol=0)
    torch.testing.assert_close(q.decode(storage), x.to(dtype).float(), rtol=0, atol=0)


def test_fp8_saturates_instead_of_producing_nan():
    x = torch.full((1, 1, 1, S, D), 1e4)
    y = fp8("layer", fitted={"scale": torch.ones(1, 1)}).roundtrip(x)
    assert torch.isfinite(y).all() and float(y.max()) == 448.0  # torch's own cast would give NaN here


@pytest.mark.parametrize("fmt, floor_db", [("e4m3", 30.0), ("e5m2", 24.0)])
def test_fp8_dynamic_per_block_sqnr_floor(fmt, floor_db):
    # e4m3 keeps 3 mantissa bits (~ 31 dB on Gaussian data), e5m2 2 bits (~ 25 dB), whatever the scale
    x = heavy_tailed((2, 2, 4, S, D)) * 1e-3  # tiny values: the per-block scale lifts them out of the subnormals
    q = fp8("block", fmt)
    assert sqnr_db(x, q.roundtrip(x)) > floor_db
    assert q.bits_per_element() == pytest.approx(8 + 32 / (S * D))  # codes + one float32 scale per block


def ranges_of(x: torch.Tensor) -> RangeStats:
    """RangeStats over x (B, H, N, S, D) seen as keys (and keys before RoPE, and values)."""
    b, h, n, s, d = x.shape
    tokens = x.reshape(b, h, n * s, d)
    stats = RangeStats(max_tokens=256)
    stats.observe(0, tokens, tokens, tokens)
    return stats


@pytest.mark.parametrize("granularity, shape", [("layer", (1, 1)), ("head", (2, 1))])
def test_fp8_static_scale_is_calibration_amax_over_fp8_max(granularity, shape):
    x = heavy_tailed((1, 2, 4, S, D))
    spec = QuantSpec(method="fp8", bits=8, granularity=granularity, path="keys")
    fitted = Fp8Quantizer.fit_ranges(spec, D, S, *ranges_of(x).ranges(0, "keys"))
    assert fitted["scale"].shape == shape and fitted["scale"].dtype == torch.float32
    amax = x.abs().amax() if granularity == "layer" else x.abs().amax(dim=(0, 2, 3, 4))
    torch.testing.assert_close(fitted["scale"].flatten(), (amax / 448).flatten().expand(shape[0]))
    assert sqnr_db(x, fp8(granularity, fitted=fitted).roundtrip(x)) > 30.0


@pytest.mark.parametrize("bits, granularity, floor_db", [(8, "layer", 25.0), (8, "channel", 40.0), (4, "channel", 18.0), (4, "head", 4.0)])
@pytest.mark.parametrize("scale_fit", ["amax", "mse"])
def test_int_static_sqnr_floors_and_mse_never_worse_on_the_sample(bits, granularity, floor_db, scale_fit):
    x = heavy_tailed((1, 2, 4, S, D))
    stats = ranges_of(x)
    spec = QuantSpec(method="int_static", bits=bits, granularity=granularity, scale_fit=scale_fit, path="keys")
    fitted = IntStaticQuantizer.fit_ranges(spec, D, S, *stats.ranges(0, "keys"))
    q = IntStaticQuantizer(spec, D, S, torch.float32, fitted)
    assert q.bits_per_element() == bits  # codes only: the ranges live in the artifact
    got = sqnr_db(x, q.roundtrip(x))
    assert got > floor_db
    if scale_fit == "mse":
        amax_spec = dataclasses.replace(spec, scale_fit="amax")
        amax_q = IntStaticQuantizer(amax_spec, D, S, torch.float32, IntStaticQuantizer.fit_ranges(amax_spec, D, S, *stats.ranges(0, "keys")))
        assert got >= sqnr_db(x, amax_q.roundtrip(x)) - 1e-6


def test_int_static_in_range_values_on_the_grid_round_trip_exactly():
    lo, hi = torch.full((1, 1), -1.5), torch.full((1, 1), 2.25)  # step 0.25 at 4 bits
    q = IntStaticQuantizer(QuantSpec(method="int_static", bits=4, granularity="layer", path="keys"), D, S, torch.float32, {"lo": lo, "hi": hi})
    codes = torch.randint(0, 16, (1, 1, 2, S, D)).float()
    x = codes * 0.25 - 1.5
    torch.testing.assert_close(q.roundtrip(x), x, rtol=0, atol=0)
    assert float(q.roundtrip(x + 100).max()) == 2.25  # beyond the calibrated range: saturates


def test_static_methods_without_calibration_name_the_fix():
    with pytest.raises(ArtifactError, match="run kvtool calibrate"):
        fp8("head")
    with pytest.raises(RecipeError, match="kvtool calibrate"):
        CompressedRuntime.from_recipe(tiny_model("llama"), load_recipe("fp8-e4m3-static"))


def test_static_scales_from_other_model_are_refused():
    q = fp8("head", fitted={"scale": torch.ones(3, 1)})
    with pytest.raises(ArtifactError, match="cover 3 KV heads, the model has 2"):
        q.encode(torch.zeros(1, 2, 1, S, D))


@pytest.mark.parametrize("raw, message", [
    (dict(method="uniform", granularity="head"), "needs method 'fp8' or 'int_static'"),
    (dict(method="fp8", bits=8, fp8_format="e4m2"), r"'e4m2' is not one of \['e4m3', 'e5m2'\]"),
    (dict(method="fp8", bits=4), r"4 is not supported by 'fp8'; choose one of \[8\]"),
    (dict(method="int_static", bits=8, granularity="block"), r"'block' is not one of \['layer', 'head', 'channel'\]"),
    (dict(method="fp8", bits=8, scale_fit="mse"), "only calibrated"),
])
def test_recipe_validation_of_the_new_fields(raw, message):
    with pytest.raises(RecipeError, match=message):
        QuantSpec(path="keys", **raw)


def test_range_stats_see_every_token_past_the_sinks_of_post_rope_keys():
    model = tiny_model("llama")
    adapter = adapter_for(model)
    windows = torch.randint(3, 128, (3, 40), generator=torch.Generator().manual_seed(0))
    ranges, channels = RangeStats(max_tokens=16, skip_first=0), ChannelStats()
    with torch.no_grad():
        stream_batches(model, adapter, windows, [ranges, channels], batch_size=2)
    stats = channels.tensors()
    for layer in range(adapter.geometry.num_layers):
        lo, hi, sample = ranges.ranges(layer, "keys")
        assert sample.shape == (16, adapter.geometry.num_kv_heads, adapter.geometry.head_dim)  # bounded sample
        torch.testing.assert_close(torch.maximum(lo.abs(), hi.abs()), stats[f"layers.{layer}.keys.absmax"])


# --- pre-RoPE ranges do not depend on the positions calibration saw ------------------------------

CALIB_TOKENS, SERVED_TOKENS = 32, 512  # calibration windows, served context: 16x further than calibrated


def model_with_key_means() -> torch.nn.Module:
    """A tiny llama whose keys have per-channel means about twice their spread over tokens, as real keys
    have (KVQuant's outlier channels; a random model's keys are centred): a k_proj bias of std 0.3
    against a key spread of ~0.16."""
    model = tiny_model("llama", max_position_embeddings=1024, attention_bias=True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.self_attn.k_proj.bias  # (H_kv * D,)
            bias.copy_(0.3 * torch.randn(bias.shape, generator=generator))
    return model


def key_sqnr_near_and_far(recipe) -> tuple[float, float]:
    """Key SQNR (dB) of `model_with_key_means`' cache body at positions calibration saw (< CALIB_TOKENS) and far past them.

    The recipe's ranges are fitted as `kvtool calibrate` fits them (`RangeStats` over the parts the recipe
    reads, `fit_layers`) on windows of CALIB_TOKENS; a SERVED_TOKENS prompt is then prefilled into the
    runtime and its keys read back (re-rotated at their true positions when stored before RoPE).
    """
    model = model_with_key_means()
    adapter = adapter_for(model)
    sinks = recipe.cache.sink_tokens
    ranges = RangeStats(max_tokens=4096, skip_first=sinks, parts=range_parts(recipe))
    windows = torch.randint(3, 128, (32, CALIB_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stream_batches(model, adapter, windows, [ranges], batch_size=8)
    geometry = adapter.geometry
    fitted = fit_layers(recipe, geometry.head_dim, geometry.num_layers, ranges=ranges)
    cache = CompressedRuntime.from_recipe(model, recipe, fitted).new_cache()
    plain = DynamicCache(config=model.config)
    ids = torch.randint(3, 128, (1, SERVED_TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, **with_cache(cache), use_cache=True)
        model(input_ids=ids, **with_cache(plain), use_cache=True)
    body_end = sinks + int(cache.layers[0].store.body_len.min()) * recipe.cache.block_size  # quantized positions: [sinks, body_end)
    near, far = slice(sinks, CALIB_TOKENS), slice(body_end - 4 * CALIB_TOKENS, body_end)
    signal = {"near": 0.0, "far": 0.0}
    error = {"near": 0.0, "far": 0.0}
    for layer, reference in zip(cache.layers, plain.layers):
        keys, _, positions, valid = layer.decoded()  # (1, H, T, D), positions (1, H, T)
        assert bool(valid.all()) and positions[0, 0].tolist() == list(range(SERVED_TOKENS))
        for name, span in (("near", near), ("far", far)):
            signal[name] += float(reference.keys[:, :, span].float().square().sum())
            error[name] += float((keys[:, :, span] - reference.keys[:, :, span].float()).square().sum())
    return tuple(10 * math.log10(signal[name] / error[name]) for name in ("near", "far"))


@pytest.mark.parametrize("name", ["int8-static-channel", "int4-static-channel"])
def test_static_channel_recipes_keep_their_key_error_far_beyond_the_calibrated_positions(name):
    """Bundled per-channel static keys are stored before RoPE, so ranges fitted on short windows hold at 16x
    the length; stored after RoPE, the slow rotary pairs leave the angles calibration saw and are clipped."""
    recipe = load_recipe(name)
    assert recipe.keys.pre_rope, f"{name}: per-channel static key ranges must be calibrated before RoPE"
    near, far = key_sqnr_near_and_far(recipe)
    assert far > near - 2.0, (near, far)
    post_rope = dataclasses.replace(recipe, keys=dataclasses.replace(recipe.keys, pre_rope=False))
    post_near, post_far = key_sqnr_near_and_far(post_rope)
    assert post_far < post_near - 10.0, (post_near, post_far)  # the setup really reaches positions where post-RoPE ranges fail
    assert far > post_far + 10.0, (far, post_far)
