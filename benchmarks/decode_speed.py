"""Decode speed of the compressed cache against transformers' own caches.

    python -m benchmarks.decode_speed                      # the full grid (long on a small CPU)
    python -m benchmarks.decode_speed --quick              # kvref-5m and SmolLM2 at 512/2K, batch 1
    python -m benchmarks.decode_speed --models smollm2-135m --contexts 2048 --batches 1 --recipes kivi-4bit h2o
    python -m benchmarks.decode_speed --interleaved --models smollm2-135m --contexts 2048 --batches 1 --steps 40
    python -m benchmarks.decode_speed --interleaved --models kvref-5m --contexts 512 --recipes kivi-4bit@torch kivi-4bit@numba

Every row runs in its own subprocess, so its peak RSS is its own: the model is loaded, a random-token
context of `context` tokens is prefilled (in chunks of 1024, as a server would), then `steps` decode
steps are timed one by one (the first two are warm-up). Reported per row: ms per decode step (median and
best of the timed steps), decode tokens/s (batch x 1000 / median ms), the ratio of the median to
`DynamicCache`'s in the same invocation, bytes the cache holds (`nbytes`) and reserves, the bytes found
by walking the cache's tensors from outside, and the process' peak RSS.

`--interleaved` runs the caches of a (model, context, batch) in one process instead, each prefilled, then
decode step s of every cache before step s + 1: the ratios then hold on a loaded machine (RESULTS.md's
interleaved tables); peak RSS and bytes are not reported in that mode. It also reports the median time a step
spends inside the model's attention modules and its excess over `DynamicCache`'s (the part a cache changes:
the rest of a step, the MLPs and the vocabulary projection, is the same for every cache).

Baselines: `DynamicCache` (transformers' default cache, in the model's dtype) and,
when `optimum-quanto` imports, transformers' `QuantizedCache` (quanto, 4-bit), the peer users compare with.
Recipes that need calibration (kvquant, palu, static fp8 / int scales) are fitted on 4 windows of WikiText-2 first,
and those that need a profile (FastGen's offline head policies, fitted layer budgets) are profiled on the same text
(that time is not part of the decode figures).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from kvtool.models.cache_argument import with_cache

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MODELS = {
    "smollm2-135m": "test-models:smollm2-135m",  # materialized by ../shared/models/fetch_pretrained.py
    "kvref-5m": str(SHARED / "models" / "kvref-5m"),
    "gemma3-270m": "test-models:gemma3-270m",  # sliding-window layers; only when asked for (--models)
}
DEFAULT_MODELS = ["smollm2-135m", "kvref-5m"]
DEFAULT_RECIPES = ["kivi-4bit", "kivi-2bit", "int8", "h2o", "snapkv", "streamingllm", "budget-256"]
CALIBRATED_RECIPES = ["kvquant-4bit-1pct", "palu-30-3bit"]
BASELINES = ["DynamicCache", "QuantizedCache-quanto-4bit"]
CALIBRATION_TEXT = SHARED / "data" / "text" / "wikitext2_valid.txt"


def model_path(name: str) -> str:
    target = MODELS[name]
    if target.startswith("test-models:"):
        import os

        root = Path(os.environ.get("KVTOOL_TEST_MODELS", Path.home() / ".cache" / "kvtool-test-models"))
        path = root / target.split(":", 1)[1]
        if not (path / "config.json").exists():
            raise SystemExit(f"{path} is missing: run `python ../shared/models/fetch_pretrained.py --install-deps` first")
        return str(path)
    return target


def fixed_budget_recipe():
    """A recipe that keeps a fixed number of tokens per stream (256) whatever the context: its per-step
    cost must stay flat in context."""
    from kvtool.recipe import CacheSpec, EvictionSpec, QuantSpec, Recipe

    return Recipe(
        name="budget-256", keys=QuantSpec(method="none", bits=16, path="keys"),
        values=QuantSpec(method="none", bits=16, axis="token", path="values"),
        cache=CacheSpec(float_dtype="float16"),
        eviction=EvictionSpec(policy="h2o", budget_tokens=256, sink_tokens=4, window=32),
    )


def make_cache(label: str, model, tokenizer):
    """The cache a row measures, and the kvtool runtime behind it (None for transformers' caches)."""
    from transformers import DynamicCache

    if label == "DynamicCache":
        return DynamicCache(config=model.config), None
    if label == "QuantizedCache-quanto-4bit":
        from transformers import QuantizedCache

        return QuantizedCache(backend="quanto", config=model.config, nbits=4), None
    from kvtool.api import calibrate_loaded
    from kvtool.recipe import load_recipe
    from kvtool.runtime.attach import CompressedRuntime

    label, _, backend = label.partition("@")  # "kivi-4bit@torch": a recipe on one backend (default auto)
    backend = backend or "auto"
    recipe = fixed_budget_recipe() if label == "budget-256" else load_recipe(label)
    from kvtool.calibration import needs_fit

    if needs_fit(recipe):  # kvquant, palu, static fp8 / int scales: fitted on a little text first
        import dataclasses

        recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, samples=4, seq_len=512))
        runtime = CompressedRuntime.from_artifact(model, calibrate_loaded(model, tokenizer, str(CALIBRATION_TEXT), recipe), backend)
    else:
        from kvtool.api import with_token_classes

        profile = attention_profile(model, tokenizer, recipe) if recipe.eviction.needs_profile else None
        profile = with_token_classes(model, recipe, profile, tokenizer)  # FastGen per prompt: the tokenizer's classes
        runtime = CompressedRuntime.from_recipe(model, recipe, profile=profile, backend=backend)
    return runtime.new_cache(), runtime


