"""Benchmark: the KVQuant ablation and nuq-1% against uniform quantization, through the runtime.

    python -m benchmarks.kvquant_ablation                       # both shared models
    python -m benchmarks.kvquant_ablation --models kvref-5m --samples 2

Ablation at 3 bits (each row adds one KVQuant component):
  int3 per-token keys -> per-channel keys -> pre-RoPE keys -> nuq (Fisher k-means) -> nuq + 1% outliers.
Then nuq + 1% outliers at 4/3/2 bits against uniform (per-channel keys, per-token values) at the
same code width. Every recipe keeps only the first token in 16-bit (attention sink) and no
recent window, so the numbers show the quantizer itself. Perplexity through the runtime
(prefill half of each window, decode the rest one token per step), delta against the
uncompressed cache, bits per element actually held, bytes per token, and key/value SQNR (dB)
from calibration next to the rate-distortion reference 6.02 dB/bit.
Writes benchmarks/results/kvquant_ablation.json. Needs ../shared.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from benchmarks.common import MODELS, Bench, print_and_save
from kvtool.recipe import CacheSpec, CalibrationSpec, QuantSpec, Recipe


def recipe(name: str, keys: QuantSpec, values: QuantSpec, samples: int) -> Recipe:
    return Recipe(name=name, keys=keys, values=values, cache=CacheSpec(block_size=32, sink_tokens=1, recent_tokens=0),
                  calibration=CalibrationSpec(samples=samples, seq_len=512, seed=0))


def ablation(head_dim: int, samples: int) -> list[Recipe]:
    def k(**kw):
        return QuantSpec(path="keys", **kw)

    def v(**kw):
        return QuantSpec(path="values", axis="token", group_size=head_dim, **kw)

    rows = [
        recipe("3b int per-token keys", k(method="uniform", bits=3, axis="token", group_size=head_dim), v(method="uniform", bits=3), samples),
        recipe("3b + per-channel keys", k(method="uniform", bits=3), v(method="uniform", bits=3), samples),
        recipe("3b + pre-RoPE keys", k(method="uniform", bits=3, pre_rope=True), v(method="uniform", bits=3), samples),
        recipe("3b + nuq", k(method="nuq", bits=3, pre_rope=True, outlier_fraction=0.0), v(method="nuq", bits=3, outlier_fraction=0.0), samples),
        recipe("3b + nuq + 1% outliers", k(method="nuq", bits=3, pre_rope=True), v(method="nuq", bits=3), samples),
    ]
    for bits in (4, 2):
        rows.append(recipe(f"{bits}b nuq + 1% outliers", k(method="nuq", bits=bits, pre_rope=True), v(method="nuq", bits=bits), samples))
    for bits in (4, 3, 2):
        rows.append(recipe(f"{bits}b uniform (KIVI axes)", k(method="uniform", bits=bits), v(method="uniform", bits=bits), samples))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--samples", type=int, default=4, help="evaluation windows per model")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per evaluation window")
    parser.add_argument("--calib-samples", type=int, default=16, help="calibration windows of 512 tokens")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kvquant_ablation.json"))
    args = parser.parse_args()
    console = Console()
    rows = []
    for name in args.models:
        bench = Bench(name, args.samples, args.seq_len)
        for r in ablation(bench.head_dim, args.calib_samples):
            rows.append({**bench.score(r), "rate_distortion_db": 6.02 * r.keys.bits})
            console.log(f"{name} {r.name}: {rows[-1]['delta_pct']:+.2f}%")
    print_and_save(rows, "KVQuant ablation through the runtime (1 fp16 sink, no recent window)", args.out, console)


if __name__ == "__main__":
    main()
