"""`kvtool export --format vllm`: a model folder vLLM serves with ``--kv-cache-dtype fp8`` and kvtool's fp8 scales.

The contract, read from vLLM's and llm-compressor's source:

* ``config.json`` carries a compressed-tensors ``quantization_config`` with only a
  ``kv_cache_scheme`` (no weight groups: the weights stay as they are)::

      {"quant_method": "compressed-tensors", "format": "dense", "quantization_status": "frozen",
       "config_groups": {}, "ignore": [],
       "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": true, "dynamic": false,
                           "strategy": "tensor" | "attn_head"}}

  (compressed-tensors' ``QuantizationStrategy.TENSOR`` / ``ATTN_HEAD``); vLLM's
  ``CompressedTensorsConfig`` then gives every attention layer a KV-cache method that creates
  the ``k_scale`` / ``v_scale`` parameters;
* per attention module ``P`` (e.g. ``model.layers.3.self_attn``) the checkpoint holds
  ``P.k_scale`` and ``P.v_scale``, float32, shape (1,) for ``strategy: tensor`` or
  (num_kv_heads,) for ``attn_head``; vLLM's ``maybe_remap_kv_scale_name`` maps them to
  ``P.attn.k_scale`` / ``P.attn.v_scale``;
* the semantics are kvtool's fp8 static scales: stored ``fp8_e4m3(x / k_scale)``, read
  ``fp8 * k_scale`` (vLLM's ``BaseKVCacheMethod``), every token, keys after RoPE;
* the scales live in their own ``kv_cache_scales.safetensors``; ``model.safetensors.index.json``
  lists every tensor (vLLM only loads the files the index names).

Only what vLLM can reproduce is exported: fp8 e4m3 keys and values with calibrated
(``layer`` or ``head``) scales, keys after RoPE, no float sinks or recent window (vLLM stores
every token in fp8, so the scales must be calibrated on every token).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from kvtool.errors import ArtifactError, KvtoolError
from kvtool.recipe import Recipe, recipe_from_dict

SCALES_FILE = "kv_cache_scales.safetensors"
INDEX_FILE = "model.safetensors.index.json"
STRATEGIES = {"layer": "tensor", "head": "attn_head"}


def check_vllm_recipe(recipe: Recipe) -> None:
    """Refuse, with the fix, a calibration whose fp8 quantization vLLM would not reproduce."""
    name = recipe.name
    for part, spec in (("keys", recipe.keys), ("values", recipe.values)):
        if spec.method != "fp8" or spec.granularity not in STRATEGIES or spec.fp8_format != "e4m3":
            raise ArtifactError(
                f"--format vllm needs fp8 e4m3 {part} with calibrated scales (granularity layer or head); recipe "
                f"'{name}' has {part}.method {spec.method}: calibrate with the recipe fp8-e4m3-static"
            )
        if spec.pre_rope:
            raise ArtifactError("--format vllm: vLLM quantizes keys after RoPE; calibrate without keys.pre_rope")
    if recipe.keys.granularity != recipe.values.granularity:
        raise ArtifactError("--format vllm: keys and values need the same granularity (vLLM has one kv_cache_scheme)")
    if recipe.cache.sink_tokens or recipe.cache.recent_tokens:
        raise ArtifactError(
            f"--format vllm: recipe '{name}' keeps {recipe.cache.sink_tokens} sink and {recipe.cache.recent_tokens} recent "
            "tokens in float, but vLLM stores every token in fp8, so the scales must cover them: calibrate with "
            "cache.sink_tokens: 0 and cache.recent_tokens: 0 (as fp8-e4m3-static does)"
        )
    if recipe.evicts:
        raise ArtifactError("--format vllm: vLLM does not evict tokens; calibrate a recipe with eviction.policy: none")


def kv_cache_scheme(recipe: Recipe) -> dict:
    return {
        "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
        "strategy": STRATEGIES[recipe.keys.granularity], "group_size": None, "block_structure": None, "actorder": None,
        "observer": "minmax" if recipe.keys.scale_fit == "amax" else "mse", "observer_kwargs": {},
    }


def quantization_config(recipe: Recipe) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": "dense", "quantization_status": "frozen",
        "config_groups": {}, "ignore": [], "kv_cache_scheme": kv_cache_scheme(recipe),
    }


def attention_prefixes(hf_model, adapter) -> list[str]:
    """Qualified module name of every layer's attention (``model.layers.{i}.self_attn`` for Llama)."""
    names = {id(module): name for name, module in hf_model.named_modules()}
    return [names[id(adapter.attention(layer))] for layer in range(adapter.geometry.num_layers)]


def scale_tensors(artifact, hf_model, adapter) -> dict[str, torch.Tensor]:
    """``{P.k_scale, P.v_scale}`` float32 (1,) or (H_kv,) per layer, from the artifact's fitted fp8 scales."""
    recipe = recipe_from_dict(artifact.manifest["recipe"])
    check_vllm_recipe(recipe)
    heads = adapter.geometry.num_kv_heads
    out = {}
    for layer, prefix in enumerate(attention_prefixes(hf_model, adapter)):
        fitted = artifact.layer_tensors(layer)
        for part, short in (("keys", "k"), ("values", "v")):
            scale = fitted.get(f"{part}.scale")
            if scale is None:
                raise ArtifactError(f"the artifact has no fp8 scale for layer {layer} {part}; run kvtool calibrate again")
            scale = scale.detach().float().reshape(-1)
            if scale.numel() not in (1, heads):
                raise ArtifactError(f"layer {layer} {part} has {scale.numel()} fp8 scales for {heads} KV heads")
            out[f"{prefix}.{short}_scale"] = scale.contiguous()
    return out


def write_vllm_folder(out: str | Path, hf_model, tokenizer, scales: dict[str, torch.Tensor], recipe: Recipe) -> Path:
    """Write the model (weights, tokenizer), the scales and the config into a new folder ``out`` (atomically)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KvtoolError(f"output folder '{out}' already exists and is not empty; give a new folder for --format vllm")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        hf_model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_file(scales, str(tmp / SCALES_FILE), metadata={"format": "pt"})
        index_path = tmp / INDEX_FILE
        if index_path.exists():
            index = json.loads(index_path.read_text())
        else:  # one weights file: an index naming it and the scales file
            with safe_open(str(tmp / "model.safetensors"), framework="pt") as handle:
                index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in handle.keys()}}
        index["weight_map"].update({name: SCALES_FILE for name in scales})
        index["metadata"]["total_size"] = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
        config_path = tmp / "config.json"
        config = json.loads(config_path.read_text())
        config["quantization_config"] = quantization_config(recipe)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except OSError as exc:
        raise KvtoolError(f"cannot write '{out}': {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
