"""Tokens that fit in a memory budget, per recipe, at one context: bytes per token measured, not computed.

    python -m benchmarks.cache_capacity        # SmolLM2-135M (or its architecture), 8192 tokens, kivi-4bit / -lean / kivi-2bit
    python -m benchmarks.cache_capacity --model PATH --context 4096 --recipes kivi-4bit turboquant-3.5bit
    python -m benchmarks.cache_capacity --model GEMMA --context 1024 --decode 1024 --recipes turboquant-k4.5-v3.5

One sequence of `context` random tokens is prefilled (chunks of 1024) into transformers' `DynamicCache` and into each
recipe's cache, on CPU (or CUDA with `--device cuda`). Read for each: the bytes the cache reports holding and reserving
(its pools' capacity), the bytes of every storage reachable from the cache object (`kvtool.runtime.memory.walked_nbytes`,
a witness from outside the cache's own accounting), bytes per token held, the tokens that fit in `--budget-gib` of
cache memory at that rate, and the ratio to `DynamicCache` (issue 10's ">= 3.5x more tokens in the same memory at
4 bits"). Bytes per token do not depend on the batch or on the weights' values for recipes that do not evict, so a
CPU run at batch 1 with random weights gives the figure `benchmarks.gpu_generate` reads on a GPU at batch 32 (where
the allocator is a third witness). The model runs in bfloat16, so `DynamicCache` holds 2 bytes per element, as a
served model's does.

With `--decode N`, N more tokens are then decoded one per step, and the bytes held after every step are read
(`nbytes()`; `DynamicCache`: its tensors): their mean, least and most over the steps, and the mean of each step's
ratio to `DynamicCache`'s. On sliding-window layers a quantized store frees body blocks only whole, so its bytes at one
moment move with the phase of its blocks; the mean over the steps is the fraction to compare recipes by.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kvtool.models.cache_argument import with_cache

DEFAULT_RECIPES = ["kivi-4bit", "kivi-4bit-lean", "kivi-2bit"]


def held_bytes(cache) -> int:
    """Bytes a cache holds now: a kvtool cache's own count, `DynamicCache`'s tensors."""
    from benchmarks.gpu_generate import dynamic_bytes

    return cache.nbytes() if hasattr(cache, "nbytes") else dynamic_bytes(cache)


def measure(model, label: str, context: int, budget_bytes: int, device: str, decode: int = 0) -> dict:
    """Prefill `context` tokens into one cache; its bytes three ways and the tokens that fit in `budget_bytes`; with
    `decode`, then `decode` tokens one per step and the bytes held after each (``held_per_step``)."""
    from benchmarks.gpu_generate import dynamic_bytes, make_cache
    from kvtool.runtime.memory import walked_nbytes

    cache, runtime = make_cache(label, model, "auto")
    ids = torch.randint(min(100, model.config.vocab_size - 1), min(20000, model.config.vocab_size), (1, context),
                        generator=torch.Generator().manual_seed(0)).to(device)
    start = time.perf_counter()
    with torch.no_grad():
        for begin in range(0, context, 1024):
            model(ids[:, begin:min(context, begin + 1024)], **with_cache(cache), use_cache=True, logits_to_keep=1)
    row = {"cache": label, "context": context, "prefill_s": time.perf_counter() - start}
    if runtime is None:
        row["cache_bytes"] = row["walked_bytes"] = dynamic_bytes(cache)
    else:
        report = cache.memory_report()
        row.update(cache_bytes=report["cache_bytes"], reserved_bytes=report["reserved_bytes"],
                   walked_bytes=walked_nbytes(cache), bits_per_element=report.get("bits_per_element"))
    row["bytes_per_token"] = row["cache_bytes"] / context
    row["tokens_in_budget"] = int(budget_bytes // row["bytes_per_token"])
    if decode:
        tokens = torch.randint(min(100, model.config.vocab_size - 1), min(20000, model.config.vocab_size), (1, decode),
                               generator=torch.Generator().manual_seed(1)).to(device)
        held = []
        with torch.no_grad():
            for step in range(decode):
                model(tokens[:, step : step + 1], **with_cache(cache), use_cache=True, logits_to_keep=1)
                held.append(held_bytes(cache))
        row.update(held_per_step=held, held_mean_bytes=sum(held) / decode, held_min_bytes=min(held), held_max_bytes=max(held))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M under $KVTOOL_TEST_MODELS, else its "
                        "architecture with random weights)")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--decode", type=int, default=0, help="then decode this many tokens, reading the bytes held per step")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cache_capacity.json"))
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from benchmarks.gpu_generate import load
    from kvtool.fileio import write_json_atomic

    model, described = load(args.model, True, torch.bfloat16, args.device)
    if args.context + args.decode > model.config.max_position_embeddings:
        raise SystemExit(f"--context {args.context} + --decode {args.decode} is beyond the model's "
                         f"{model.config.max_position_embeddings} positions")
    budget = int(args.budget_gib * 2**30)
    rows = [measure(model, label, args.context, budget, args.device, args.decode) for label in ["DynamicCache", *args.recipes]]
    for row in rows:
        row["x_dynamic_tokens"] = row["tokens_in_budget"] / rows[0]["tokens_in_budget"]
        if args.decode:
            ratios = [held / base for held, base in zip(row["held_per_step"], rows[0]["held_per_step"])]
            row["fraction_of_dynamic_mean"] = sum(ratios) / len(ratios)
            row["fraction_of_dynamic_min"], row["fraction_of_dynamic_max"] = min(ratios), max(ratios)
        print(json.dumps({k: v for k, v in row.items() if k != "held_per_step"}), flush=True)
    table = Table(title=f"cache capacity, {described}, {args.context} tokens, {args.budget_gib:g} GiB budget, {args.device}")
    for column in ("cache", "MB held", "MB reserved", "MB walked", "bytes/token", f"tokens in {args.budget_gib:g} GiB", "x tokens"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["cache"], f"{r['cache_bytes'] / 1e6:.1f}", f"{r.get('reserved_bytes', r['cache_bytes']) / 1e6:.1f}",
                      f"{r['walked_bytes'] / 1e6:.1f}", f"{r['bytes_per_token']:.0f}", f"{r['tokens_in_budget']:,}",
                      f"{r['x_dynamic_tokens']:.2f}")
    Console().print(table)
    if args.decode:
        steps = Table(title=f"bytes held over {args.decode} decode steps after {args.context} tokens: fraction of DynamicCache's")
        for column in ("cache", "MB held, mean", "fraction, mean", "least", "most"):
            steps.add_column(column, justify="right")
        for r in rows:
            steps.add_row(r["cache"], f"{r['held_mean_bytes'] / 1e6:.2f}", f"{r['fraction_of_dynamic_mean']:.1%}",
                          f"{r['fraction_of_dynamic_min']:.1%}", f"{r['fraction_of_dynamic_max']:.1%}")
        Console().print(steps)
    machine = {"device": args.device, "torch": torch.__version__, "platform": platform.platform(), "model": described}
    write_json_atomic(args.out, {"machine": machine, "rows": rows})


if __name__ == "__main__":
    main()
