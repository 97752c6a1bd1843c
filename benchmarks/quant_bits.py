"""Benchmark: perplexity through the runtime and cache bytes at 16/8/4/2 bits, and every quantization method.

    python -m benchmarks.quant_bits                      # both shared models, table + JSON
    python -m benchmarks.quant_bits --models kvref-5m --samples 2 --seq-len 512
    python -m benchmarks.quant_bits --suite methods --models smollm2-135m --samples 2 --seq-len 512

``--suite methods``: the bundled recipes of every method side by side (fp8, static int, KIVI,
TurboQuant at 2.5 - 4 bits, with and without the QJL key residual), each calibrated on the
calibration text (fits static scales; measures key/value SQNR, next to 6.02 dB per bit) and
scored through the runtime: perplexity delta (decode mode), bits per element held, bytes per
token, decode tokens/s. Writes benchmarks/results/quant_methods.json.

For each model and bit width two recipes run: KIVI-style (4 fp16 sinks + 64 fp16 recent
tokens, the rest quantized) and "body only" (no sinks, no recent window: every token
older than the current forward is quantized, the raw damage of the quantizer). The
baseline is the uncompressed cache (model dtype) through the same code path.
Writes benchmarks/results/quant_bits.json. Needs ../shared (models and text).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import MODELS, PRETRAINED, SHARED, Bench, print_and_save
from kvtool.data import DataSpec, token_windows
from kvtool.eval.perplexity import perplexity
from kvtool.fileio import write_json_atomic
from kvtool.models.loading import load_model
from kvtool.recipe import Recipe, load_recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe



def recipes(head_dim: int) -> list[Recipe]:
    group = min(32, head_dim)
    out = []
    for bits in (16, 8, 4, 2):
        kivi = Recipe(name=f"kivi-{bits}bit").with_bits(bits)
        kivi = dataclasses.replace(kivi, name=f"{bits}-bit kivi", values=dataclasses.replace(kivi.values, group_size=group))
        body = dataclasses.replace(kivi, name=f"{bits}-bit body-only", cache=dataclasses.replace(kivi.cache, sink_tokens=0, recent_tokens=0))
        out += [kivi] if bits == 16 else [kivi, body]
    return out


def bench_model(name: str, samples: int, seq_len: int, console: Console) -> list[dict]:
    model_dir, _, data = {**MODELS, **PRETRAINED}[name]
    model, tokenizer = load_model(str(SHARED / model_dir))
    spec = DataSpec.parse(str(SHARED / data))
    seq_len = min(seq_len, model.config.max_position_embeddings)
    windows = token_windows(tokenizer, spec, samples=samples, seq_len=seq_len, mode="sequential")
    prefill = seq_len // 2
    rows = []
    base = None
    for recipe in [uncompressed_recipe()] + recipes(model.config.head_dim if hasattr(model.config, "head_dim") else 64):
        runtime = CompressedRuntime.from_recipe(model, recipe)
        start = time.perf_counter()
        result = perplexity(model, windows, runtime.new_cache, prefill=prefill)
        base = base or result
        rows.append({
            "model": name, "recipe": recipe.name, "ppl": result.ppl, "delta_pct": 100 * (result.ppl / base.ppl - 1),
            "bits_per_element": result.bits_per_element, "bytes_per_token": result.bytes_per_token,
            "cache_bytes": result.cache_bytes, "fp16_cache_bytes": result.fp16_cache_bytes,
            "decode_tokens_per_s": result.decode_tokens_per_s, "seconds": time.perf_counter() - start,
            "windows": result.windows, "seq_len": seq_len, "prefill": prefill, "scored_tokens": result.scored_tokens,
        })
        console.log(f"{name} {recipe.name}: ppl {result.ppl:.3f}")
    return rows


METHOD_RECIPES = [
    "fp8-e4m3", "fp8-e4m3-static", "int8-static-channel", "int8-static-tensor", "int4-static-channel", "int4-static-tensor",
    "kivi-4bit", "kivi-2bit", "turboquant-4bit", "turboquant-3.5bit", "turboquant-3bit", "turboquant-2.5bit",
]


def method_recipes(calib_samples: int, extra: list[str] | None = None) -> list[Recipe]:
    """The suite's recipes, then any other bundled recipe named in ``extra`` (e.g. kvquant-2bit-1pct)."""
    out = []
    for name in METHOD_RECIPES + [n for n in extra or [] if n not in METHOD_RECIPES and n != "turboquant-3bit qjl-keys"]:
        recipe = load_recipe(name)
        out.append(dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, samples=calib_samples)))
    tq = load_recipe("turboquant-3bit")  # the QJL variant: 2-bit codes + 1-bit residual sketch for keys
    out.append(dataclasses.replace(tq, name="turboquant-3bit qjl-keys", keys=dataclasses.replace(tq.keys, qjl=True)))
    return out


