"""End-to-end decoding on the GPU: kvtool's runtime (Triton kernels) against transformers' `DynamicCache`.

    python -m benchmarks.gpu_generate                                   # SmolLM2-135M, batch 32 x 8K
    python -m benchmarks.gpu_generate --model PATH --batch 8 --context 4096 --recipes kivi-4bit

Needs CUDA. For each cache: a random-token context of `context` tokens per sequence is prefilled in
chunks of 1024 (as a server would; only the last position's logits are computed), then `steps`
single-token decode steps are timed one by one (CUDA-synchronised; the first two are warm-up).
Reported: ms per decode step (median), decode tokens/s (batch / median), the ratio to
`DynamicCache`, the bytes the cache holds (kvtool: its own report and the allocator's growth over
the prefill; DynamicCache: its tensors), and how many tokens fit in `--budget-gib` of cache memory
at the measured bytes per token (and the ratio to DynamicCache); then the host-device syncs per decode step
and where they come from (`--syncs` steps under CUDA's sync debug mode).

The model is the real checkpoint when one is found (`--model`, or SmolLM2-135M under
$KVTOOL_TEST_MODELS); otherwise `--random-weights` builds SmolLM2-135M's architecture from its config
with random weights. Decode speed does not depend on the weights' values (the recipes measured here
do not evict), so the figures hold for the real model; the output says which one ran.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from pathlib import Path

import torch

from kvtool.models.cache_argument import with_cache

SMOLLM2_CONFIG = dict(  # HuggingFaceTB/SmolLM2-135M-Instruct's config.json (architecture only)
    model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, tie_word_embeddings=True, vocab_size=49152,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


def load(model_arg: str | None, random_weights: bool, dtype: torch.dtype, device: str = "cuda"):
    """(model on `device` in `dtype`, description)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = Path(os.environ.get("KVTOOL_TEST_MODELS") or Path.home() / ".cache" / "kvtool-test-models")
    path = Path(model_arg) if model_arg else root / "smollm2-135m"
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return model.to(device).eval(), str(path)
    if model_arg or not random_weights:
        raise SystemExit(f"{path} holds no checkpoint: pass --model PATH, or --random-weights for SmolLM2-135M's "
                         "architecture with random weights")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_CONFIG), dtype=dtype)
    return model.to(device).eval(), "SmolLM2-135M architecture, random weights"


def make_cache(label: str, model, backend: str):
    from transformers import DynamicCache

    if label == "DynamicCache":
        return DynamicCache(config=model.config), None
    from kvtool.recipe import load_recipe
    from kvtool.runtime.attach import CompressedRuntime

    runtime = CompressedRuntime.from_recipe(model, load_recipe(label), backend=backend)
    return runtime.new_cache(), runtime


