"""Benchmark: token eviction through the runtime on kvref-5m (context 2048, held-out WikiText-2 test).

    python -m benchmarks.eviction                          # full grid (~20 min on 2 CPU cores)
    python -m benchmarks.eviction --fractions 0.5 --policies h2o snapkv --samples 1
    python -m benchmarks.eviction --model smollm2-135m --parts ppl --seq-len 1024 --prefill 768 --fractions 0.5 0.25 \
        --policies h2o snapkv tova chunkkv ada-snapkv cake pyramidinfer --thresholds --no-extras   # new policies vs H2O/SnapKV

For every policy (StreamingLLM, H2O, SnapKV, VATP, KNorm, SnapKV with PyramidKV budgets,
SnapKV with budgets fitted by `kvtool profile`) and fraction of the cache kept (50 / 25 /
12.5%): perplexity through the runtime (prefill ``--prefill`` tokens, then true decoding
one token per step with the budget enforced at every step), its delta against the full
cache from the same code path, the fraction of tokens actually kept, the bytes actually
held at the end, and decode tokens/s against the uncompressed cache. FastGen rows use one
attention profile (calibration text: WikiText-2 valid, first 90%) at thresholds T; each is
paired with H2O at the same kept fraction.

Retrieval (kvref-5m cannot retrieve, see its README): the copy model of
`kvtool.eval.copy_model` (a 2-layer Llama with an induction circuit) recalls a 16-token
needle's second half from its first half; exact-match accuracy over lengths x depths x
seeds for every policy and fraction, against the full cache, plus FastGen from a profile
of the copy model on copy prompts. Writes benchmarks/results/eviction.json.
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

from benchmarks.common import MODELS, SHARED, delta_text
from kvtool.attention_profile import profile_attention
from kvtool.data import DataSpec, token_windows
from kvtool.eval.paired_delta import paired_delta
from kvtool.eval.perplexity import perplexity
from kvtool.fileio import write_json_atomic
from kvtool.methods.evict.fastgen import choose_policies, token_classes
from kvtool.models.adapter import adapter_for
from kvtool.models.loading import load_model
from kvtool.recipe import EvictionSpec, load_recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe

VARIANTS = {  # benchmark name -> (policy, extra EvictionSpec fields)
    "streamingllm": ("streamingllm", {}),
    "h2o": ("h2o", {}),
    "snapkv": ("snapkv", {}),
    "snapkv-p15": ("snapkv", {"pooling": 15}),  # pooling wide enough to cover an 8-token answer span
    "vatp": ("vatp", {}),
    "knorm": ("knorm", {}),
    "pyramid-snapkv": ("snapkv", {"layer_budgets": "pyramid"}),
    "fitted-snapkv": ("snapkv", {"layer_budgets": "profile"}),
    "tova": ("tova", {"window": 1}),  # the paper's rule: the last query only, no protected window
    "tova-w32": ("tova", {}),  # the last 32 prompt queries at prefill, a protected 32-token window
    "chunkkv": ("chunkkv", {"chunk_size": 10, "reuse_layers": 2}),
    "chunkkv-noreuse": ("chunkkv", {"chunk_size": 10}),
    "ada-h2o": ("h2o", {"head_budgets": "adaptive"}),
    "ada-snapkv": ("snapkv", {"head_budgets": "adaptive"}),
    "ada-tova": ("tova", {"window": 1, "head_budgets": "adaptive"}),
    "cake": ("cake", {"pooling": 5}),  # recipe `cake`: tau1 = tau2 = 1, gamma 200, average pooling over 5 positions
    "cake-w8": ("cake", {"pooling": 5, "window": 8}),  # the same with an 8-token window (KVCache-Factory's)
    "cake-w16": ("cake", {"pooling": 5, "window": 16}),  # the same with a 16-token window
    "cake-max7": ("cake", {"pooling": 7, "pooling_mode": "max"}),  # SnapKV's pooling: the max over 7 positions
    "cake-uniform": ("cake", {"pooling": 5, "tau1": 1e6, "tau2": 1e6}),  # preferences ^ 1e-6: every layer its uniform budget
    "pyramidinfer": ("pyramidinfer", {}),  # recipe `pyramidinfer`: retention_decay 0.9, distance_weight 1.2
    "pyramidinfer-flat": ("pyramidinfer", {"retention_decay": 1.0}),  # nested head-shared sets, no pyramid
    "pyramidinfer-steep": ("pyramidinfer", {"retention_decay": 0.74}),  # 30 layers: the paper's schedule at 50% (layer 0 keeps all)
}
EVAL_MODELS = {  # --model -> (model dir, calibration text for FastGen/fitted profiles, held-out text)
    "kvref-5m": (str(SHARED / MODELS["kvref-5m"][0]), SHARED / "data/text/wikitext2_valid.txt[0:0.9]", SHARED / MODELS["kvref-5m"][2]),
    "smollm2-135m": ("test-models:smollm2-135m", SHARED / "data/text/wikitext2_valid.txt[0:0.9]", SHARED / "data/text/wikitext2_test.txt"),
}


def eval_model_path(name: str) -> str:
    """A model directory: kvref-5m in ../shared, the pretrained ones from `fetch_pretrained.py`'s cache."""
    path = EVAL_MODELS[name][0]
    if not path.startswith("test-models:"):
        return path
    import os

    root = Path(os.environ.get("KVTOOL_TEST_MODELS", Path.home() / ".cache" / "kvtool-test-models")) / path.split(":", 1)[1]
    if not (root / "config.json").exists():
        raise SystemExit(f"{root} is missing: run `python ../shared/models/fetch_pretrained.py --install-deps` first")
    return str(root)