class MethodsBench(Bench):
    """`Bench` scoring the last ``decode`` tokens of each window one token per step (the rest is prefilled)."""

    def __init__(self, name: str, samples: int, seq_len: int, decode: int, chunk: int = 1) -> None:
        self.decode, self.chunk = decode, chunk
        super().__init__(name, samples, seq_len)

    def _perplexity(self, runtime):
        prefill = self.seq_len - self.decode if self.decode else self.seq_len // 2
        return perplexity(self.model, self.windows, runtime.new_cache, prefill=prefill, chunk=self.chunk)


def bench_methods(names: list[str], samples: int, seq_len: int, decode: int, calib_samples: int, out: Path, console: Console,
                  only: list[str] | None = None, chunk: int = 1) -> None:
    rows = []
    for name in names:
        bench = MethodsBench(name, samples, seq_len, decode, chunk)
        rows.append({"model": name, "recipe": "uncompressed", "ppl": bench.baseline.ppl, "delta_pct": 0.0,
                     "bits_per_element": bench.baseline.bits_per_element, "bytes_per_token": bench.baseline.bytes_per_token,
                     "decode_tokens_per_s": bench.baseline.decode_tokens_per_s})
        for recipe in method_recipes(calib_samples, only):
            if only and recipe.name not in only:
                continue
            rows.append(bench.score(recipe))
            console.log(f"{name} {recipe.name}: {rows[-1]['delta_pct']:+.2f}% ({rows[-1]['seconds']:.0f} s)")
    print_and_save(rows, "Every quantization method through the runtime (decode 1 token per step)", out, console)
    table = Table(title="decode speed")
    for column in ("model", "recipe", "decode tok/s"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["model"], r["recipe"], f"{r['decode_tokens_per_s']:.1f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=("bits", "methods"), default="bits")
    parser.add_argument("--calib-samples", type=int, default=8, help="methods suite: calibration windows of 512 tokens")
    parser.add_argument("--chunk", type=int, default=1,
                        help="methods suite: tokens per decoding forward (>1 is faster but approximate: a chunk's tokens see each other uncompressed)")
    parser.add_argument("--recipes", nargs="+", default=None,
                        help="methods suite: only these recipe names (any bundled recipe, e.g. kvquant-2bit-1pct)")
    parser.add_argument("--decode", type=int, default=0, help="methods suite: tokens decoded one by one per window (0 = half)")
    parser.add_argument("--models", nargs="+", default=None, choices=list(MODELS) + list(PRETRAINED))
    parser.add_argument("--samples", type=int, default=4, help="evaluation windows per model")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per window (half prefill, half decoded)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quant_bits.json"))
    args = parser.parse_args()
    console = Console()
    if args.suite == "methods":
        out = args.out if args.out != parser.get_default("out") else Path("benchmarks/results/quant_methods.json")
        bench_methods(args.models or ["smollm2-135m"], args.samples, args.seq_len, args.decode, args.calib_samples, out, console, args.recipes, args.chunk)
        return
    args.models = args.models or list(MODELS)
    rows = [row for name in args.models for row in bench_model(name, args.samples, args.seq_len, console)]
    table = Table(title="Perplexity through the runtime vs bits (decode 1 token per step)")
    for column in ("model", "recipe", "ppl", "delta", "bits/elem", "bytes/token", "decode tok/s"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["model"], r["recipe"], f"{r['ppl']:.3f}", f"{r['delta_pct']:+.2f}%", f"{r['bits_per_element']:.2f}",
                      f"{r['bytes_per_token']:.0f}", f"{r['decode_tokens_per_s']:.1f}")
    console.print(table)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "device": "cpu"}
    write_json_atomic(args.out, {"machine": machine, "rows": rows})
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
