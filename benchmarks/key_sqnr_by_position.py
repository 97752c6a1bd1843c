"""Benchmark: key / value SQNR by position, inside and past the calibration windows (issue 12).

Static ranges are fitted on calibration windows of ``--calib-seq-len`` tokens. Keys stored after
RoPE then meet, at later positions, angles of the slow rotary pairs that calibration never saw;
keys stored before RoPE do not depend on the position. Per model and recipe: calibrate (as
`kvtool calibrate`, on the benchmark's calibration text), then run ``--samples`` held-out windows
of ``--seq-len`` tokens through the model and measure every layer's quantizers exactly as
calibration measures them (`QuantErrorStats`: the stored keys, before or after RoPE as the recipe
says, in full blocks past the float sinks) on two spans of positions: the calibrated one
[sinks, calib_seq_len) and the rest [calib_seq_len, seq_len).

    python -m benchmarks.key_sqnr_by_position --models gemma3-270m smollm2-135m \\
        --recipes int8-static-channel int4-static-channel --key-rope post pre

Writes benchmarks/results/key_sqnr_by_position.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import MODELS, PRETRAINED, SHARED
from benchmarks.quant_bits import KEY_ROPE_CHOICES, with_key_rope
from kvtool.api import calibrate_loaded
from kvtool.calibration import QuantErrorStats
from kvtool.capture import stream_batches
from kvtool.data import DataSpec, token_windows
from kvtool.fileio import write_json_atomic
from kvtool.models.adapter import adapter_for
from kvtool.models.loading import load_model
from kvtool.recipe import Recipe, load_recipe


class PositionSpan:
    """Observer: hands another observer the K/V of positions [start, stop) only, each (B, H, T', D)."""

    def __init__(self, observer, start: int, stop: int) -> None:
        self.observer, self.span = observer, slice(start, stop)

    def observe(self, layer, keys_pre_rope, keys, values) -> None:
        self.observer.observe(layer, keys_pre_rope[:, :, self.span], keys[:, :, self.span], values[:, :, self.span])


def sqnr_by_span(model, tokenizer, name: str, recipe: Recipe, windows: torch.Tensor, calib_seq_len: int) -> dict:
    """Calibrate the recipe, then its key / value SQNR (dB) on the calibrated span and past it."""
    calib_text = str(SHARED / {**MODELS, **PRETRAINED}[name][1])
    calibration = dataclasses.replace(recipe.calibration, seq_len=calib_seq_len)
    artifact = calibrate_loaded(model, tokenizer, calib_text, dataclasses.replace(recipe, calibration=calibration))
    adapter = adapter_for(model)
    fitted = [artifact.layer_tensors(i) for i in range(adapter.geometry.num_layers)]
    sinks, seq_len = recipe.cache.sink_tokens, windows.shape[1]
    # QuantErrorStats leaves out the first `sinks` positions it is given: start the far span that much earlier
    spans = {"near": (0, calib_seq_len), "far": (calib_seq_len - sinks, seq_len)}
    stats = {span: QuantErrorStats(recipe, adapter.geometry.head_dim, fitted) for span in spans}
    with torch.no_grad():
        stream_batches(model, adapter, windows, [PositionSpan(stats[s], *spans[s]) for s in spans], batch_size=1)
    row = {"model": name, "recipe": recipe.name, "calibration_keys_sqnr_db": artifact.manifest["quality"].get("keys_sqnr_db")}
    for span, errors in stats.items():
        summary = errors.summary()
        row[f"{span}_keys_sqnr_db"], row[f"{span}_values_sqnr_db"] = summary["keys_sqnr_db"], summary["values_sqnr_db"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma3-270m"], choices=list(MODELS) + list(PRETRAINED))
    parser.add_argument("--recipes", nargs="+", default=["int8-static-channel", "int4-static-channel"])
    parser.add_argument("--key-rope", nargs="+", default=None, choices=KEY_ROPE_CHOICES,
                        help="score each recipe with its keys stored before (pre) and/or after (post) RoPE (default: as the recipe says)")
    parser.add_argument("--samples", type=int, default=2, help="held-out windows per model")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per held-out window")
    parser.add_argument("--calib-samples", type=int, default=2, help="calibration windows")
    parser.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/key_sqnr_by_position.json"))
    args = parser.parse_args()
    if not 0 < args.calib_seq_len < args.seq_len:
        raise SystemExit(f"--calib-seq-len {args.calib_seq_len} must be below --seq-len {args.seq_len}: the far span is what lies past it")
    console, rows = Console(), []
    for name in args.models:
        model_dir, _, eval_text = {**MODELS, **PRETRAINED}[name]
        model, tokenizer = load_model(str(SHARED / model_dir))
        windows = token_windows(tokenizer, DataSpec.parse(str(SHARED / eval_text)), samples=args.samples, seq_len=args.seq_len,
                                mode="sequential")
        for recipe_name in args.recipes:
            recipe = load_recipe(recipe_name)
            recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, samples=args.calib_samples))
            for variant in [with_key_rope(recipe, rope) for rope in args.key_rope] if args.key_rope else [recipe]:
                rows.append(sqnr_by_span(model, tokenizer, name, variant, windows, args.calib_seq_len))
                console.log(f"{name} {variant.name}: K SQNR {rows[-1]['near_keys_sqnr_db']:.1f} dB at positions < "
                            f"{args.calib_seq_len}, {rows[-1]['far_keys_sqnr_db']:.1f} dB past them")
                machine = {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__, "device": "cpu"}
                write_json_atomic(args.out, {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    table = Table(title=f"SQNR (dB) at positions < {args.calib_seq_len} (calibrated) and {args.calib_seq_len}-{args.seq_len - 1}")
    for column in ("model", "recipe", "K near", "K far", "V near", "V far"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["model"], r["recipe"], *(f"{r[f'{s}_{p}_sqnr_db']:.1f}" for p in ("keys", "values") for s in ("near", "far")))
    console.print(table)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
