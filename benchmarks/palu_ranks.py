"""Benchmark: Palu rank allocation at equal kept dimensions (uniform vs fisher vs gradient) through the runtime.

    python -m benchmarks.palu_ranks --models smollm2-135m gemma3-270m --samples 4 --seq-len 512 --calib-samples 4

Rows per model: 50% of the K/V dimensions kept (whitened SVD per KV head, 16-bit latents, the
palu-50 recipe's layout) with ranks from ``uniform`` (the same rank everywhere), ``fisher``
(per-element Fisher-weighted reconstruction error) and ``gradient`` (reconstruction error
projected on the per-token loss gradient; `kvtool.methods.lowrank.rank_search`). The kept
numbers per token are the same in every row. Writes benchmarks/results/palu_ranks.json.
Needs ../shared (and the pretrained models: ``python ../shared/models/fetch_pretrained.py``).
"""

from __future__ import annotations

from benchmarks.common import run
from benchmarks.palu import palu

MODES = ("uniform", "fisher", "gradient")


def recipes(samples: int):
    return [palu(f"50%, {mode} ranks", 0.5, samples, rank_allocation=mode) for mode in MODES]


def main() -> None:
    run(__doc__, "benchmarks/results/palu_ranks.json", lambda head_dim, samples: recipes(samples),
        "Palu rank allocation at 50% kept dimensions (1 fp16 sink, no recent window)")


if __name__ == "__main__":
    main()
