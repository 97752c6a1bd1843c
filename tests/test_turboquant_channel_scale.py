"""TurboQuant keys with ``channel_scale: query``: a calibrated per-channel scale s, codes of k / s, queries times s.

Mechanics: the scale is exact algebra (scores and decoded keys are those of the codes, in the model's own space),
the fit is the Cauchy-Schwarz optimum, the recipe refuses it where it means nothing, an artifact for another
model is refused, the kernels decline it with the reason, `kvtool calibrate` fits it end to end and generation
runs on it. Quality (real model): on Gemma-3-270M's queries and keys it cuts the score error the codes make.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtool.api import calibrate_loaded
from kvtool.calibration import build_quantizers
from kvtool.capture import QueryKeyMoments
from kvtool.errors import ArtifactError, RecipeError, RuntimeConfigError
from kvtool.eval.inner_product import inner_product_error
from kvtool.methods.base import BlockQuantizer
from kvtool.methods.quant.turboquant import TurboQuantizer
from kvtool.recipe import QuantSpec, load_recipe, recipe_from_dict
from kvtool.runtime.attach import CompressedRuntime
from kvtool.runtime.backend import resolve_backend
from tests.conftest import shared_path
from tests.tiny_models import tiny_model

D, S = 64, 32


def spec(channel_scale: str = "query", **fields) -> QuantSpec:
    return QuantSpec(method="turboquant", bits=fields.pop("bits", 3), channel_scale=channel_scale, **fields)


def scaled(scale: torch.Tensor, **fields) -> TurboQuantizer:
    return TurboQuantizer(spec(**fields), D, S, torch.float32, {"channel_scale": scale})


def scaled_recipe(name: str = "turboquant-k3.5-v2.5"):
    recipe = load_recipe(name)
    return dataclasses.replace(recipe, keys=dataclasses.replace(recipe.keys, channel_scale="query"))


def _profiles(seed: int = 0):
    """(H=2, D) channel RMS profiles of keys and queries that disagree (keys loud where queries are quiet)."""
    g = torch.Generator().manual_seed(seed)
    k_rms = torch.exp(torch.randn(2, D, generator=g) * 1.2)
    q_rms = torch.exp(torch.randn(2, D, generator=g) * 1.2)
    return k_rms, q_rms


@pytest.mark.parametrize("fields", [
    dict(bits=3), dict(bits=2, extra_bits=0.5), dict(bits=3, extra_bits=0.5, outlier_channel_fraction=0.25),
])
def test_scores_and_values_through_the_scale_are_those_of_the_decoded_keys(fields):
    scale = torch.rand(2, D) * 3 + 0.2
    q = scaled(scale, **fields)
    x = torch.randn(4, 1, S, D) * 2 + 0.5
    group = torch.tensor([0, 1, 1, 0])
    blocks = q.encode_blocks(x, group)
    chunk = {name: t[[0, 3, 1, 2]].reshape(2, 2, *t.shape[1:]) for name, t in blocks.items()}  # (Sc=2, nb=2, ...): head 0, head 1
    chunk_group = torch.tensor([0, 1])
    query = torch.randn(2, 1, 3, D)
    reference = BlockQuantizer.chunk_scores(q, query, chunk, chunk_group)  # q . decode(k): the decode multiplies s back
    torch.testing.assert_close(q.chunk_scores(query, chunk, chunk_group), reference, atol=1e-3, rtol=1e-4)
    probs = torch.softmax(torch.randn(2, 1, 3, 2 * S), dim=-1)
    expected = BlockQuantizer.chunk_values(q, probs, chunk, chunk_group)
    torch.testing.assert_close(q.chunk_values(probs, chunk, chunk_group), expected, atol=1e-4, rtol=1e-4)
    # the codes are those of k / s, and decoding multiplies s back: the model's space
    plain = TurboQuantizer(spec("none", **fields), D, S, torch.float32)
    s = scale[group][:, None, None, :]
    expected = plain.decode_blocks(plain.encode_blocks(x / s, group), group) * s
    torch.testing.assert_close(q.decode_blocks(blocks, group), expected, atol=1e-5, rtol=1e-5)


def test_the_fit_is_the_cauchy_schwarz_optimum_and_cuts_the_score_error():
    k_rms, q_rms = _profiles()
    s = TurboQuantizer.fit_queries(spec(), D, k_rms.square(), q_rms.square())["channel_scale"]  # (2, D)
    torch.testing.assert_close(s.square().mean(dim=-1), torch.ones(2))  # RMS 1
    ratio = s.square() * q_rms / k_rms  # constant per head at the optimum
    torch.testing.assert_close(ratio / ratio.mean(dim=-1, keepdim=True), torch.ones(2, D), atol=2e-3, rtol=0)  # floor 1e-6
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 16 * S, D, generator=g) * k_rms[:, None]  # per head: 16 blocks
    queries = torch.randn(2, 64, D, generator=g) * q_rms[:, None]
    group = torch.arange(2).repeat_interleave(16)
    errors = []
    for quantizer in (TurboQuantizer(spec("none"), D, S, torch.float32), scaled(s)):
        blocks = quantizer.encode_blocks(keys.reshape(32, 1, S, D), group)
        decoded = quantizer.decode_blocks(blocks, group).reshape(2, 16 * S, D)
        errors.append(float((queries @ (decoded - keys).transpose(1, 2)).square().mean()))
    predicted = float((((q_rms * k_rms).sum(-1)) ** 2 / (q_rms.square().sum(-1) * k_rms.square().sum(-1))).mean())
    assert errors[1] / errors[0] < 0.6  # the profiles disagree: a large cut
    assert errors[1] / errors[0] == pytest.approx(predicted, rel=0.35)  # about the Cauchy-Schwarz ratio


def test_silent_channels_are_clipped():
    k2, q2 = torch.ones(1, D), torch.ones(1, D)
    k2[0, 0], q2[0, 1] = 0.0, 0.0  # a key channel that never fires, a query channel that never reads
    s = TurboQuantizer.fit_queries(spec(), D, k2, q2)["channel_scale"]
    assert torch.isfinite(s).all() and float(s.max() / s.min()) <= 64 * 64 + 1


def test_moments_pool_each_kv_heads_query_heads_and_skip_the_sinks():
    moments = QueryKeyMoments(skip_first=2)
    q = torch.arange(1 * 4 * 5 * 3, dtype=torch.float32).reshape(1, 4, 5, 3)  # (B, H_q=4, T, D)
    k = torch.arange(1 * 2 * 5 * 3, dtype=torch.float32).reshape(1, 2, 5, 3)  # (B, H_kv=2, T, D)
    moments.observe(0, q, k, 1.0)
    moments.observe(0, q, k, 1.0)
    k_ms, q_ms = moments.moments(0)
    torch.testing.assert_close(k_ms, k[0, :, 2:].square().mean(dim=1))
    torch.testing.assert_close(q_ms, q[0, :, 2:].reshape(2, 2, 3, 3).square().mean(dim=(1, 2)))
    with pytest.raises(KeyError, match="longer calibration windows"):
        moments.moments(1)


@pytest.mark.parametrize("fields, match", [
    (dict(method="uniform", bits=4, channel_scale="query"), "needs method 'turboquant'"),
    (dict(method="turboquant", bits=3, channel_scale="query", path="values", axis="token"), "keys only"),
    (dict(method="turboquant", bits=3, channel_scale="output"), "is not one of"),
])
def test_the_recipe_refuses_it_where_it_means_nothing(fields, match):
    with pytest.raises(RecipeError, match=match):
        QuantSpec(**fields)


def test_per_layer_overrides_may_change_the_bits_only():
    """The scale is fitted from query and key moments, whatever the width: an override may set other bits (or
    restate the method), nothing else."""
    raw = {**scaled_recipe().to_dict(), "layer_overrides": [{"layers": "sliding", "keys": {"bits": 2}}]}
    assert recipe_from_dict(raw).layer_overrides[0].keys == (("bits", 2),)
    raw["layer_overrides"] = [{"layers": [0], "keys": {"bits": 4, "method": "turboquant"}}]
    assert recipe_from_dict(raw).for_layer(0).keys.channel_scale == "query"
    raw["layer_overrides"] = [{"layers": [0], "keys": {"method": "uniform"}}]
    with pytest.raises(RecipeError, match=r"layer_overrides\[0\]\.keys'.*only their bits, not method"):
        recipe_from_dict(raw)


def test_the_recipe_summary_says_so():
    from kvtool.recipe_summary import turboquant_summary

    assert "scaled by the calibration queries" in turboquant_summary(scaled_recipe().keys)
    assert "scaled" not in turboquant_summary(load_recipe("turboquant-k3.5-v2.5").keys)


def test_missing_or_foreign_scales_are_refused():
    with pytest.raises(RecipeError, match="run kvtool calibrate"):
        TurboQuantizer(spec(), D, S, torch.float32)
    with pytest.raises(ArtifactError, match="another model"):
        scaled(torch.ones(3, D)).check_kv_heads(2)
    scaled(torch.ones(2, D)).check_kv_heads(2)


SCALED_RECIPE = """
name: tq-scaled
description: turboquant-3bit with query-weighted key channels
keys: {method: turboquant, bits: 3, channel_scale: query}
values: {method: turboquant, bits: 3}
cache: {block_size: 32, sink_tokens: 4, recent_tokens: 0, float_dtype: float16}
calibration: {samples: 2, seq_len: 128, seed: 0}
"""


def test_calibrate_fits_it_exports_it_and_generation_runs_on_it(tmp_path):
    from kvtool import api

    recipe_file = tmp_path / "tq-scaled.yaml"
    recipe_file.write_text(SCALED_RECIPE)
    data = str(shared_path("data/text/tinystories_val_head.txt"))
    with pytest.raises(RecipeError, match="calibrate"):  # no fitted scales: refused, not silently unscaled
        api.generate(["Once upon a time"], recipe=str(recipe_file), max_new_tokens=2)
    calib = api.calibrate(data, tmp_path / "c.safetensors", None, str(recipe_file))  # the embedded kvref-5m (GQA 4/2)
    scale = calib.layer_tensors(0)["keys.channel_scale"]
    assert scale.shape == (2, 64) and torch.isfinite(scale).all() and float(scale.std()) > 0.05
    api.export(tmp_path / "c.safetensors", tmp_path / "a.safetensors")
    prompts = ["Once upon a time there was a", "The little dog ran to the park and"]
    result = api.generate(prompts, artifact=tmp_path / "a.safetensors", max_new_tokens=40, backend="torch")
    kernel = api.generate(prompts, artifact=tmp_path / "a.safetensors", max_new_tokens=40, backend="numba")
    assert kernel.memory["backend"] == "numba" and kernel.memory["kernel_steps"] > 0
    assert kernel.texts == result.texts  # the CPU kernel scales the query as the torch path does
    plain_file = tmp_path / "tq-plain.yaml"
    plain_file.write_text(SCALED_RECIPE.replace("channel_scale: query", "channel_scale: none"))
    plain = api.generate(prompts, recipe=str(plain_file), max_new_tokens=40)
    assert result.memory["cache_bytes"] == plain.memory["cache_bytes"]  # no cache bytes: the scale is in the artifact
    assert result.texts != plain.texts  # the scale reached the codes (the same codes would give the same tokens)


def test_layers_at_other_bits_read_the_same_fitted_scale(tmp_path):
    """``layer_overrides`` of bits on scaled keys: one calibration, layer 0 stores 2-bit keys with its fitted scale
    (fewer bytes than the 3-bit layers, generation runs on both backends alike)."""
    from kvtool import api
    from kvtool.artifact import load_artifact

    recipe_file = tmp_path / "tq-mixed.yaml"
    recipe_file.write_text(SCALED_RECIPE + "layer_overrides:\n  - {layers: [0], keys: {bits: 2}}\n")
    data = str(shared_path("data/text/tinystories_val_head.txt"))
    api.calibrate(data, tmp_path / "c.safetensors", None, str(recipe_file))
    api.export(tmp_path / "c.safetensors", tmp_path / "a.safetensors")
    artifact = load_artifact(tmp_path / "a.safetensors")
    assert all(artifact.layer_tensors(i)["keys.channel_scale"].shape == (2, 64) for i in range(2))
    prompts = ["Once upon a time there was a", "The little dog ran to the park and"]
    result = api.generate(prompts, artifact=tmp_path / "a.safetensors", max_new_tokens=40, backend="torch")
    kernel = api.generate(prompts, artifact=tmp_path / "a.safetensors", max_new_tokens=40, backend="numba")
    assert kernel.texts == result.texts and kernel.memory["kernel_steps"] > 0
    recipe = recipe_from_dict(artifact.manifest["recipe"])
    layer0, layer1 = (build_quantizers(recipe.for_layer(i), 64, fitted=artifact.layer_tensors(i))[0] for i in (0, 1))
    assert (layer0.spec.bits, layer1.spec.bits) == (2, 3)
    assert torch.equal(layer0.channel_scale.float(), artifact.layer_tensors(0)["keys.channel_scale"].float())
    plain_file = tmp_path / "tq-plain.yaml"
    plain_file.write_text(SCALED_RECIPE.replace("channel_scale: query", "channel_scale: none"))
    plain = api.generate(prompts, recipe=str(plain_file), max_new_tokens=40)  # every layer's keys at 3 bits
    assert result.memory["cache_bytes"] < plain.memory["cache_bytes"]


def test_both_kernels_take_it():
    from kvtool.runtime.backend import cpu_kernel_unsupported, kernel_unsupported, numba_available

    recipe = scaled_recipe("turboquant-3bit")
    keys = TurboQuantizer(recipe.keys, D, S, torch.float16, {"channel_scale": torch.ones(1, D)})
    values = TurboQuantizer(recipe.values, D, S, torch.float16)
    assert cpu_kernel_unsupported(recipe, (keys, values)) is None
    assert kernel_unsupported(recipe, (keys, values)) is None  # the Triton kernel scores the body against q * s
    expected = "numba" if numba_available() else "torch"
    assert resolve_backend("auto", torch.device("cpu"), recipe, (keys, values)) == expected


def test_layer_by_layer_calibration_says_it_does_not_fit_it():
    from kvtool.layer_by_layer import calibrate_layer_by_layer

    model = tiny_model("llama")
    with pytest.raises(RuntimeConfigError, match="without --layer-by-layer"):
        calibrate_layer_by_layer(model, None, scaled_recipe("turboquant-3bit"), torch.zeros(1, 8, dtype=torch.long),
                                 batch_size=1, max_fit_tokens=16)


@pytest.mark.slow
def test_gemma3_scores_lose_less_with_the_scale(gemma3):
    """Gemma-3-270M: calibrated on WikiText-2 validation text, measured on held-out test text (1 window of 512)."""
    model, tokenizer = gemma3
    recipe = recipe_from_dict({**scaled_recipe().to_dict(), "calibration": {"samples": 2, "seq_len": 512, "seed": 0}})
    artifact = calibrate_loaded(model, tokenizer, str(shared_path("data/text/wikitext2_valid.txt")), recipe, batch_size=2)
    tensors = [artifact.layer_tensors(i) for i in range(18)]
    text = shared_path("data/text/wikitext2_test.txt").read_text()[:20000]
    window = tokenizer(text, return_tensors="pt").input_ids[:, :512]
    errors = {}
    for name, runtime in (
        ("plain", CompressedRuntime.from_recipe(model, load_recipe("turboquant-k3.5-v2.5"))),
        ("scaled", CompressedRuntime.from_recipe(model, recipe, tensors)),
    ):
        errors[name] = inner_product_error(runtime, window).summary()["rel_mse"]
    # measured 2026-11-28: see benchmarks/RESULTS.md "Query-weighted key channels"
    assert errors["scaled"] < 0.75 * errors["plain"], errors


def test_the_bundled_sliding_recipe_calibrates_and_decodes_on_a_tiny_gemma3(tmp_path):
    """`turboquant-k2.5sliding-v2.5-qscale` (scaled keys, 2.5 bits on the sliding layers by kind, 16-token blocks) on
    a tiny Gemma 3 (layer 0 sliding, window 24): one calibration fits both layers' scales; the sliding layer stores
    2-bit keys, the global one 3-bit; the CPU kernel and the Triton kernel (interpreter) give the torch path's
    tokens."""
    from kvtool.models.cache_argument import with_cache
    from kvtool.recipe import CalibrationSpec
    from kvtool.runtime.backend import triton_available
    from tests.tiny_models import featured_model, tiny_tokenizer_free_inputs

    model = featured_model("gemma3_text", sliding_window=24, kv_heads=2)
    recipe = load_recipe("turboquant-k2.5sliding-v2.5-qscale")
    assert recipe.cache.block_size == 16 and recipe.keys.channel_scale == "query"

    class Chars:  # calibration reads token ids; the tiny model has no tokenizer of its own
        def __call__(self, text, **_):
            return {"input_ids": [3 + ord(c) % 90 for c in text]}

    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    calibration = dataclasses.replace(recipe, calibration=CalibrationSpec(samples=2, seq_len=96))
    artifact = calibrate_loaded(model, Chars(), str(tmp_path / "text.txt"), calibration, batch_size=1)
    deployable = dataclasses.replace(artifact, kind="deployable")
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=70)
    outputs = {}
    for backend in ["torch", "numba"] + (["triton"] if triton_available(torch.device("cpu")) else []):
        runtime = CompressedRuntime.from_artifact(model, deployable, backend=backend)
        assert [runtime.recipe.for_layer(i).keys.bits for i in (0, 1)] == [2, 3]
        cache = runtime.new_cache()
        with torch.no_grad():
            outputs[backend] = model.generate(ids, attention_mask=mask, **with_cache(cache), max_new_tokens=24,
                                              do_sample=False)
        if backend != "torch":
            assert cache.memory_report()["kernel_steps"] > 0, backend
    for backend, tokens in outputs.items():
        assert torch.equal(tokens, outputs["torch"]), backend
