"""Benchmark: Palu low-rank latents through the runtime.

    python -m benchmarks.palu                      # both shared models
    python -m benchmarks.palu --models kvref-5m --samples 2 --seq-len 512

Rows: 30/50/70% rank reduction (whitened SVD per KV head, Fisher ranks, 16-bit latents);
whitened vs plain SVD and Fisher vs uniform vs gradient ranks at 50%; 30% reduction with latents at 3 and
2 bits, plain, with the Walsh-Hadamard transform and with the rotation folded into the basis (``rotate_basis``). Perplexity through the runtime, delta
against the uncompressed cache, bits per element held, body compression vs 16-bit, bytes per token.
Writes benchmarks/results/palu.json. Needs ../shared.
"""

from __future__ import annotations

from benchmarks.common import run
from kvtool.recipe import CacheSpec, CalibrationSpec, QuantSpec, Recipe


def palu(name: str, fraction: float, samples: int, bits: int = 16, **options) -> Recipe:
    common = dict(method="palu", bits=bits, rank_fraction=fraction, **options)
    return Recipe(
        name=name,
        keys=QuantSpec(path="keys", pre_rope=True, **common),
        values=QuantSpec(path="values", axis="token", **common),
        cache=CacheSpec(block_size=32, sink_tokens=1, recent_tokens=0),
        calibration=CalibrationSpec(samples=samples, seq_len=512, seed=0),
    )


def recipes(samples: int) -> list[Recipe]:
    rows = [palu(f"{int(round(100 * (1 - f)))}% rank reduction", f, samples) for f in (0.7, 0.5, 0.3)]
    rows += [
        palu("50%, plain SVD", 0.5, samples, whiten=False),
        palu("50%, uniform ranks", 0.5, samples, rank_allocation="uniform"),
        palu("50%, gradient ranks", 0.5, samples, rank_allocation="gradient"),
    ]
    for bits in (3, 2):
        for mixing in ("none", "hadamard", "rotate_basis"):
            label = f"30% + {bits}-bit latents" + {"none": "", "hadamard": " + Hadamard", "rotate_basis": " + rotated basis"}[mixing]
            rows.append(palu(label, 0.7, samples, bits=bits, hadamard=mixing == "hadamard",
                             rotate_basis=mixing == "rotate_basis", group_heads=0, group_size=128))
    return rows


def main() -> None:
    run(__doc__, "benchmarks/results/palu.json", lambda head_dim, samples: recipes(samples),
        "Palu low-rank latents through the runtime (1 fp16 sink, no recent window)")


if __name__ == "__main__":
    main()
