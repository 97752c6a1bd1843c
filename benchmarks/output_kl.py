"""Benchmark: how far a compressed cache moves the model's next-token distribution (KL), beside the perplexity delta.

    python -m benchmarks.output_kl --model gemma3-270m --samples 8 --recipes fp8-e4m3 fp8-e4m3-static

A perplexity delta measures the change of the held-out text's log-likelihood, which mixes how much a
cache distorts the model with whether the distortion happens to help or hurt on that text; two recipes
with the same distortion can read +0.4% and -0.0%. The KL divergence KL(p_16bit || p_recipe) of the
next-token distributions, token by token, measures the distortion itself, with much less noise per token.

Protocol: the held-out windows of `benchmarks.common` (sequential, ``--seq-len`` tokens, the first half
prefilled), then one token per step through the 16-bit uncompressed cache and every recipe's cache, in
turn on the same tokens. Each recipe is calibrated first on the model's calibration text (``--calib-samples``
windows; recipes that need no calibration ignore it). Per recipe: mean / median / 99th percentile KL
(nats per token), the mean change of the text's NLL with its paired 95% interval as a perplexity delta
(`kvtool.eval.paired_delta`). Writes benchmarks/results/output_kl_<model>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from benchmarks.common import MODELS, PRETRAINED, SHARED
from kvtool.api import calibrate_loaded
from kvtool.data import DataSpec, token_windows
from kvtool.eval.paired_delta import paired_delta
from kvtool.fileio import write_json_atomic
from kvtool.models.cache_argument import with_cache
from kvtool.models.logits_argument import last_logits_only
from kvtool.models.loading import load_model
from kvtool.recipe import load_recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe

BASELINE = "16-bit"


def runtimes(model, tokenizer, name: str, recipes: list[str], calib_samples: int, seq_len: int) -> dict:
    """{label: CompressedRuntime}: the 16-bit uncompressed baseline, then each recipe calibrated."""
    out = {BASELINE: CompressedRuntime.from_recipe(model, uncompressed_recipe("float16"))}
    calib_text = {**MODELS, **PRETRAINED}[name][1]
    for recipe_name in recipes:
        recipe = load_recipe(recipe_name)
        cal = dataclasses.replace(recipe.calibration, samples=calib_samples, seq_len=min(recipe.calibration.seq_len, seq_len))
        artifact = calibrate_loaded(model, tokenizer, str(SHARED / calib_text), dataclasses.replace(recipe, calibration=cal))
        out[recipe_name] = CompressedRuntime.from_artifact(model, artifact)
    return out


@torch.no_grad()
def score(model, windows: torch.Tensor, runs: dict, batch_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """Per label: ``kl`` (N, S) KL(p_baseline || p_label) and ``nll`` (N, S) of the next token, S = decoded steps."""
    prefill = windows.shape[1] // 2
    out = {label: {"kl": [], "nll": []} for label in runs}
    for batch in windows.split(batch_size):
        caches = {label: rt.new_cache() for label, rt in runs.items()}
        for cache in caches.values():
            model(input_ids=batch[:, :prefill], **with_cache(cache), use_cache=True, **last_logits_only(model))
        steps = {label: {"kl": [], "nll": []} for label in runs}
        for s in range(prefill, batch.shape[1] - 1):
            logp = {}
            for label, cache in caches.items():
                logits = model(input_ids=batch[:, s : s + 1], **with_cache(cache), use_cache=True).logits[:, -1].float()
                logp[label] = F.log_softmax(logits, dim=-1)  # (b, V)
                steps[label]["nll"].append(-logp[label].gather(1, batch[:, s + 1 : s + 2]).squeeze(1))
            base = logp[BASELINE]
            for label in runs:
                steps[label]["kl"].append((base.exp() * (base - logp[label])).sum(dim=-1))  # (b,)
        for label in runs:
            for key in ("kl", "nll"):
                out[label][key].append(torch.stack(steps[label][key], dim=1))  # (b, S)
    return {label: {key: torch.cat(parts, dim=0) for key, parts in values.items()} for label, values in out.items()}


def rows(scored: dict) -> list[dict]:
    base_nll = scored[BASELINE]["nll"]
    result = []
    for label, values in scored.items():
        if label == BASELINE:
            continue
        kl = values["kl"].flatten().double()
        result.append({
            "recipe": label, "scored_tokens": kl.numel(), "kl_mean": float(kl.mean()), "kl_median": float(kl.median()),
            "kl_p99": float(kl.quantile(0.99)), **paired_delta(base_nll, values["nll"]).to_dict(),
        })
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[*MODELS, *PRETRAINED], default="gemma3-270m")
    parser.add_argument("--recipes", nargs="+", default=["fp8-e4m3", "fp8-e4m3-static"])
    parser.add_argument("--samples", type=int, default=8, help="held-out windows")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per window: half prefilled, half decoded")
    parser.add_argument("--calib-samples", type=int, default=2, help="calibration windows (recipes that need them)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.seq_len < 4 or args.samples < 1:
        parser.error("--seq-len must be >= 4 and --samples >= 1")
    model_dir, _, eval_text = {**MODELS, **PRETRAINED}[args.model]
    model, tokenizer = load_model(str(SHARED / model_dir))
    windows = token_windows(tokenizer, DataSpec.parse(str(SHARED / eval_text)), samples=args.samples,
                            seq_len=args.seq_len, mode="sequential")
    runs = runtimes(model, tokenizer, args.model, args.recipes, args.calib_samples, args.seq_len)
    result = rows(score(model, windows, runs, args.batch_size))
    table = Table(title=f"{args.model}: KL(16-bit || recipe) per decoded token, {result[0]['scored_tokens']} tokens")
    for column in ("recipe", "KL mean", "KL median", "KL p99", "ppl delta (95% interval)"):
        table.add_column(column)
    for row in result:
        low, high = row["delta_ci95_pct"]
        table.add_row(row["recipe"], f"{row['kl_mean']:.5f}", f"{row['kl_median']:.5f}", f"{row['kl_p99']:.4f}",
                      f"{row['delta_pct']:+.2f}% ({low:+.2f} .. {high:+.2f})")
    Console().print(table)
    out = args.out or Path(__file__).parent / "results" / f"output_kl_{args.model}.json"
    write_json_atomic(out, {"model": args.model, "windows": args.samples, "seq_len": args.seq_len,
                            "machine": platform.platform(), "torch": torch.__version__, "rows": result})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
