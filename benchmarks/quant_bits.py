"""Benchmark: perplexity through the runtime and cache bytes at 16/8/4/2 bits, and every quantization method.

    python -m benchmarks.quant_bits                      # both shared models, table + JSON
    python -m benchmarks.quant_bits --models kvref-5m --samples 2 --seq-len 512
    python -m benchmarks.quant_bits --suite methods --models smollm2-135m --samples 2 --seq-len 512

``--suite methods``: the bundled recipes of every method side by side (fp8, static int, KIVI,
TurboQuant at 2.5 - 4 bits, with and without the QJL key residual), each calibrated on the
calibration text (fits static scales; measures key/value SQNR, next to 6.02 dB per bit) and
scored through the runtime: perplexity delta (decode mode), bits per element held, bytes per
token, decode tokens/s, and the inner-product error of the stored keys against the model's
real queries on the held-out windows (`kvtool.eval.inner_product`: each layer's key format
scores q . k with its own ``chunk_scores``, as the runtime's attention does; per layer and query
head, bias = mean(q.k_hat - q.k) / std(q.k), shrink = slope of q.k_hat on q.k minus 1,
error variance = var(q.k_hat - q.k) / var(q.k), relative MSE = mean((q.k_hat - q.k)**2) / var(q.k),
averaged over layers and heads). ``--passkey-cases N --passkey-length L`` adds pass-key accuracy:
the grid of the eviction tables (`kvtool.eval.retrieval.evaluate_grid`, `PasskeyTask` on held-out
WikiText-2 test, plain text, depths 0 / 0.25 / 0.5 / 0.75 / 1 x N / 5 seeds, greedy decoding through
the runtime: the prompt prefilled, every answer token after the first attends to the compressed
cache) for the uncompressed baseline and every recipe. ``--no-perplexity`` skips the perplexity
scoring (the other columns only); ``--calib-seq-len`` sets the calibration windows' length (static
per-channel scales fitted on 512 tokens clip post-RoPE keys at later positions); ``--key-rope pre post``
scores every recipe twice, its keys stored before and after RoPE (overriding ``keys.pre_rope``; rows
named ``<recipe> pre-rope keys`` / ``post-rope keys``). Writes benchmarks/results/quant_methods.json.

    python -m benchmarks.quant_bits --suite methods --models smollm2-135m --samples 2 --seq-len 512 \
        --calib-samples 2 --passkey-cases 10 --passkey-length 1024

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
from typing import Iterator

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import MODELS, PRETRAINED, SHARED, Bench, delta_text, print_and_save
from kvtool.api import calibrate_loaded
from kvtool.data import DataSpec, token_windows
from kvtool.errors import RuntimeConfigError
from kvtool.eval.inner_product import inner_product_error
from kvtool.eval.paired_delta import paired_delta
from kvtool.eval.perplexity import perplexity
from kvtool.eval.retrieval import evaluate_grid
from kvtool.eval.retrieval_request import RetrievalGrid
from kvtool.eval.retrieval_tasks import PasskeyTask, text_filler
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
            "model": name, "recipe": recipe.name, "ppl": result.ppl, **paired_delta(base.token_nll, result.token_nll).to_dict(),
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


def method_recipes(calib_samples: int, extra: list[str] | None = None, calib_seq_len: int | None = None) -> Iterator[Recipe]:
    """The suite's recipes, then any other bundled recipe named in ``extra`` (e.g. kvquant-2bit-1pct).

    calib_seq_len: tokens per calibration window (default: each recipe's own, 512 for the bundled ones)."""
    out = []
    tq = load_recipe("turboquant-3bit")  # the QJL variant: 2-bit codes + 1-bit residual sketch for keys
    qjl = dataclasses.replace(tq, name="turboquant-3bit qjl-keys", keys=dataclasses.replace(tq.keys, qjl=True))
    for name in METHOD_RECIPES + [n for n in extra or [] if n not in METHOD_RECIPES and n != "turboquant-3bit qjl-keys"]:
        out.append(load_recipe(name))
    for recipe in out + [qjl]:
        seq_len = calib_seq_len or recipe.calibration.seq_len
        yield dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, samples=calib_samples, seq_len=seq_len))