POLICIES = tuple(VARIANTS)


def eviction_recipe(variant: str, fraction: float, bits: int = 16):
    """An uncompressed (or 4-bit KIVI) cache that evicts with ``variant`` down to ``fraction``."""
    base = uncompressed_recipe("float16") if bits == 16 else load_recipe("kivi-4bit")
    policy, extra = VARIANTS[variant]
    spec = EvictionSpec(policy=policy, budget=fraction, **{"sink_tokens": 4, "window": 32, **extra})
    return dataclasses.replace(base, name=f"{variant}@{fraction:g}" + ("" if bits == 16 else "+4bit"), eviction=spec)


def attention_profile(model, tokenizer, samples: int, seq_len: int, args_model: str = "kvref-5m") -> dict[str, torch.Tensor]:
    calib = DataSpec.parse(str(EVAL_MODELS[args_model][1]))
    windows = token_windows(tokenizer, calib, samples=samples, seq_len=seq_len, seed=0, mode="random")
    special, punct = token_classes(tokenizer)
    return profile_attention(model, adapter_for(model), windows, special, punct, EvictionSpec(), batch_size=2,
                             progress=lambda items, *_: items).tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="kvref-5m", choices=list(EVAL_MODELS), help="perplexity model (retrieval uses the copy model)")
    parser.add_argument("--samples", type=int, default=2, help="held-out windows (scored as one batch)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--prefill", type=int, default=1536, help="tokens prefilled before decoding is scored")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--thresholds", type=float, nargs="*", default=[0.95, 0.9, 0.85, 0.8], help="FastGen T (none: skip)")
    parser.add_argument("--no-extras", action="store_true", help="skip the H2O + 4-bit KIVI row")
    parser.add_argument("--profile-samples", type=int, default=4, help="calibration windows of 1024 tokens")
    parser.add_argument("--parts", nargs="+", default=["ppl", "retrieval"], choices=["ppl", "retrieval"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2000], help="retrieval context lengths (+ 8 generated tokens <= 2048)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--seeds", type=int, default=4, help="retrieval cases per (length, depth)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/eviction.json"))
    args = parser.parse_args()
    console = Console()
    machine = {"platform": platform.platform(), "processor": platform.processor(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "device": "cpu"}
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    payload = {"machine": machine, "settings": settings}
    save = lambda: write_json_atomic(args.out, payload)  # noqa: E731  (after every row: a stopped run keeps its rows)
    if "ppl" in args.parts:
        payload["rows"] = []
        perplexity_rows(args, console, payload["rows"], save)
    if "retrieval" in args.parts:
        payload["retrieval"] = []
        retrieval_rows(args, console, payload["retrieval"], save)
    save()
    console.print(f"wrote {args.out}")


def perplexity_rows(args, console: Console, rows: list[dict], save) -> list[dict]:
    model, tokenizer = load_model(eval_model_path(args.model))
    eval_text = DataSpec.parse(str(EVAL_MODELS[args.model][2]))
    windows = token_windows(tokenizer, eval_text, samples=args.samples, seq_len=args.seq_len, mode="sequential")
    needs_profile = bool(args.thresholds) or "fitted-snapkv" in args.policies
    profile = attention_profile(model, tokenizer, args.profile_samples, 1024, args.model) if needs_profile else None

    baseline = []  # the full cache's per-token NLLs: every row's paired delta is against them

    def score(recipe, label: str, prof: dict | None = None) -> dict:
        start = time.perf_counter()
        runtime = CompressedRuntime.from_recipe(model, recipe, profile=prof)
        result = perplexity(model, windows, runtime.new_cache, prefill=args.prefill, batch_size=args.samples)
        row = {"recipe": label, "policy": recipe.eviction.policy, "budget": recipe.eviction.budget, **result.to_dict(),
               "seconds": time.perf_counter() - start}
        if rows:
            row.update(paired_delta(baseline[0], result.token_nll).to_dict())
            row["speed_vs_full"] = result.decode_tokens_per_s / rows[0]["decode_tokens_per_s"]
        if not rows:
            baseline.append(result.token_nll)
        rows.append(row)
        save()
        console.log(f"{label}: ppl {result.ppl:.3f} ({row.get('delta_pct', 0):+.2f}%), kept {result.kept_fraction:.3f}, "
                    f"{result.cache_bytes} B, {result.decode_tokens_per_s:.1f} tok/s")
        return row

    score(uncompressed_recipe("float16"), "full cache (fp16)")
    for fraction in args.fractions:
        for policy in args.policies:
            score(eviction_recipe(policy, fraction), f"{policy} {fraction:.1%}", profile)
    for threshold in args.thresholds:
        fastgen_profile = {**profile, "heads.policy": choose_policies(profile["heads.mass"], threshold)}
        spec = EvictionSpec(policy="fastgen", threshold=threshold)
        recipe = dataclasses.replace(uncompressed_recipe("float16"), name=f"fastgen T={threshold}", eviction=spec)
        kept = score(recipe, f"fastgen T={threshold}", fastgen_profile)["kept_fraction"]
        if kept < 0.999:
            score(eviction_recipe("h2o", round(kept, 3)), f"h2o at fastgen T={threshold} ({kept:.1%})")
    if not args.no_extras:
        score(eviction_recipe("h2o", 0.5, bits=4), "h2o 50% + 4-bit KIVI")
    print_table(rows, console, args.model)
    return rows


def retrieval_rows(args, console: Console, rows: list[dict], save) -> list[dict]:
    """Copy-needle accuracy per policy and fraction on the copy model, against the full cache."""
    from kvtool.eval.copy_model import CopyVocab, train_copy_model
    from kvtool.eval.retrieval import evaluate_grid
    from kvtool.eval.retrieval_request import RetrievalGrid
    from kvtool.eval.retrieval_tasks import CopyTask

    model = train_copy_model(seed=0)
    task = CopyTask(CopyVocab.for_config(model.config))
    grid = RetrievalGrid(tuple(args.lengths), tuple(args.depths), args.seeds)
    calib = torch.cat([task.cases(1024, depth, 2)[0] for depth in (0.1, 0.4, 0.7)])  # profile prompts (seeds 0-1)
    profile = profile_attention(model, adapter_for(model), calib, torch.tensor([task.vocab.bos]), torch.tensor([], dtype=torch.long),
                                EvictionSpec(), batch_size=2, progress=lambda items, *_: items).tensors
    full = evaluate_grid(model, CompressedRuntime.from_recipe(model, uncompressed_recipe("float16")), task, grid)
    rows.append({"recipe": "full cache", "fraction": 1.0, "grid": full["grid"],
                 **{k: full[k] for k in ("accuracy", "kept_fraction", "cache_bytes")}})
    recipes = [(f"{p} {f:.1%}", eviction_recipe(p, f), f) for f in args.fractions for p in args.policies]
    for threshold in args.thresholds:
        fastgen = dataclasses.replace(uncompressed_recipe("float16"), name=f"fastgen T={threshold}",
                                      eviction=EvictionSpec(policy="fastgen", threshold=threshold))
        recipes.append((f"fastgen T={threshold}", fastgen, None))
    for label, recipe, fraction in recipes:
        runtime = CompressedRuntime.from_recipe(model, recipe, profile=profile)
        result = evaluate_grid(model, runtime, task, grid)
        rows.append({"recipe": label, "fraction": fraction, "accuracy": result["accuracy"],
                     "kept_fraction": result["kept_fraction"], "cache_bytes": result["cache_bytes"],
                     "vs_full_pct": 100 * (result["accuracy"] - full["accuracy"]), "grid": result["grid"]})
        save()
        console.log(f"retrieval {label}: accuracy {result['accuracy']:.3f} (full {full['accuracy']:.3f}), "
                    f"kept {result['kept_fraction']:.3f}")
    table = Table(title=f"copy model: needle retrieval vs fraction kept ({len(grid.lengths)} lengths x "
                        f"{len(grid.depths)} depths x {grid.seeds} seeds)")
    for column in ("recipe", "accuracy", "vs full", "kept", "bytes/sequence"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["recipe"], f"{r['accuracy']:.3f}", f"{r.get('vs_full_pct', 0.0):+.1f} pts",
                      f"{100 * r['kept_fraction']:.1f}%", f"{r['cache_bytes']:,.0f}")
    console.print(table)
    return rows


def print_table(rows: list[dict], console: Console, model: str = "kvref-5m") -> None:
    table = Table(title=f"{model}: perplexity through the evicting runtime vs fraction of the cache kept")
    for column in ("recipe", "ppl", "delta", "kept", "bytes held", "vs full bytes", "decode tok/s", "vs full speed"):
        table.add_column(column, justify="right")
    full_bytes = rows[0]["cache_bytes"]
    for r in rows:
        table.add_row(r["recipe"], f"{r['ppl']:.3f}", delta_text(r) if "delta_pct" in r else "+0.00%", f"{100 * r['kept_fraction']:.1f}%",
                      f"{r['cache_bytes']:,}", f"{r['cache_bytes'] / full_bytes:.3f}", f"{r['decode_tokens_per_s']:.1f}",
                      f"{r.get('speed_vs_full', 1.0):.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
