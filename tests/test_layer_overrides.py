"""Per-layer overrides (``layer_overrides``): parsing and errors, each layer's store at its own bits, bytes as predicted.

The oracle for storage is the store itself (its body pool's block bytes and tensor shapes) and a
uniform recipe at the override's width: after a prefill (attention over the new tokens only, in
float) every layer's input is the same whatever the recipe, so an overridden layer must hold
exactly what the uniform recipe at its width holds, and the other layers what the base holds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtool.errors import RecipeError
from kvtool.models.cache_argument import with_cache
from kvtool.plan_bytes import predict_cache_bytes
from kvtool.recipe import CalibrationSpec, dump_recipe, load_recipe, recipe_from_dict
from kvtool.runtime.attach import CompressedRuntime
from tests.tiny_models import tiny_model


def kivi(bits: int, overrides=None) -> dict:
    raw = {
        "name": f"t{bits}",
        "keys": {"method": "uniform", "bits": bits, "axis": "channel"},
        "values": {"method": "uniform", "bits": bits, "axis": "token", "group_size": 32},
        "cache": {"block_size": 32, "sink_tokens": 2, "recent_tokens": 16, "float_dtype": "float16"},
    }
    if overrides is not None:
        raw["layer_overrides"] = overrides
    return raw


def test_overrides_parse_resolve_and_round_trip_through_yaml():
    recipe = recipe_from_dict(kivi(4, [{"layers": "1-2", "keys": {"bits": 2}, "values": {"bits": 2}},
                                       {"layers": [0], "values": {"method": "none"}}]))
    assert [o.layers for o in recipe.layer_overrides] == [(1, 2), (0,)]
    assert (recipe.for_layer(1).keys.bits, recipe.for_layer(1).values.bits) == (2, 2)
    assert recipe.for_layer(0).values.method == "none" and recipe.for_layer(0).values.bits == 16
    assert recipe.for_layer(0).keys.bits == 4 and recipe.for_layer(3).keys.bits == 4
    assert not recipe.for_layer(3).layer_overrides  # resolved recipes carry no overrides
    again = recipe_from_dict(__import__("yaml").safe_load(dump_recipe(recipe)))
    assert again == recipe and again.layer_overrides == recipe.layer_overrides
    assert "layer_overrides" not in load_recipe("kivi-4bit").to_dict()  # recipes without overrides keep their form
    assert not recipe.with_bits(8).layer_overrides


@pytest.mark.parametrize("overrides,match", [
    ([{"layers": [0, -1], "keys": {"bits": 2}}], r"layer_overrides\[0\].layers.*-1 is not a layer index"),
    ([{"layers": "3-1", "keys": {"bits": 2}}], r"runs backwards"),
    ([{"layers": [0, 1]}], r"layer_overrides\[0\]'.*changes nothing"),
    ([{"layers": [0], "keys": {"bits": 2}}, {"layers": "0-1", "values": {"bits": 2}}],
     r"layer_overrides\[1\].layers.*layer 0 is already overridden by layer_overrides\[0\]"),
    ([{"layers": [0, 0], "keys": {"bits": 2}}], r"listed twice"),
    ([{"layers": [0], "keys": {"bits": 5}}], r"layer_overrides\[0\].keys.bits.*5 is not supported by 'uniform'"),
    ([{"layers": [0], "keys": {"axis": "token"}}], r"layer_overrides\[0\].keys.axis.*cannot be set per layer"),
    ([{"layers": [0], "values": {"method": "int_static"}}], r"layer_overrides\[0\].values.method.*learns from calibration"),
    ([{"layer": [0], "keys": {"bits": 2}}], r"layer_overrides\[0\].layer' is unknown"),
    ({"layers": [0]}, r"expected a list"),
])
def test_bad_overrides_name_the_field_and_the_fix(overrides, match):
    with pytest.raises(RecipeError, match=match):
        recipe_from_dict(kivi(4, overrides))


def test_overrides_are_refused_on_recipes_that_learn_from_data():
    raw = load_recipe("kvquant-3bit-1pct").to_dict()
    raw["layer_overrides"] = [{"layers": [0], "values": {"bits": 2}}]
    with pytest.raises(RecipeError, match="layer_overrides.*nuq, fitted per layer"):
        recipe_from_dict(raw)


def test_learns_from_data_agrees_with_the_quantizers():
    from kvtool.methods.registry import quantizer_class

    for path in sorted(__import__("kvtool.recipe", fromlist=["x"]).bundled_recipe_dir().glob("*.yaml")):
        recipe = load_recipe(path)
        for spec in (recipe.keys, recipe.values):
            assert spec.learns_from_data == quantizer_class(spec.method).requires_fit(spec), (path.name, spec.method)


def test_layers_beyond_the_model_are_refused_at_attach():
    recipe = recipe_from_dict(kivi(4, [{"layers": [1, 3], "keys": {"bits": 2}}]))
    with pytest.raises(RecipeError, match=r"layers \[3\], but the model has 3 layers \(0-2\)"):
        CompressedRuntime.from_recipe(tiny_model("llama", layers=3), recipe)


def prefill(runtime, ids):
    cache = runtime.new_cache()
    with torch.no_grad():
        logits = runtime.model(input_ids=ids, **with_cache(cache), use_cache=True).logits
    return cache, logits


def test_overridden_layers_store_the_override_bits_and_hold_the_predicted_bytes():
    model = tiny_model("llama", layers=4)
    mixed = recipe_from_dict(kivi(4, [{"layers": [1, 2], "keys": {"bits": 2}, "values": {"bits": 2}}]))
    ids = torch.randint(3, 100, (2, 150), generator=torch.Generator().manual_seed(0))
    caches = {name: prefill(CompressedRuntime.from_recipe(model, recipe_from_dict(raw)), ids)[0]
              for name, raw in (("4", kivi(4)), ("2", kivi(2)))}
    runtime = CompressedRuntime.from_recipe(model, mixed)
    cache, _ = prefill(runtime, ids)
    for index, layer in enumerate(cache.layers):
        width = "2" if index in (1, 2) else "4"
        same = caches[width].layers[index]
        assert layer.key_format.spec.bits == layer.value_format.spec.bits == int(width)
        assert layer.store.body_pool.block_nbytes() == same.store.body_pool.block_nbytes()
        for name, tensor in layer.store.body_pool.tensors.items():
            assert tensor.shape[1:] == same.store.body_pool.tensors[name].shape[1:], (index, name)
        for got, want in zip(layer.decoded(), same.decoded()):  # the very same stored blocks
            assert torch.equal(got, want), index
    four, two = (caches[w].layers[0].store.body_pool.block_nbytes() for w in ("4", "2"))
    assert two < four
    held = cache.nbytes()
    assert abs(predict_cache_bytes(runtime, 150, 2) - held) <= 0.02 * held
    assert caches["2"].nbytes() < held < caches["4"].nbytes()


def test_decoding_with_overrides_differs_from_both_widths_and_all_layers_overridden_is_the_low_width():
    model = tiny_model("llama", layers=3)
    ids = torch.randint(3, 100, (1, 120), generator=torch.Generator().manual_seed(1))

    def next_logits(raw):
        cache, _ = prefill(CompressedRuntime.from_recipe(model, recipe_from_dict(raw)), ids[:, :-1])
        with torch.no_grad():
            return model(input_ids=ids[:, -1:], **with_cache(cache), use_cache=True).logits

    four, two = next_logits(kivi(4)), next_logits(kivi(2))
    mixed = next_logits(kivi(4, [{"layers": [0], "keys": {"bits": 2}, "values": {"bits": 2}}]))
    everywhere = next_logits(kivi(4, [{"layers": "0-2", "keys": {"bits": 2}, "values": {"bits": 2}}]))
    assert not torch.equal(mixed, four) and not torch.equal(mixed, two)
    assert torch.equal(everywhere, two)


def test_calibration_measures_each_layer_at_its_width_and_the_artifact_keeps_the_overrides(kvref, tmp_path):
    from kvtool import api
    from kvtool.artifact import load_artifact, save_artifact
    from tests.test_plan import data

    model, tokenizer = kvref
    base = dataclasses.replace(load_recipe("kivi-4bit"), calibration=CalibrationSpec(samples=1, seq_len=128))
    mixed = dataclasses.replace(base, name="mixed", layer_overrides=recipe_from_dict(
        kivi(4, [{"layers": [0, 5], "keys": {"bits": 2}, "values": {"bits": 2}}])).layer_overrides)
    artifacts = {r.name: api.calibrate_loaded(model, tokenizer, data(), r, batch_size=1) for r in (base, mixed)}
    sqnr = lambda name, layer: artifacts[name].tensors[f"quality.layers.{layer}.values.sqnr_db"]  # noqa: E731
    assert bool((sqnr("mixed", 0) < sqnr("kivi-4bit", 0) - 6).all())  # 2 bits: ~12 dB less
    assert torch.equal(sqnr("mixed", 1), sqnr("kivi-4bit", 1))
    save_artifact(tmp_path / "m.safetensors", dataclasses.replace(artifacts["mixed"], kind="deployable"))
    runtime = CompressedRuntime.from_artifact(model, load_artifact(tmp_path / "m.safetensors"))
    assert runtime.recipe == mixed and runtime.recipe.for_layer(5).values.bits == 2


def test_the_recipe_summary_names_the_overridden_layers():
    from kvtool.recipe_summary import recipe_summary

    summary = recipe_summary(recipe_from_dict(kivi(4, [{"layers": "0-1", "values": {"bits": 2}}])))
    assert summary["values"] == "uniform 4-bit per token / 32 ch; layers [0, 1]: uniform 2-bit per token / 32 ch"
    assert summary["keys"] == "uniform 4-bit per channel"


def test_overrides_built_in_code_are_validated_too():
    from kvtool.recipe_layers import LayerOverride

    twice = (LayerOverride((0, 1), keys=(("bits", 2),)), LayerOverride((1,), values=(("bits", 2),)))
    with pytest.raises(RecipeError, match="one entry only"):
        dataclasses.replace(load_recipe("kivi-4bit"), layer_overrides=twice)
    with pytest.raises(RecipeError, match=r"layer_overrides\[0\].keys.bits"):
        dataclasses.replace(load_recipe("kivi-4bit"), layer_overrides=(LayerOverride((0,), keys=(("bits", 16),)),))


# --- layers: sliding / full (resolved against the model) -----------------------------------------


def test_layer_kinds_parse_round_trip_and_resolve_per_model():
    from kvtool.recipe_layers import resolve_layer_kinds

    recipe = recipe_from_dict(kivi(4, [{"layers": "sliding", "keys": {"bits": 2}}, {"layers": [5], "values": {"bits": 2}}]))
    assert recipe.layer_overrides[0].kind == "sliding" and recipe.layer_overrides[0].layers == ()
    again = recipe_from_dict(__import__("yaml").safe_load(dump_recipe(recipe)))
    assert again == recipe and again.to_dict()["layer_overrides"][0]["layers"] == "sliding"
    with pytest.raises(RecipeError, match="name the sliding layers, which only the model can tell"):
        recipe.for_layer(0)  # never silently the base bits
    gemma_like = resolve_layer_kinds(recipe, (512, 512, None, 512, 512, None))
    assert [o.layers for o in gemma_like.layer_overrides] == [(0, 1, 3, 4), (5,)]
    assert [gemma_like.for_layer(i).keys.bits for i in range(6)] == [2, 2, 4, 2, 2, 4]
    assert gemma_like.for_layer(5).values.bits == 2 and gemma_like.for_layer(0).values.bits == 4
    full_only = resolve_layer_kinds(recipe, (None,) * 6)  # a model without sliding layers: the entry changes nothing
    assert [o.layers for o in full_only.layer_overrides] == [(5,)]
    full = recipe_from_dict(kivi(4, [{"layers": "full", "values": {"bits": 2}}]))
    assert [o.layers for o in resolve_layer_kinds(full, (8, None, 8)).layer_overrides] == [(1,)]
    plain = recipe_from_dict(kivi(4, [{"layers": [1], "keys": {"bits": 2}}]))
    assert resolve_layer_kinds(plain, (8, None)) is plain


@pytest.mark.parametrize("overrides,match", [
    ([{"layers": "sliding", "keys": {"bits": 2}}, {"layers": "sliding", "values": {"bits": 2}}],
     r"layer_overrides\[1\].layers.*sliding layers are already overridden by layer_overrides\[0\]"),
    ([{"layers": "sliding"}], r"layer_overrides\[0\]'.*changes nothing"),
    ([{"layers": "global", "keys": {"bits": 2}}], r"'global' is not a layer index, a range .* \(sliding or full, alone\)"),
    ([{"layers": ["sliding"], "keys": {"bits": 2}}], r"'sliding' is not a layer index"),
    ([{"layers": "full", "keys": {"bits": 5}}], r"layer_overrides\[0\].keys.bits.*5 is not supported"),
])
def test_bad_layer_kinds_name_the_field_and_the_fix(overrides, match):
    with pytest.raises(RecipeError, match=match):
        recipe_from_dict(kivi(4, overrides))


def test_a_layer_named_by_index_and_by_kind_is_refused_at_attach():
    from tests.tiny_models import featured_model

    recipe = recipe_from_dict(kivi(4, [{"layers": [0], "values": {"bits": 2}}, {"layers": "sliding", "keys": {"bits": 2}}]))
    with pytest.raises(RecipeError, match=r"changes the sliding layers, but layers \[0\] among them are also listed"):
        CompressedRuntime.from_recipe(featured_model("gemma3_text"), recipe)


def test_sliding_layers_store_the_override_on_gemma3_and_the_artifact_keeps_the_kind(tmp_path):
    from kvtool import api
    from kvtool.artifact import load_artifact, save_artifact
    from kvtool.recipe_summary import recipe_summary
    from tests.tiny_models import featured_model

    model = featured_model("gemma3_text")  # layer 0 sliding, layer 1 full attention
    raw = kivi(4, [{"layers": "sliding", "keys": {"bits": 2}, "values": {"bits": 2}}])
    raw["cache"]["recent_tokens"] = 0
    recipe = recipe_from_dict(raw)
    runtime = CompressedRuntime.from_recipe(model, recipe)
    assert runtime.recipe.layer_overrides[0].layers == (0,)
    ids = torch.randint(3, 100, (2, 80), generator=torch.Generator().manual_seed(0))
    cache, _ = prefill(runtime, ids)
    assert [(layer.key_format.spec.bits, layer.value_format.spec.bits) for layer in cache.layers] == [(2, 2), (4, 4)]
    assert recipe_summary(recipe)["keys"] == "uniform 4-bit per channel; sliding layers: uniform 2-bit per channel"

    class Chars:  # calibration reads token ids; the tiny model has no tokenizer of its own
        def __call__(self, text, **_):
            return {"input_ids": [3 + ord(c) % 90 for c in text]}

    calibration = dataclasses.replace(recipe, calibration=CalibrationSpec(samples=1, seq_len=64))
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    artifact = api.calibrate_loaded(model, Chars(), str(tmp_path / "text.txt"), calibration, batch_size=1)
    assert artifact.manifest["recipe"]["layer_overrides"][0]["layers"] == "sliding"
    sqnr = artifact.tensors
    assert bool((sqnr["quality.layers.0.keys.sqnr_db"] < sqnr["quality.layers.1.keys.sqnr_db"]).all())
    save_artifact(tmp_path / "a.safetensors", dataclasses.replace(artifact, kind="deployable"))
    loaded = CompressedRuntime.from_artifact(model, load_artifact(tmp_path / "a.safetensors"))
    assert [loaded.recipe.for_layer(i).keys.bits for i in (0, 1)] == [2, 4]
