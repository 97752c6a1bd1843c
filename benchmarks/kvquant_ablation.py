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

from benchmarks.common import run
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
    run(__doc__, "benchmarks/results/kvquant_ablation.json", ablation,
        "KVQuant ablation through the runtime (1 fp16 sink, no recent window)",
        extra=lambda recipe: {"rate_distortion_db": 6.02 * recipe.keys.bits})


if __name__ == "__main__":
    main()
