"""Benchmark: what sparse attention (RocketKV's stage 2) costs on top of its eviction, with a paired interval.

    python -m benchmarks.sparse_stage2 --model smollm2-135m --starts 0 0.5 0.25 0.75 --samples 4

Stage 2 reads part of the kept cache per decode step and frees nothing, so its cost is measured
against the same recipe with ``sparse_attention`` removed (stage 1 alone), on the same tokens:
the paired perplexity delta (`kvtool.eval.paired_delta`) of each variant over stage 1, and the
fraction of the held tokens its decode steps read. Variants change ``sparse_attention`` only:
``--variants paper=unread:drop,channel_score:query bundled=`` (the default) runs the recipe with the
paper's rules (channels by |q|, the tokens not read left out of the softmax) and as bundled
(kvtool's ``channel_score: query_key``, ``unread: estimate_blocks`` and ``read_budget: shared``,
`kvtool.methods.sparse.rocketkv`).

Protocol: ``--samples`` sequential windows of ``--seq-len`` tokens of the held-out text from each of
``--starts`` (fractions of the text), ``--prefill`` tokens prefilled (stage 1 cuts them), the rest
decoded one token per step, every cache in turn on the same batch (`kvtool.eval.perplexity.perplexities`).
Each variant after the first is also compared with the first, paired on the same tokens. Prints a
table; writes benchmarks/results/sparse_stage2_<model>.json.
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
from kvtool.data import DataSpec, token_windows
from kvtool.eval.paired_delta import paired_delta
from kvtool.eval.perplexity import perplexities
from kvtool.fileio import write_json_atomic
from kvtool.models.loading import load_model
from kvtool.recipe import SparseAttentionSpec, load_recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe

STAGE1 = "stage 1 alone"


def parse_variant(text: str) -> tuple[str, dict]:
    """'label=field:value,field:value' -> (label, {field: value}) of `SparseAttentionSpec` fields."""
    label, _, body = text.partition("=")
    types = {f.name: f.type for f in dataclasses.fields(SparseAttentionSpec)}
    fields = {}
    for item in filter(None, body.split(",")):
        name, _, value = item.partition(":")
        if name not in types:
            raise SystemExit(f"--variants: '{name}' is not a sparse_attention field ({', '.join(types)})")
        fields[name] = {"float": float, "int": int}.get(types[name], str)(value)
    return label, fields


def windows_from(tokenizer, text: str, starts: list[float], samples: int, seq_len: int) -> torch.Tensor:
    """(len(starts) x samples, seq_len) sequential windows, ``samples`` from each start (a fraction of the text)."""
    parts = [token_windows(tokenizer, DataSpec.parse(f"{text}[{start}:1]"), samples=samples, seq_len=seq_len,
                           mode="sequential") for start in starts]
    return torch.cat(parts, dim=0)


def variant_recipes(recipe, variants: list[str]) -> dict:
    """{label: Recipe}: the 16-bit cache, stage 1 alone (no sparse_attention), then each variant of ``recipe``."""
    recipes = {"16-bit": uncompressed_recipe("float16"),
               STAGE1: dataclasses.replace(recipe, sparse_attention=SparseAttentionSpec())}
    for label, fields in map(parse_variant, variants):
        recipes[label] = dataclasses.replace(recipe, sparse_attention=dataclasses.replace(recipe.sparse_attention, **fields))
    return recipes


def measure(model, recipes: dict, windows: torch.Tensor, prefill: int, batch_size: int) -> list[dict]:
    """One row per recipe, all scored in turn on the same batches; variants carry their paired cost over stage 1."""
    runtimes = {label: CompressedRuntime.from_recipe(model, r) for label, r in recipes.items()}
    results = dict(zip(runtimes, perplexities(model, windows, [rt.new_cache for rt in runtimes.values()],
                                              prefill=prefill, batch_size=batch_size)))
    stage1 = results[STAGE1]
    first = next((label for label in results if label not in ("16-bit", STAGE1)), None)
    rows = []
    for label, result in results.items():
        row = {"variant": label, "ppl": result.ppl, "scored_tokens": result.scored_tokens, "kept_fraction": result.kept_fraction,
               "sparse_read_fraction": result.sparse_read_fraction, "bits_per_element": result.bits_per_element,
               "sparse_attention": dataclasses.asdict(recipes[label].sparse_attention)}
        if label not in ("16-bit", STAGE1):
            row["cost_over_stage1"] = paired_delta(stage1.token_nll, result.token_nll).to_dict()
        if label not in ("16-bit", STAGE1, first):  # against the first variant, on the same tokens
            row["delta_over_first_variant"] = paired_delta(results[first].token_nll, result.token_nll).to_dict()
        if label != "16-bit":
            row["delta_over_16bit"] = paired_delta(results["16-bit"].token_nll, result.token_nll).to_dict()
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[*MODELS, *PRETRAINED], default="smollm2-135m")
    parser.add_argument("--recipe", default="rocketkv", help="a recipe with sparse_attention")
    parser.add_argument("--variants", nargs="+", default=["paper=unread:drop,channel_score:query", "bundled="],
                        help="label=field:value,... of sparse_attention (label= alone: the recipe as it is)")
    parser.add_argument("--starts", nargs="+", type=float, default=[0.0, 0.5, 0.25, 0.75])
    parser.add_argument("--samples", type=int, default=4, help="windows from each start")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=768)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not 1 <= args.prefill <= args.seq_len - 2:
        parser.error("--prefill must be between 1 and --seq-len - 2")
    recipe = load_recipe(args.recipe)
    if not recipe.sparse_attention.enabled:
        parser.error(f"recipe '{recipe.name}' has no sparse_attention to measure")
    model_dir, _, eval_text = {**MODELS, **PRETRAINED}[args.model]
    model, tokenizer = load_model(str(SHARED / model_dir))
    windows = windows_from(tokenizer, str(SHARED / eval_text), args.starts, args.samples, args.seq_len)
    recipes = variant_recipes(recipe, args.variants)
    rows = measure(model, recipes, windows, args.prefill, args.batch_size)
    scored = rows[0]["scored_tokens"]
    table = Table(title=f"{args.model}, {recipe.name}: stage 2 over stage 1, {windows.shape[0]} windows, {scored} scored tokens")
    first = rows[2]["variant"] if len(rows) > 2 else ""
    for column in ("variant", "ppl", "kept", "read per step", "bits/elem held", "cost over stage 1 (95% interval)",
                   f"over {first} (95% interval)"):
        table.add_column(column)

    def interval(delta):
        return f"{delta['delta_pct']:+.2f}% ({delta['delta_ci95_pct'][0]:+.2f} .. {delta['delta_ci95_pct'][1]:+.2f})" if delta else ""

    for row in rows:
        table.add_row(row["variant"], f"{row['ppl']:.3f}", f"{row['kept_fraction']:.3f}", f"{100 * row['sparse_read_fraction']:.1f}%",
                      f"{row['bits_per_element']:.2f}", interval(row.get("cost_over_stage1")),
                      interval(row.get("delta_over_first_variant")))
    Console(width=160).print(table)
    out = args.out or Path(__file__).parent / "results" / f"sparse_stage2_{args.model}.json"
    write_json_atomic(out, {"model": args.model, "recipe": recipe.name, "starts": args.starts, "samples": args.samples,
                            "seq_len": args.seq_len, "prefill": args.prefill, "scored_tokens": scored,
                            "machine": platform.platform(), "torch": torch.__version__, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