KEY_ROPE_CHOICES = ("pre", "post")


def with_key_rope(recipe: Recipe, key_rope: str) -> Recipe:
    """The recipe with its keys stored before (``pre``) or after (``post``) RoPE, named ``<recipe> <pre|post>-rope keys``."""
    keys = dataclasses.replace(recipe.keys, pre_rope=key_rope == "pre")
    return dataclasses.replace(recipe, name=f"{recipe.name} {key_rope}-rope keys", keys=keys)


PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def passkey_grid(cases: int, length: int) -> RetrievalGrid | None:
    """``cases`` pass-key prompts of ``length`` tokens: the 5 depths x cases / 5 seeds (None: no pass-key column)."""
    if not cases:
        return None
    if cases % len(PASSKEY_DEPTHS):
        raise SystemExit(f"--passkey-cases {cases}: use a multiple of {len(PASSKEY_DEPTHS)} (depths {PASSKEY_DEPTHS} x seeds)")
    return RetrievalGrid((length,), PASSKEY_DEPTHS, cases // len(PASSKEY_DEPTHS))


class MethodsBench(Bench):
    """`Bench` scoring the last ``decode`` tokens of each window one token per step (the rest is prefilled),
    plus the inner-product error of the stored keys and, with a grid, pass-key accuracy."""

    def __init__(self, name: str, samples: int, seq_len: int, decode: int, chunk: int = 1,
                 passkey: RetrievalGrid | None = None, score_perplexity: bool = True) -> None:
        self.decode, self.chunk, self.passkey, self.score_perplexity = decode, chunk, passkey, score_perplexity
        super().__init__(name, samples, seq_len)
        eval_data = {**MODELS, **PRETRAINED}[name][2]
        self.task = PasskeyTask(self.tokenizer, text_filler(self.tokenizer, DataSpec.parse(str(SHARED / eval_data))))

    def _perplexity(self, runtime):
        self.scored_runtime = runtime  # the calibrated runtime `Bench.score` built: the other columns reuse it
        if not self.score_perplexity:
            return None
        prefill = self.seq_len - self.decode if self.decode else self.seq_len // 2
        return perplexity(self.model, self.windows, runtime.new_cache, prefill=prefill, chunk=self.chunk)

    def baseline_row(self) -> dict:
        """The uncompressed cache (model dtype) through the same code paths."""
        runtime = CompressedRuntime.from_recipe(self.model, uncompressed_recipe())
        row = {"model": self.name, "recipe": "uncompressed", "delta_pct": 0.0 if self.baseline is not None else None}
        if self.baseline is not None:
            row.update(ppl=self.baseline.ppl, bits_per_element=self.baseline.bits_per_element,
                       bytes_per_token=self.baseline.bytes_per_token, decode_tokens_per_s=self.baseline.decode_tokens_per_s)
        return {**row, **self.extra_columns(runtime)}

    def score(self, recipe: Recipe, label: str | None = None) -> dict:
        """Calibrate (fits static scales, measures SQNR), then every column through the calibrated runtime."""
        row = super().score(recipe, label) if self.score_perplexity else self._calibrated_row(recipe, label)
        return {**row, **self.extra_columns(self.scored_runtime)}

    def _calibrated_row(self, recipe: Recipe, label: str | None) -> dict:
        """Without perplexity: calibrate, keep the runtime, report SQNR and body bits."""
        start = time.perf_counter()
        cal = dataclasses.replace(recipe.calibration, seq_len=min(recipe.calibration.seq_len, self.seq_len))
        artifact = calibrate_loaded(self.model, self.tokenizer, str(SHARED / self.calib_data), dataclasses.replace(recipe, calibration=cal))
        self.scored_runtime = CompressedRuntime.from_artifact(self.model, artifact)
        quality = artifact.manifest["quality"]
        return {"model": self.name, "recipe": label or recipe.name, "delta_pct": None, "keys_sqnr_db": quality.get("keys_sqnr_db"),
                "values_sqnr_db": quality.get("values_sqnr_db"), "body_bits": artifact.manifest["expected_bits_per_element"],
                "seconds": time.perf_counter() - start}

    def extra_columns(self, runtime: CompressedRuntime) -> dict:
        """Inner-product error of the stored keys on the held-out windows and, with a grid, pass-key accuracy."""
        start = time.perf_counter()
        try:
            error = inner_product_error(runtime, self.windows)
        except RuntimeConfigError as err:  # a format it does not measure (Palu latents of grouped heads): the row stays
            out = {f"ip_{name}": None for name in IP_COLUMNS}
            out["ip_unmeasured"] = str(err)
        else:
            out = {f"ip_{name}": value for name, value in error.summary().items()}
            out["ip_by_layer"] = error.by_layer()
        out["ip_seconds"] = time.perf_counter() - start
        if self.passkey is not None:
            start = time.perf_counter()
            result = evaluate_grid(self.model, runtime, self.task, self.passkey, pad_id=self.tokenizer.pad_token_id)
            out.update(passkey_accuracy=result["accuracy"], passkey_by_depth={row["depth"]: row["accuracy"] for row in result["grid"]},
                       passkey_seconds=time.perf_counter() - start)
        return out


def bench_methods(names: list[str], samples: int, seq_len: int, decode: int, calib_samples: int, out: Path, console: Console,
                  only: list[str] | None = None, chunk: int = 1, passkey: RetrievalGrid | None = None,
                  score_perplexity: bool = True, calib_seq_len: int | None = None, key_ropes: list[str] | None = None) -> None:
    """key_ropes: score every recipe once per entry, its keys stored before / after RoPE (None: as the recipe says)."""
    rows = []
    for name in names:
        bench = MethodsBench(name, samples, seq_len, decode, chunk, passkey, score_perplexity)
        rows.append(bench.baseline_row())
        console.log(f"{name} uncompressed: {_columns_line(rows[-1])}")
        for recipe in method_recipes(calib_samples, only, calib_seq_len):
            if only and recipe.name not in only:
                continue
            for variant in [with_key_rope(recipe, rope) for rope in key_ropes] if key_ropes else [recipe]:
                rows.append(bench.score(variant))
                console.log(f"{name} {variant.name}: {_columns_line(rows[-1])} ({rows[-1]['seconds']:.0f} s)")
                _save(rows, out, passkey)  # after every row: a stopped run keeps what it measured
    if score_perplexity:
        print_and_save(rows, "Every quantization method through the runtime (decode 1 token per step)", out, console)
        table = Table(title="decode speed")
        for column in ("model", "recipe", "decode tok/s"):
            table.add_column(column, justify="right")
        for r in rows:
            table.add_row(r["model"], r["recipe"], f"{r['decode_tokens_per_s']:.1f}")
        console.print(table)
    _save(rows, out, passkey)
    console.print(_metrics_table(rows))
    if not score_perplexity:  # print_and_save said it already
        console.print(f"wrote {out}")


IP_COLUMNS = ("bias", "shrink", "error_var", "rel_mse", "abs_bias", "pairs")  # `InnerProductError.summary()`


def _number(value, spec: str) -> str:
    """``value`` formatted, or "n/a" where it was not measured."""
    return "n/a" if value is None else format(value, spec)


def _columns_line(row: dict) -> str:
    parts = [delta_text(row)] if row.get("ppl") is not None else []
    parts.append(f"q.k bias {_number(row['ip_bias'], '+.3f')} shrink {_number(row['ip_shrink'], '+.3f')} "
                 f"error var {_number(row['ip_error_var'], '.4f')}")
    if "passkey_accuracy" in row:
        parts.append(f"pass-key {row['passkey_accuracy']:.2f}")
    return ", ".join(parts)


def _metrics_table(rows: list[dict]) -> Table:
    table = Table(title="q . k of the stored keys against real queries (means over layers and query heads), pass-key accuracy")
    for column in ("model", "recipe", "bias", "|bias|", "shrink", "error var", "rel MSE", "pass-key"):
        table.add_column(column, justify="right")
    for r in rows:
        passkey = "" if r.get("passkey_accuracy") is None else f"{r['passkey_accuracy']:.2f}"
        table.add_row(r["model"], r["recipe"], _number(r["ip_bias"], "+.4f"), _number(r["ip_abs_bias"], ".4f"),
                      _number(r["ip_shrink"], "+.4f"), _number(r["ip_error_var"], ".4f"), _number(r["ip_rel_mse"], ".4f"), passkey)
    return table


def _save(rows: list[dict], out: Path, passkey: RetrievalGrid | None) -> None:
    machine = {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__, "device": "cpu"}
    grid = None if passkey is None else dataclasses.asdict(passkey)
    write_json_atomic(out, {"machine": machine, "passkey_grid": grid, "rows": rows})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=("bits", "methods"), default="bits")
    parser.add_argument("--calib-samples", type=int, default=8, help="methods suite: calibration windows of 512 tokens")
    parser.add_argument("--calib-seq-len", type=int, default=None,
                        help="methods suite: tokens per calibration window (default 512; at most --seq-len)")
    parser.add_argument("--chunk", type=int, default=1,
                        help="methods suite: tokens per decoding forward (>1 is faster but approximate: a chunk's tokens see each other uncompressed)")
    parser.add_argument("--recipes", nargs="+", default=None,
                        help="methods suite: only these recipe names (any bundled recipe, e.g. kvquant-2bit-1pct)")
    parser.add_argument("--decode", type=int, default=0, help="methods suite: tokens decoded one by one per window (0 = half)")
    parser.add_argument("--passkey-cases", type=int, default=0,
                        help="methods suite: pass-key prompts per recipe (a multiple of 5: depths 0-1 x seeds; 0 = no pass-key column)")
    parser.add_argument("--passkey-length", type=int, default=1024, help="methods suite: tokens per pass-key prompt")
    parser.add_argument("--key-rope", nargs="+", default=None, choices=KEY_ROPE_CHOICES,
                        help="methods suite: score each recipe with its keys stored before (pre) and/or after (post) RoPE, "
                             "overriding keys.pre_rope (default: as the recipe says)")
    parser.add_argument("--no-perplexity", action="store_true", help="methods suite: skip perplexity and decode speed (the other columns only)")
    parser.add_argument("--models", nargs="+", default=None, choices=list(MODELS) + list(PRETRAINED))
    parser.add_argument("--samples", type=int, default=4, help="evaluation windows per model")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per window (half prefill, half decoded)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quant_bits.json"))
    args = parser.parse_args()
    console = Console()
    if args.suite == "methods":
        out = args.out if args.out != parser.get_default("out") else Path("benchmarks/results/quant_methods.json")
        bench_methods(args.models or ["smollm2-135m"], args.samples, args.seq_len, args.decode, args.calib_samples, out, console,
                      args.recipes, args.chunk, passkey_grid(args.passkey_cases, args.passkey_length), not args.no_perplexity,
                      args.calib_seq_len, args.key_rope)
        return
    args.models = args.models or list(MODELS)
    rows = [row for name in args.models for row in bench_model(name, args.samples, args.seq_len, console)]
    table = Table(title="Perplexity through the runtime vs bits (decode 1 token per step)")
    for column in ("model", "recipe", "ppl", "delta", "bits/elem", "bytes/token", "decode tok/s"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["model"], r["recipe"], f"{r['ppl']:.3f}", delta_text(r), f"{r['bits_per_element']:.2f}",
                      f"{r['bytes_per_token']:.0f}", f"{r['decode_tokens_per_s']:.1f}")
    console.print(table)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "device": "cpu"}
    write_json_atomic(args.out, {"machine": machine, "rows": rows})
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