def dynamic_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def count_syncs(run_step, steps: int) -> tuple[float, list[tuple[str, int]]]:
    """Host-device synchronizations per decode step (CUDA's sync debug mode, warnings recorded), and where they come
    from: the innermost kvtool or transformers line of each, most frequent first. A synchronizing call makes the
    host wait for the GPU, so host work and kernels stop overlapping."""
    import collections
    import traceback
    import warnings

    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/kvtool/" in f.filename or "/transformers/" in f.filename]
        top = frames[-1] if frames else None
        where = f"{'/'.join(top.filename.split('/')[-2:])}:{top.lineno} ({top.name})" if top else f"{filename}:{lineno}"
        sites[where] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for step in range(steps):
                run_step(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(sites.values()) / max(steps, 1), sites.most_common(8)


def measure(model, label: str, backend: str, batch: int, context: int, steps: int, syncs: int = 0) -> dict:
    """Prefill `context` tokens per sequence, then time `steps` decode steps; then count the host syncs of `syncs`
    more (`count_syncs`)."""
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache, runtime = make_cache(label, model, backend)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, min(model.config.vocab_size, 20000), (batch, context + steps + syncs), generator=g).cuda()
    times = []
    with torch.no_grad():
        for start in range(0, context, 1024):
            model(ids[:, start:min(context, start + 1024)], **with_cache(cache), use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - before
        for step in range(steps):
            token = ids[:, context + step:context + step + 1]
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_event.record()
            model(token, **with_cache(cache), use_cache=True, logits_to_keep=1)
            end_event.record()
            torch.cuda.synchronize()
            times.append(start_event.elapsed_time(end_event))
        if syncs:
            def step_at(i):
                model(ids[:, context + steps + i:context + steps + i + 1], **with_cache(cache), use_cache=True,
                      logits_to_keep=1)
            per_step, sites = count_syncs(step_at, syncs)
    median = statistics.median(times[2:])
    row = {"cache": label, "backend": backend if runtime else "", "batch": batch, "context": context, "ms_per_step": median,
           "tokens_per_s": batch / median * 1e3, "allocator_growth_bytes": grown}
    if syncs:
        row.update(syncs_per_step=per_step, sync_sites=sites)
    if runtime is None:
        row["cache_bytes"] = dynamic_bytes(cache)
    else:
        report = cache.memory_report()
        row.update(cache_bytes=report["cache_bytes"], reserved_bytes=report["reserved_bytes"], backend=report["backend"],
                   kernel_steps=report.get("kernel_steps", 0), kernel_encodes=report.get("kernel_encodes", 0))
    row["bytes_per_token"] = row["cache_bytes"] / (batch * (context + steps))
    del cache
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local model folder (default: SmolLM2-135M under $KVTOOL_TEST_MODELS)")
    parser.add_argument("--random-weights", action="store_true", help="no checkpoint: SmolLM2-135M's architecture, random weights")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--recipes", nargs="+", default=["kivi-4bit", "kivi-2bit"])
    parser.add_argument("--backends", nargs="+", default=["triton"], choices=["triton", "torch"])
    parser.add_argument("--syncs", type=int, default=3, help="decode steps after the timed ones whose host syncs are "
                        "counted (CUDA sync debug mode; 0: none)")
    parser.add_argument("--budget-gib", type=float, default=16.0, help="cache memory for the tokens-that-fit column")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_generate.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_generate needs a CUDA GPU")
    model, described = load(args.model, args.random_weights, torch.bfloat16)
    context = min(args.context, model.config.max_position_embeddings - args.steps)
    context = min(context, model.config.max_position_embeddings - args.steps - args.syncs)
    rows = [measure(model, "DynamicCache", "", args.batch, context, args.steps, args.syncs)]
    for label in args.recipes:
        for backend in args.backends:
            try:
                rows.append(measure(model, label, backend, args.batch, context, args.steps, args.syncs))
            except torch.cuda.OutOfMemoryError:
                rows.append({"cache": label, "backend": backend, "error": "out of memory"})
                torch.cuda.empty_cache()
    base = rows[0]
    budget = args.budget_gib * 2**30
    for r in rows:
        if "error" not in r:
            r["x_dynamic_tokens_per_s"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["tokens_in_budget"] = int(budget / r["bytes_per_token"])
            r["x_dynamic_tokens_in_budget"] = base["bytes_per_token"] / r["bytes_per_token"]
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode, {described}, bf16, batch {args.batch} x {context}, {torch.cuda.get_device_name()}")
    for column in ("cache", "backend", "ms/step", "tokens/s", "x DynamicCache", "cache MB", "allocator MB",
                   f"tokens in {args.budget_gib:g} GiB", "x tokens"):
        table.add_column(column, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["cache"], r["backend"], r["error"], *[""] * 6)
            continue
        table.add_row(r["cache"], r["backend"], f"{r['ms_per_step']:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['x_dynamic_tokens_per_s']:.2f}",
                      f"{r['cache_bytes'] / 2**20:.0f}", f"{r['allocator_growth_bytes'] / 2**20:.0f}", f"{r['tokens_in_budget']:,}",
                      f"{r['x_dynamic_tokens_in_budget']:.2f}")
    Console().print(table)
    for r in rows:
        if "syncs_per_step" in r:
            print(f"{r['cache']} {r['backend']}: {r['syncs_per_step']:.1f} host syncs per decode step; "
                  + "; ".join(f"{where} x{n}" for where, n in r["sync_sites"]))
    from kvtool.fileio import write_json_atomic

    machine = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "platform": platform.platform(), "model": described}
    write_json_atomic(args.out, {"machine": machine, "rows": rows})


if __name__ == "__main__":
    main()
