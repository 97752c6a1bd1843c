"""Shared plumbing of the benchmarks: models and texts in ../shared, calibrate-then-score, table + JSON."""

from __future__ import annotations

import dataclasses
import platform
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvtool.api import calibrate_loaded
from kvtool.data import DataSpec, token_windows
from kvtool.eval.paired_delta import paired_delta
from kvtool.eval.perplexity import perplexity
from kvtool.fileio import write_json_atomic
from kvtool.models.loading import load_model
from kvtool.recipe import Recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MODELS = {  # model dir, calibration text, held-out evaluation text
    "kvref-5m": ("models/kvref-5m", "data/text/wikitext2_valid.txt[0:0.9]", "data/text/wikitext2_test.txt"),
    "stories260K": ("models/stories260K", "data/text/tinystories_val_head.txt[0:0.9]", "data/text/tinystories_val_head.txt[0.9:1]"),
}

PRETRAINED_DIR = Path.home() / ".cache" / "kvtool-test-models"  # `python ../shared/models/fetch_pretrained.py`
PRETRAINED = {  # real pretrained models (absolute dirs), same texts as kvref-5m
    "smollm2-135m": (str(PRETRAINED_DIR / "smollm2-135m"), "data/text/wikitext2_valid.txt[0:0.9]", "data/text/wikitext2_test.txt"),
    "gemma3-270m": (str(PRETRAINED_DIR / "gemma3-270m"), "data/text/wikitext2_valid.txt[0:0.9]", "data/text/wikitext2_test.txt"),
}


class Bench:
    """One model, its held-out windows and uncompressed baseline; `score(recipe)` gives a result row."""

    def __init__(self, name: str, samples: int, seq_len: int) -> None:
        model_dir, self.calib_data, eval_data = {**MODELS, **PRETRAINED}[name]  # SHARED / absolute = absolute
        self.name = name
        self.model, self.tokenizer = load_model(str(SHARED / model_dir))
        self.seq_len = min(seq_len, self.model.config.max_position_embeddings)
        spec = DataSpec.parse(str(SHARED / eval_data))
        self.windows = token_windows(self.tokenizer, spec, samples=samples, seq_len=self.seq_len, mode="sequential")
        self.head_dim = CompressedRuntime.from_recipe(self.model, uncompressed_recipe()).adapter.geometry.head_dim
        self.baseline = self._perplexity(CompressedRuntime.from_recipe(self.model, uncompressed_recipe()))

    def _perplexity(self, runtime: CompressedRuntime):
        return perplexity(self.model, self.windows, runtime.new_cache, prefill=self.seq_len // 2)

    def score(self, recipe: Recipe, label: str | None = None) -> dict:
        """Calibrate on the calibration text (fits learned methods, measures SQNR), then score through the runtime."""
        start = time.perf_counter()
        cal = dataclasses.replace(recipe.calibration, seq_len=min(recipe.calibration.seq_len, self.seq_len))
        recipe = dataclasses.replace(recipe, calibration=cal)
        artifact = calibrate_loaded(self.model, self.tokenizer, str(SHARED / self.calib_data), recipe)
        runtime = CompressedRuntime.from_artifact(self.model, artifact)
        quality, body_bits = artifact.manifest["quality"], artifact.manifest["expected_bits_per_element"]
        result = self._perplexity(runtime)
        return {
            "model": self.name, "recipe": label or recipe.name, "ppl": result.ppl, "baseline_ppl": self.baseline.ppl,
            **paired_delta(self.baseline.token_nll, result.token_nll).to_dict(), "bits_per_element": result.bits_per_element,
            "body_bits": body_bits, "compression_pct": 100 * (1 - body_bits["body"] / 16) if body_bits else None,
            "bytes_per_token": result.bytes_per_token, "keys_sqnr_db": quality.get("keys_sqnr_db"),
            "values_sqnr_db": quality.get("values_sqnr_db"), "decode_tokens_per_s": result.decode_tokens_per_s,
            "seconds": time.perf_counter() - start, "windows": result.windows, "seq_len": self.seq_len,
        }


def delta_text(row: dict) -> str:
    """"+0.43% (-0.10 .. +0.97)": the perplexity delta and its paired 95% interval where the row has one."""
    interval = row.get("delta_ci95_pct")
    return f"{row['delta_pct']:+.2f}%" + (f" ({interval[0]:+.2f} .. {interval[1]:+.2f})" if interval else "")


def print_and_save(rows: list[dict], title: str, out: Path, console: Console) -> None:
    """Rich table of the rows, and JSON with the machine."""
    table = Table(title=title)
    columns = ("model", "recipe", "ppl", "delta", "bits/elem held", "body compression", "bytes/token", "K SQNR dB", "V SQNR dB")
    for column in columns:
        table.add_column(column, justify="right")
    fmt = lambda x, spec=".1f": "" if x is None else format(x, spec)  # noqa: E731
    for r in rows:
        table.add_row(r["model"], r["recipe"], f"{r['ppl']:.3f}", delta_text(r), f"{r['bits_per_element']:.2f}",
                      fmt(r.get("compression_pct")) + ("%" if r.get("compression_pct") is not None else ""),
                      f"{r['bytes_per_token']:.0f}", fmt(r.get("keys_sqnr_db")), fmt(r.get("values_sqnr_db")))
    console.print(table)
    machine = {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__, "device": "cpu"}
    write_json_atomic(out, {"machine": machine, "rows": rows})
    console.print(f"wrote {out}")


def run(description: str, default_out: str, recipes_for, title: str, extra=lambda recipe: {}) -> None:
    """Command line shared by the calibrate-then-score benchmarks: --models/--samples/--seq-len/--calib-samples/--out."""
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS) + list(PRETRAINED))
    parser.add_argument("--samples", type=int, default=4, help="evaluation windows per model")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per evaluation window")
    parser.add_argument("--calib-samples", type=int, default=16, help="calibration windows of 512 tokens")
    parser.add_argument("--out", type=Path, default=Path(default_out))
    args = parser.parse_args()
    console = Console()
    rows = []
    for name in args.models:
        bench = Bench(name, args.samples, args.seq_len)
        for recipe in recipes_for(bench.head_dim, args.calib_samples):
            rows.append({**bench.score(recipe), **extra(recipe)})
            console.log(f"{name} {recipe.name}: {rows[-1]['delta_pct']:+.2f}%")
    print_and_save(rows, title, args.out, console)
