"""Benchmark: the KVQuant ablation and nuq-1% against uniform quantization, through the runtime.

    python benchmarks/kvquant_ablation.py                       # both shared models
    python benchmarks/kvquant_ablation.py --models kvref-5m --samples 2

Ablation at 3 bits (each row adds one KVQuant component):
  int3 per-token keys -> per-channel keys -> pre-RoPE keys -> nuq (Fisher k-means) -> nuq + 1% outliers.
Then nuq + 1% outliers at 4/3/2 bits against uniform (per-channel keys, per-token values) at the
same code width. Every recipe keeps only the first token in 16-bit (attention sink) and no
recent window, so the numbers show the quantizer itself. Perplexity through the runtime
(prefill half of each window, decode the rest one token per step), delta against the
uncompressed cache, bits per element actually held, bytes per token, and key/value SQNR (dB)
from calibration. Calibration: random windows from the first 90% of the calibration text.
Writes benchmarks/results/kvquant_ablation.json. Needs ../shared.
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

from kvtool.api import calibrate_loaded
from kvtool.data import DataSpec, token_windows
from kvtool.eval.perplexity import perplexity
from kvtool.fileio import write_json_atomic
from kvtool.models.loading import load_model
from kvtool.recipe import CacheSpec, CalibrationSpec, QuantSpec, Recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MODELS = {  # model dir, calibration text, held-out evaluation text
    "kvref-5m": ("models/kvref-5m", "data/text/wikitext2_valid.txt[0:0.9]", "data/text/wikitext2_test.txt"),
    "stories260K": ("models/stories260K", "data/text/tinystories_val_head.txt[0:0.9]", "data/text/tinystories_val_head.txt[0.9:1]"),
}


def recipe(name: str, keys: QuantSpec, values: QuantSpec, samples: int) -> Recipe:
    return Recipe(
        name=name, keys=keys, values=values,
        cache=CacheSpec(block_size=32, sink_tokens=1, recent_tokens=0),
        calibration=CalibrationSpec(samples=samples, seq_len=512, seed=0),
    )


def ablation(head_dim: int, samples: int) -> list[Recipe]:
    g = min(32, head_dim)
    def k(**kw):
        return QuantSpec(path="keys", **kw)

    def v(**kw):
        return QuantSpec(path="values", axis="token", group_size=g, **kw)

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


def bench_model(name: str, samples: int, seq_len: int, calib_samples: int, console: Console) -> list[dict]:
    model_dir, calib_data, eval_data = MODELS[name]
    model, tokenizer = load_model(str(SHARED / model_dir))
    seq_len = min(seq_len, model.config.max_position_embeddings)
    windows = token_windows(tokenizer, DataSpec.parse(str(SHARED / eval_data)), samples=samples, seq_len=seq_len, mode="sequential")
    head_dim = CompressedRuntime.from_recipe(model, uncompressed_recipe()).adapter.geometry.head_dim
    base = perplexity(model, windows, CompressedRuntime.from_recipe(model, uncompressed_recipe()).new_cache, prefill=seq_len // 2)
    rows = [{"model": name, "recipe": "uncompressed", "ppl": base.ppl, "delta_pct": 0.0, "bits_per_element": base.bits_per_element,
             "bytes_per_token": base.bytes_per_token, "keys_sqnr_db": None, "values_sqnr_db": None}]
    for r in ablation(head_dim, calib_samples):
        start = time.perf_counter()
        calib_recipe = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, seq_len=min(512, seq_len)))
        artifact = calibrate_loaded(model, tokenizer, str(SHARED / calib_data), calib_recipe)
        runtime = CompressedRuntime.from_artifact(model, artifact)
        result = perplexity(model, windows, runtime.new_cache, prefill=seq_len // 2)
        quality = artifact.manifest["quality"]
        rows.append({
            "model": name, "recipe": r.name, "ppl": result.ppl, "delta_pct": 100 * (result.ppl / base.ppl - 1),
            "bits_per_element": result.bits_per_element, "body_bits": artifact.manifest["expected_bits_per_element"],
            "bytes_per_token": result.bytes_per_token, "keys_sqnr_db": quality.get("keys_sqnr_db"),
            "values_sqnr_db": quality.get("values_sqnr_db"), "rate_distortion_db": 6.02 * r.keys.bits,
            "decode_tokens_per_s": result.decode_tokens_per_s,
            "seconds": time.perf_counter() - start, "windows": samples, "seq_len": seq_len,
        })
        console.log(f"{name} {r.name}: ppl {result.ppl:.3f} ({rows[-1]['delta_pct']:+.2f}%)")
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
    rows = [r for name in args.models for r in bench_model(name, args.samples, args.seq_len, args.calib_samples, console)]
    table = Table(title="KVQuant ablation through the runtime (1 fp16 sink, no recent window)")
    for column in ("model", "recipe", "ppl", "delta", "bits/elem", "bytes/token", "K SQNR dB", "V SQNR dB", "6.02*b dB"):
        table.add_column(column, justify="right")
    fmt = lambda x: "" if x is None else f"{x:.1f}"  # noqa: E731
    for r in rows:
        table.add_row(r["model"], r["recipe"], f"{r['ppl']:.3f}", f"{r['delta_pct']:+.2f}%", f"{r['bits_per_element']:.2f}",
                      f"{r['bytes_per_token']:.0f}", fmt(r["keys_sqnr_db"]), fmt(r["values_sqnr_db"]), fmt(r.get("rate_distortion_db")))
    console.print(table)
    machine = {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__, "device": "cpu"}
    write_json_atomic(args.out, {"machine": machine, "rows": rows})
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
