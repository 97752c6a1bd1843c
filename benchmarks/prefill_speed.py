"""Prefill speed of the compressed cache against `DynamicCache`, chunk by chunk.

    python -m benchmarks.prefill_speed                                   # SmolLM2, 4K in 1024-token chunks, kivi-4bit
    python -m benchmarks.prefill_speed --context 8192 --recipes kivi-4bit kivi-2bit streamingllm --threads 2

A random-token context is prefilled in chunks of `--chunk` tokens (as `decode_speed` and a server do); the
first chunk meets an empty cache, every later one attends over what the cache holds (quantized body blocks
for a quantizing recipe). Interleaved in one process: chunk i of every cache runs before chunk i + 1 (order
reversed every other chunk), and the whole prefill is repeated `--repeats` times with fresh caches, so a
change in machine load slows every cache alike. Reported: the median ms of each chunk and its ratio to
`DynamicCache`'s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks.decode_speed import MODELS, REPO, make_cache, model_path
from kvtool.models.cache_argument import with_cache


def measure(model_name: str, labels: list[str], context: int, chunk: int, batch: int, repeats: int, threads: int) -> dict:
    """{label: [median seconds of chunk i]} over `repeats` interleaved prefills."""
    import torch

    from kvtool.models.loading import load_model

    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_path(model_name))
    ids = torch.randint(100, min(model.config.vocab_size, 20000), (batch, context), generator=torch.Generator().manual_seed(0))
    starts = list(range(0, context, chunk))
    times = {label: [[] for _ in starts] for label in labels}
    with torch.no_grad():
        for repeat in range(repeats):
            caches = {label: make_cache(label, model, tokenizer)[0] for label in labels}
            for index, start in enumerate(starts):
                for label in labels if (repeat + index) % 2 == 0 else labels[::-1]:
                    begin = time.perf_counter()
                    model(ids[:, start : start + chunk], **with_cache(caches[label]), use_cache=True)
                    times[label][index].append(time.perf_counter() - begin)
    return {label: [statistics.median(t) for t in per_chunk] for label, per_chunk in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=list(MODELS))
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--recipes", nargs="+", default=["kivi-4bit"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "prefill_speed.json")
    args = parser.parse_args()
    labels = ["DynamicCache"] + args.recipes
    medians = measure(args.model, labels, args.context, args.chunk, args.batch, args.repeats, args.threads)
    base = medians["DynamicCache"]
    print(f"{args.model}, context {args.context} in chunks of {args.chunk}, batch {args.batch}, {args.threads} thread(s), "
          f"{args.repeats} interleaved repeats: median ms per chunk (x DynamicCache)")
    for label in labels:
        cells = "  ".join(f"{1e3 * s:8.0f} ({s / b:4.2f}x)" for s, b in zip(medians[label], base))
        print(f"{label:>16}  {cells}", file=sys.stdout)
    from kvtool.fileio import write_json_atomic

    settings = {key: getattr(args, key) for key in ("model", "context", "chunk", "batch", "repeats", "threads")}
    write_json_atomic(args.out, {**settings, "ms_per_chunk": {label: [1e3 * s for s in m] for label, m in medians.items()}})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
