"""The CPU (Numba) decode kernel alone: microseconds per body block read, per block format.

    python -m benchmarks.cpu_kernel_blocks                                   # head_dim 64 and 256, the default formats
    python -m benchmarks.cpu_kernel_blocks --head-dims 256 --rows 4 --recipes kivi-4bit turboquant-k3.5-v2.5
    python -m benchmarks.cpu_kernel_blocks --head-dims 256 --block-size 16 --recipes turboquant-local   # its own blocks

For each recipe and head_dim: random keys and values (keys with a spread of channel scales, so TurboQuant's outlier
split has outliers to find; a recipe that needs calibration, e.g. `kvquant-4bit-1pct`, is fitted on them) are encoded by the recipe's own quantizers into ``streams`` x ``blocks`` body blocks of 32
tokens (``--block-size``; the TurboQuant recipes store 16), and one decode step's attention over them
(`cpu_decode_attention`, serial, no float tokens) is timed ``calls`` times after a warm-up call (compilation). Reported: the median microseconds per call and per block. This is the
kernel's share of a decode step (the model, the store's writes and flushes are not in it); `benchmarks.decode_speed`
measures whole steps. Set OMP_NUM_THREADS=1 for the serial kernel's figure on a shared machine. Table +
benchmarks/results/cpu_kernel_blocks.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from kvtool.calibration import build_quantizers
from kvtool.fileio import write_json_atomic
from kvtool.methods.registry import quantizer_class
from kvtool.recipe import load_recipe
from kvtool.runtime.kernels.cpu_decode import covers, cpu_decode_attention

REPO = Path(__file__).resolve().parents[1]
RECIPES = ["kivi-4bit", "turboquant-3bit", "turboquant-3.5bit", "turboquant-k3.5-v2.5", "turboquant-k4.5-v3.5"]
BLOCK = 32


def kernel_case(recipe_name: str, head_dim: int, rows: int, streams: int, blocks: int, seed: int = 0,
                block_size: int = BLOCK) -> dict:
    """`cpu_decode_attention`'s arguments for ``streams`` streams of ``blocks`` full body blocks each (no float tokens)."""
    recipe = load_recipe(recipe_name)
    g = torch.Generator().manual_seed(seed)
    n = streams * blocks
    group = torch.zeros(n, dtype=torch.long)  # (N,) the KV head of each block (one table row: no per-head tables here)
    keys = torch.randn(n, 1, block_size, head_dim, generator=g) * torch.linspace(0.2, 3.0, head_dim)  # (N, 1, BS, D)
    values = torch.randn(n, 1, block_size, head_dim, generator=g)
    fitted = {}  # calibrated formats (nuq, static scales, ...): fitted on the case's own tokens, one KV head
    for part, spec, x in (("keys", recipe.keys, keys), ("values", recipe.values, values)):
        method = quantizer_class(spec.method)
        if not method.requires_fit(spec):
            continue
        samples = x.reshape(-1, 1, head_dim)  # (N BS, H_kv = 1, D)
        if method.fit_source == "reservoir":  # nuq, palu
            own = method.fit(spec, head_dim, block_size, samples)
        elif method.fit_source == "ranges":  # static fp8 / int scales
            own = method.fit_ranges(spec, head_dim, block_size, samples.amin(dim=0), samples.amax(dim=0), samples)
        else:
            raise SystemExit(f"{recipe_name}: fitted from the model's queries; this benchmark has no model (use "
                             "benchmarks.decode_speed)")
        fitted.update({f"{part}.{name}": t for name, t in own.items()})
    kq, vq = build_quantizers(recipe, head_dim, torch.float32, fitted)
    body = ({**kq.encode_blocks(keys, group), **kq.kernel_tensors("cpu")},
            {**vq.encode_blocks(values, group), **vq.kernel_tensors("cpu")})
    formats = (kq.kernel_format(), vq.kernel_format())
    reason = covers(formats, torch.float16, head_dim)
    if reason:
        raise SystemExit(f"{recipe_name}: the CPU kernel does not read it: {reason}")
    float_pool = torch.zeros(1, 16, head_dim, dtype=torch.float16)  # (cap, FBS, D): no float tokens
    return dict(
        q=torch.randn(streams, rows, head_dim, generator=g) / head_dim**0.5, new_k=torch.randn(streams, head_dim, generator=g),
        new_v=torch.randn(streams, head_dim, generator=g), float_k=float_pool, float_v=float_pool.clone(),
        float_table=torch.zeros(streams, 1, dtype=torch.int32), float_len=np.zeros(streams, np.int64), body=body,
        body_table=torch.arange(n, dtype=torch.int32).reshape(streams, blocks), body_len=np.full(streams, blocks, np.int64),
        formats=formats, block_size=block_size,
    )


def time_case(args: dict, calls: int) -> float:
    """Median seconds of one call (after a warm-up call that compiles)."""
    cpu_decode_attention(**args)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        cpu_decode_attention(**args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=RECIPES)
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--rows", type=int, default=0, help="query rows per stream (GQA group); 0: 3 at head_dim 64, else 4")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=32, help="body blocks per stream")
    parser.add_argument("--block-size", type=int, default=BLOCK, help="tokens per body block (a multiple of 8)")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cpu_kernel_blocks.json")
    opts = parser.parse_args(argv)
    if opts.block_size < 8 or opts.block_size % 8:
        parser.error(f"--block-size {opts.block_size}: a body block holds a multiple of 8 tokens (8, 16, 32, ...)")
    rows_out = []
    for head_dim in opts.head_dims:
        rows = opts.rows or (3 if head_dim == 64 else 4)  # SmolLM2-135M's GQA group, Gemma-3-270M's
        for name in opts.recipes:
            seconds = time_case(kernel_case(name, head_dim, rows, opts.streams, opts.blocks, block_size=opts.block_size), opts.calls)
            n = opts.streams * opts.blocks
            rows_out.append({"recipe": name, "head_dim": head_dim, "rows": rows, "blocks": n, "block_size": opts.block_size,
                             "us_per_call": seconds * 1e6, "us_per_block": seconds * 1e6 / n})
    table = Table(title=f"CPU decode kernel alone: {opts.streams} streams x {opts.blocks} blocks of {opts.block_size} tokens, "
                        f"torch threads {torch.get_num_threads()}")
    for column in ("recipe", "head_dim", "query rows", "us per call", "us per block"):
        table.add_column(column, justify="left" if column == "recipe" else "right")
    for row in rows_out:
        table.add_row(row["recipe"], str(row["head_dim"]), str(row["rows"]), f"{row['us_per_call']:.0f}",
                      f"{row['us_per_block']:.2f}")
    Console().print(table)
    write_json_atomic(opts.out, {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                                 "threads": torch.get_num_threads(), "rows": rows_out})
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