def attention_profile(model, tokenizer, recipe) -> dict:
    """What `kvtool profile` would give a FastGen or fitted-budget recipe, from 4 windows of 512 calibration tokens
    (as the calibrated recipes above; the time is not part of the decode figures)."""
    from kvtool.attention_profile import profile_attention
    from kvtool.data import DataSpec, token_windows
    from kvtool.methods.evict.fastgen import token_classes
    from kvtool.models.adapter import adapter_for

    windows = token_windows(tokenizer, DataSpec.parse(str(CALIBRATION_TEXT)), samples=4, seq_len=512, seed=0, mode="random")
    special, punct = token_classes(tokenizer)
    return profile_attention(model, adapter_for(model), windows, special, punct, recipe.eviction, batch_size=2).tensors


def measure_row(model_name: str, label: str, context: int, batch: int, steps: int, threads: int) -> dict:
    """One row, in this process: prefill, then time `steps` single-token decode steps."""
    import torch

    from kvtool.models.loading import load_model
    from kvtool.runtime.memory import walked_nbytes

    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_path(model_name))
    limit = model.config.max_position_embeddings
    if context > limit:
        return {"skipped": f"context {context} is beyond the model's {limit} positions"}
    context = min(context, limit - steps)  # "8K" on an 8K model: leave room for the timed steps
    cache, runtime = make_cache(label, model, tokenizer)
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    vocab = model.config.vocab_size
    ids = torch.randint(100, min(vocab, 20000), (batch, context + steps), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.no_grad():
        for start in range(0, context, 1024):
            model(ids[:, start:min(context, start + 1024)], **with_cache(cache), use_cache=True)
        for step in range(steps):
            token = ids[:, context + step:context + step + 1]
            begin = time.perf_counter()
            model(token, **with_cache(cache), use_cache=True)
            times.append(time.perf_counter() - begin)
    timed = sorted(times[2:])
    median = timed[len(timed) // 2]
    row = {
        "ms_per_step": 1e3 * median, "best_ms_per_step": 1e3 * timed[0],
        "tokens_per_s": batch / median, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_load_bytes": rss_loaded, "walked_bytes": walked_nbytes(cache), "context_used": context,
    }
    if runtime is not None:
        report = cache.memory_report()
        row.update(cache_bytes=report["cache_bytes"], reserved_bytes=report["reserved_bytes"],
                   fp16_cache_bytes=report["fp16_cache_bytes"], kept_fraction=report["kept_fraction"], backend=report["backend"],
                   walked_bytes=walked_nbytes(cache) - cache.constant_nbytes())
    return row


def measure_interleaved(model_name: str, labels: list[str], context: int, batch: int, steps: int, threads: int) -> list[dict]:
    """Every row in this process: each cache prefilled, then decode step s of every cache before step s + 1
    (order reversed every other step), so a change in machine load slows every row alike. No per-row RSS."""
    import statistics

    import torch

    from kvtool.models.loading import load_model

    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_path(model_name))
    context = min(context, model.config.max_position_embeddings - steps)
    ids = torch.randint(100, min(model.config.vocab_size, 20000), (batch, context + steps), generator=torch.Generator().manual_seed(0))
    attention: dict[str, list[float]] = {}
    times = interleaved_step_times(model, {label: make_cache(label, model, tokenizer)[0] for label in labels}, ids, context, steps,
                                   attention)
    rows = []
    for label in labels:
        timed = times[label][2:]
        median = statistics.median(timed)
        rows.append({"cache": label, "ms_per_step": 1e3 * median, "best_ms_per_step": 1e3 * min(timed), "tokens_per_s": batch / median,
                     "attention_ms_per_step": 1e3 * statistics.median(attention[label][2:]), "context_used": context,
                     "interleaved": True})
    return rows


def interleaved_step_times(model, caches: dict, ids, context: int, steps: int, attention: dict | None = None) -> dict[str, list[float]]:
    """Seconds of each decode step of each cache {label: cache}: every cache prefilled with ids[:, :context] (chunks of
    1024), then step s of every cache before step s + 1 (order reversed every other step), so a change in machine load
    slows every cache alike. With ``attention`` (a dict), its {label: [seconds]} receive each step's time inside the
    model's attention modules (every ``self_attn``, timed around its ``forward``): the part of a step a cache changes."""
    import torch

    times = {label: [] for label in caches}
    labels = list(caches)
    inside = [0.0]
    modules = [m for name, m in model.named_modules() if name.endswith("self_attn")] if attention is not None else []

    def timed(forward):
        def run(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - begin
        return run

    for module in modules:
        module.forward = timed(module.forward)  # an instance attribute: dropped again below
    try:
        with torch.no_grad():
            for cache in caches.values():
                for start in range(0, context, 1024):
                    model(ids[:, start:min(context, start + 1024)], **with_cache(cache), use_cache=True)
            for step in range(steps):
                token = ids[:, context + step:context + step + 1]
                for label in labels if step % 2 == 0 else labels[::-1]:
                    inside[0] = 0.0
                    begin = time.perf_counter()
                    model(token, **with_cache(caches[label]), use_cache=True)
                    times[label].append(time.perf_counter() - begin)
                    if attention is not None:
                        attention.setdefault(label, []).append(inside[0])
    finally:
        for module in modules:
            del module.forward
    return times


def run_row(model_name: str, label: str, context: int, batch: int, steps: int, threads: int) -> dict:
    """One row in a fresh subprocess (its own peak RSS); errors become a row with the message."""
    args = [sys.executable, "-m", "benchmarks.decode_speed", "--row", json.dumps([model_name, label, context, batch, steps, threads])]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail}
    return json.loads(lines[-1][4:])


def quanto_available() -> bool:
    try:
        import optimum.quanto  # noqa: F401
    except Exception:
        return False
    return True


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="decode speed (ms per step, median of timed steps; ratio to DynamicCache in the same run)")
    attention = any("attention_ms_per_step" in r for r in rows)  # --interleaved: the time inside the attention modules
    columns = ["model", "context", "batch", "cache", "ms/step", "tokens/s", "x DynamicCache"]
    columns += ["attention ms", "attention +ms"] if attention else []
    for column in columns + ["held MB", "reserved MB", "walked MB", "kept", "peak RSS MB"]:
        table.add_column(column, justify="right")
    mb = lambda x: "" if x is None else f"{x / 2**20:.1f}"  # noqa: E731
    for r in rows:
        if "error" in r or "skipped" in r:
            table.add_row(r["model"], str(r["context"]), str(r["batch"]), r["cache"], r.get("error") or r.get("skipped"),
                          *[""] * (len(columns) + 2))
            continue
        peak = "" if "peak_rss_bytes" not in r else mb(r["peak_rss_bytes"])
        ratio = r.get("ratio_to_dynamic")
        extra = []
        if attention:
            over = r.get("attention_over_dynamic_ms")
            extra = [f"{r['attention_ms_per_step']:.2f}", "" if over is None else f"{over:+.2f}"]
        table.add_row(
            r["model"], str(r["context"]), str(r["batch"]), r["cache"], f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:.1f}",
            "" if ratio is None else f"{ratio:.3f}", *extra, mb(r.get("cache_bytes")), mb(r.get("reserved_bytes")), mb(r.get("walked_bytes")),
            "" if r.get("kept_fraction") is None else f"{r['kept_fraction']:.2f}", peak,
        )
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES + CALIBRATED_RECIPES,
                        help="recipes; NAME@BACKEND runs one on a given backend (kivi-4bit@torch kivi-4bit@numba)")
    parser.add_argument("--steps", type=int, default=10, help="decode steps per row (the first two are warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch-tokens", type=int, default=16384,
                        help="skip rows whose batch x context exceeds this (prefill time on a small CPU)")
    parser.add_argument("--quick", action="store_true", help="contexts 512 and 2048, batch 1, no calibrated recipes")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "decode_speed.json")
    parser.add_argument("--interleaved", action="store_true",
                        help="run every cache of a (model, context, batch) in one process, decode steps taken in turn "
                             "(ratios robust to machine load; no per-row peak RSS or bytes)")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        print("ROW " + json.dumps(measure_row(*json.loads(args.row))), flush=True)
        return
    if args.quick:
        args.contexts, args.batches = [512, 2048], [1]
        args.recipes = [r for r in args.recipes if r not in CALIBRATED_RECIPES]
    caches = ["DynamicCache"] + (["QuantizedCache-quanto-4bit"] if quanto_available() else []) + args.recipes
    rows = []
    for model_name in args.models:
        for context in args.contexts:
            for batch in args.batches:
                if batch * context > args.max_batch_tokens:
                    continue
                base = base_attention = None
                if args.interleaved:
                    measured = measure_interleaved(model_name, caches, context, batch, args.steps, args.threads)
                for index, label in enumerate(caches):
                    row = {"model": model_name, "context": context, "batch": batch, "cache": label}
                    row.update(measured[index] if args.interleaved else run_row(model_name, label, context, batch, args.steps, args.threads))
                    if label == "DynamicCache" and "ms_per_step" in row:
                        base, base_attention = row["ms_per_step"], row.get("attention_ms_per_step")
                    if base and "ms_per_step" in row:
                        row["ratio_to_dynamic"] = row["ms_per_step"] / base
                    if base_attention is not None and "attention_ms_per_step" in row:
                        row["attention_over_dynamic_ms"] = row["attention_ms_per_step"] - base_attention
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    print_table(rows)
    import torch

    from kvtool.fileio import write_json_atomic

    machine = {"platform": platform.platform(), "processor": platform.processor(), "cpus": len(__import__("os").sched_getaffinity(0)),
               "threads": args.threads, "torch": torch.__version__, "device": "cpu"}
    write_json_atomic(args.out, {"machine": machine, "steps": args.steps, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
