"""`kvtool export --format vllm`: the folder follows the contract vLLM's loader reads (see kvtool/export_vllm.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from kvtool import api
from kvtool.cli import app
from kvtool.errors import ArtifactError
from kvtool.export_vllm import attention_prefixes, check_vllm_recipe
from kvtool.methods.quant.fp8 import Fp8Quantizer
from kvtool.models.adapter import adapter_for
from kvtool.models.loading import load_model
from kvtool.recipe import CacheSpec, load_recipe
from tests.conftest import shared_path


def stories() -> str:
    return str(shared_path("models/stories260K"))


def stories_data() -> str:
    return f"{shared_path('data/text/tinystories_val_head.txt')}[0:0.05]"


@pytest.fixture(scope="module", params=["layer", "head"])
def exported(request, tmp_path_factory):
    """(calibration artifact path, vLLM folder, granularity) for fp8-e4m3-static at per-layer or per-head scales."""
    tmp = tmp_path_factory.mktemp(f"vllm-{request.param}")
    recipe = load_recipe("fp8-e4m3-static")
    recipe = dataclasses.replace(
        recipe, keys=dataclasses.replace(recipe.keys, granularity=request.param),
        values=dataclasses.replace(recipe.values, granularity=request.param),
    )
    calib = tmp / "calib.safetensors"
    api.calibrate(stories_data(), calib, stories(), recipe, samples=2, seq_len=64)
    folder = tmp / "vllm-model"
    api.export(calib, folder, stories(), format="vllm")
    return calib, folder, request.param


def test_config_declares_a_static_fp8_kv_cache_scheme(exported):
    _, folder, granularity = exported
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["config_groups"] == {}
    scheme = quant["kv_cache_scheme"]
    assert (scheme["num_bits"], scheme["type"], scheme["dynamic"], scheme["symmetric"]) == (8, "float", False, True)
    assert scheme["strategy"] == {"layer": "tensor", "head": "attn_head"}[granularity]


def test_scales_have_vllm_names_shapes_dtypes_and_the_index_lists_every_file(exported):
    _, folder, granularity = exported
    model, _ = load_model(stories())
    adapter = adapter_for(model)
    heads, layers = adapter.geometry.num_kv_heads, adapter.geometry.num_layers
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(folder / "kv_cache_scales.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        expected = {f"model.layers.{i}.self_attn.{kv}_scale" for i in range(layers) for kv in "kv"}
        assert names == expected
        for name in names:
            t = handle.get_tensor(name)
            assert t.dtype == torch.float32 and t.shape == ((1,) if granularity == "layer" else (heads,))
            assert bool((t > 0).all())
            assert index[name] == "kv_cache_scales.safetensors"
            # vLLM's maybe_remap_kv_scale_name: P.k_scale -> P.attn.k_scale, P = an attention module
            assert name.replace("_scale", "").rsplit(".", 1)[0] in dict(model.named_modules())
    for file in set(index.values()):
        with safe_open(str(folder / file), framework="pt") as handle:  # every tensor the index names exists there
            assert {n for n, f in index.items() if f == file} <= set(handle.keys())


def test_scales_reproduce_kvtools_own_fp8_quantization(exported):
    calib, folder, _ = exported
    artifact = api.load_artifact(calib)
    recipe = load_recipe("fp8-e4m3-static")
    keys = torch.randn(1, 4, 2, 32, 8) * 3  # (B, H_kv, N, S, D) of stories260K
    with safe_open(str(folder / "kv_cache_scales.safetensors"), framework="pt") as handle:
        for layer in range(2):
            spec = dataclasses.replace(recipe.keys, granularity=artifact.manifest["recipe"]["keys"]["granularity"])
            ours = Fp8Quantizer(spec, 8, 32, torch.float32, {"scale": artifact.layer_tensors(layer)["keys.scale"]})
            k_scale = handle.get_tensor(f"model.layers.{layer}.self_attn.k_scale").reshape(1, -1, 1, 1, 1)
            served = (keys / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * k_scale  # vLLM's semantics
            torch.testing.assert_close(ours.roundtrip(keys), served, rtol=0, atol=0)


def test_the_folder_holds_the_models_own_weights(exported):
    # (transformers itself would need the compressed-tensors package to open a folder with this config, as it does
    # for llm-compressor's output; vLLM reads it natively)
    _, folder, _ = exported
    original, _ = load_model(stories())
    state = original.state_dict()
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    weights = {name: file for name, file in index.items() if not name.endswith(("k_scale", "v_scale"))}
    assert weights and set(weights) <= set(state)
    for file in set(weights.values()):
        with safe_open(str(folder / file), framework="pt") as handle:
            for name in (n for n, f in weights.items() if f == file):
                torch.testing.assert_close(handle.get_tensor(name), state[name], rtol=0, atol=0)


def test_recipes_vllm_cannot_reproduce_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ArtifactError, match="calibrate with the recipe fp8-e4m3-static"):
        check_vllm_recipe(load_recipe("int8-static-channel"))
    recipe = load_recipe("fp8-e4m3-static")
    with pytest.raises(ArtifactError, match="cache.sink_tokens: 0"):
        check_vllm_recipe(dataclasses.replace(recipe, cache=CacheSpec(sink_tokens=4, recent_tokens=0)))
    with pytest.raises(ArtifactError, match="calibrate with the recipe fp8-e4m3-static"):
        check_vllm_recipe(load_recipe("fp8-e4m3"))  # dynamic per-block scales: nothing to export


def test_cli_export_vllm_into_a_non_empty_folder_fails_cleanly(exported, tmp_path):
    calib, _, _ = exported
    (tmp_path / "x").write_text("keep me")
    result = CliRunner().invoke(app, ["export", "-c", str(calib), "-o", str(tmp_path), "-m", stories(), "--format", "vllm"])
    assert result.exit_code != 0 and "not empty" in result.output and "Traceback" not in result.output
    assert (tmp_path / "x").read_text() == "keep me"


def test_the_real_vllm_check_matches_every_layer_and_flags_a_scale_vllm_did_not_load(exported):
    """benchmarks/vllm_load.py (run in vLLM's own environment) reads the folder's scales and compares them with what
    vLLM's attention layers hold after loading; here its comparison runs on what a load gives: every scale as exported
    (equal), one left at vLLM's 1.0 default, one layer vLLM did not build."""
    from benchmarks.vllm_load import compare, exported_scales

    _, folder, _ = exported
    scales = exported_scales(folder)
    model, _ = load_model(stories())
    assert set(scales) == set(attention_prefixes(model, adapter_for(model)))
    loaded = {f"{prefix}.attn": {"k_scale": s["k_scale"], "v_scale": s["v_scale"], "kv_cache_dtype": "fp8"} for prefix, s in scales.items()}
    assert all(row["equal"] for row in compare(scales, loaded))
    first, last = sorted(scales)[0], sorted(scales)[-1]
    loaded[f"{first}.attn"]["v_scale"] = [1.0] * len(scales[first]["v_scale"])  # not loaded: vLLM's default
    del loaded[f"{last}.attn"]
    rows = {row["layer"]: row for row in compare(scales, loaded)}
    assert not rows[first]["equal"] and not rows[last]["equal"] and rows[last]["vllm_module"] is None
    assert sum(row["equal"] for row in rows.values()) == len(scales) - 2
