"""Benchmark: kvpress's presses on kvtool's pass-key grid (question-aware), beside kvtool's eviction recipes.

The same prompts as `tests/test_eviction_passkey.py` and the pass-key tables of benchmarks/RESULTS.md:
`kvtool.eval.retrieval_tasks.PasskeyTask` on held-out WikiText-2 test, 512 tokens, a pass key at
depths 0 / 0.25 / 0.5 / 0.75 / 1, 2 seeds = 10 cases, the question at the end of the prompt; exact
match of the first number generated greedily (`PasskeyTask.score`).

kvpress compresses what is fed while a press is active: the whole prompt (context + question) is
prefilled under the press into a `DynamicCache` (question-aware, as kvtool's grid is), then the
answer is decoded greedily, token by token, without the press (new tokens are appended
uncompressed, as kvpress's pipeline does). ``compression_ratio`` = 1 - the fraction kept.

kvpress 0.5.5 pins transformers < 5.3, so this runs in the peers' environment (see
`benchmarks/peers.py` for the one command that makes it):

    OMP_NUM_THREADS=1 PYTHONPATH=. /work/peers-venv/bin/python -m benchmarks.peers_passkey --model smollm2-135m

kvtool's side: `python -m benchmarks.peers_passkey --side kvtool --model smollm2-135m` (this environment),
the same grid through `kvtool.eval.retrieval.evaluate_grid`. Writes
benchmarks/results/peers_passkey_<model>_<side>[_<length>][_agnostic][_facts<K>][_<tag>].json (after every row) and prints
a markdown table.

``--length`` (the Gemma-3-270M tables use 1024), ``--fractions`` and ``--methods`` pick a part of the grid;
``--facts K`` (multi-fact retrieval) hides K pass keys of different names (Alice, Bob, ...) in the context, the
asked one at the cell's depth and the others at random depths, and asks for one (`PasskeyTask(facts=K)`);
``--question-agnostic`` prefills the context (all but the longest question of the cell) under the press, or
through kvtool's cache, then the question without compression (kvtool: `evaluate_grid(question_agnostic=True)`;
kvpress: in one forward, one token per forward where the press left layers unequal, `feed_question`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from benchmarks.common import PRETRAINED, SHARED
from benchmarks.peers import (
    RESULTS,
    SLIDING,
    environment,
    make_press,
    press_cache,
    press_context,
)
from kvtool.data import DataSpec
from kvtool.eval.retrieval_request import RetrievalGrid
from kvtool.eval.retrieval_tasks import PasskeyTask, text_filler
from kvtool.fileio import write_json_atomic
from kvtool.models.cache_argument import with_cache
from kvtool.quiet import quiet_progress_bars

GRID = RetrievalGrid((512,), (0.0, 0.25, 0.5, 0.75, 1.0), 2)
FRACTIONS = (0.5, 0.25, 0.125)  # fraction of the prompt kept
PRESSES = ("StreamingLLMPress", "SnapKVPress", "TOVAPress", "ExpectedAttentionPress", "KnormPress", "PyramidKVPress", "AdaKVPress")
KVTOOL = ("snapkv", "ada-snapkv", "chunkkv", "h2o", "tova", "rocketkv")


def load(name: str, facts: int = 1):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, _, _ = PRETRAINED[name]
    with quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = PasskeyTask(tokenizer, text_filler(tokenizer, DataSpec.parse(str(SHARED / "data/text/wikitext2_test.txt"))), facts=facts)
    return model, tokenizer, task


@torch.no_grad()
def press_accuracy(model, task, press, grid: RetrievalGrid = GRID, question_agnostic: bool = False, sliding: str = "global") -> dict:
    """Accuracy per depth of one press (None: the full cache) over the grid."""
    from transformers import DynamicCache

    by_depth, kept = {}, []  # kept: tokens held after the compressed prefill / tokens prefilled, over layers
    for n in grid.lengths:
        for depth in grid.depths:
            prompts, answers = task.cases(n, depth, grid.seeds)  # (seeds, n)
            cache = press_cache(model, sliding) if press is not None else DynamicCache(config=model.config)
            context = press_context(press, model, sliding) if press is not None else _null()
            cut = n - task.question_tokens(n, grid.seeds) if question_agnostic else n  # prefilled under the press
            with context:
                logits = model(input_ids=prompts[:, :cut], attention_mask=torch.ones_like(prompts[:, :cut]),
                               **with_cache(cache), logits_to_keep=1).logits  # (S, 1, V): the last position only
            kept.append(sum(layer.keys.shape[-2] for layer in cache.layers) / (len(cache.layers) * cut))
            if cut < n:  # the question, after compression, at its true positions
                logits = feed_question(model, cache, prompts[:, cut:], cut)
            token = logits[:, -1:].argmax(-1)
            generated = [token]
            position = torch.full((prompts.shape[0], 1), n)
            for _ in range(task.new_tokens - 1):
                logits = model(input_ids=token, **with_cache(cache), position_ids=position).logits
                token = logits[:, -1:].argmax(-1)
                generated.append(token)
                position = position + 1
            hits = task.score(torch.cat(generated, dim=1), answers)
            by_depth[depth] = sum(hits) / len(hits)
    return {"accuracy": sum(by_depth.values()) / len(by_depth), "by_depth": by_depth, "kept_fraction": sum(kept) / len(kept)}


def feed_question(model, cache, question: torch.Tensor, start: int) -> torch.Tensor:
    """Logits of the last question token, the question (S, q) fed after the compressed context at positions start ...

    In one forward, as kvpress's pipeline feeds it (`generate_answer`); one token per forward only when the press left
    layers of one kind (full or sliding-window) holding different numbers of tokens (PyramidKV): transformers builds one
    causal mask per layer kind per forward from the first such layer's length, so a multi-token forward fails on the
    others; one-token forwards (as every decode step is) do not fail."""
    held = {(type(layer), layer.keys.shape[-2]) for layer in cache.layers}
    steps = question.shape[1] if len(held) > len({kind for kind, _ in held}) else 1
    positions = torch.arange(start, start + question.shape[1]).expand(question.shape[0], -1)
    for part, where in zip(question.tensor_split(steps, dim=1), positions.tensor_split(steps, dim=1)):
        logits = model(input_ids=part, **with_cache(cache), position_ids=where, logits_to_keep=1).logits
    return logits


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def peer_rows(model, tokenizer, task, log, args) -> list[dict]:
    import kvpress

    grid, agnostic, rows = _grid(args), args.question_agnostic, []
    if not args.no_full:
        rows.append({"side": "peers", "method": "DynamicCache (full)", "kept": 1.0,
                     **press_accuracy(model, task, None, grid, agnostic)})
        log(rows[-1])
    for fraction in args.fractions:
        for name in args.methods or PRESSES:
            started = time.time()
            try:
                result = press_accuracy(model, task, make_press(kvpress, name, 1.0 - fraction), grid, agnostic, args.sliding)
            except Exception as exc:  # noqa: BLE001 -- a press that cannot run on this model is a result too
                result = {"error": f"{type(exc).__name__}: {exc}"}
            label = name + (" (sliding layers too)" if args.sliding == "equal" else "")
            row = {"side": "peers", "method": label, "kept": fraction, **result, "seconds": time.time() - started}
            rows.append(row)
            log(row)
    return rows


def kvtool_rows(model, tokenizer, task, log, args) -> list[dict]:
    from kvtool.eval.baselines import sixteen_bit_recipe
    from kvtool.eval.retrieval import evaluate_grid
    from kvtool.runtime.attach import CompressedRuntime

    def grid(recipe) -> dict:
        started = time.time()
        result = evaluate_grid(model, CompressedRuntime.from_recipe(model, recipe), task, _grid(args),
                               pad_id=tokenizer.pad_token_id, question_agnostic=args.question_agnostic)
        by_depth = {}
        for row in result["grid"]:
            by_depth[row["depth"]] = row["accuracy"]
        return {"accuracy": result["accuracy"], "by_depth": by_depth, "kept_fraction": result["kept_fraction"],
                "seconds": time.time() - started}

    rows = []
    if not args.no_full:
        rows.append({"side": "kvtool", "method": "16-bit cache (full)", "kept": 1.0, **grid(sixteen_bit_recipe())})
        log(rows[-1])
    for fraction in args.fractions:
        for name in args.methods or KVTOOL:
            recipe = _kvtool_recipe(name, fraction)
            rows.append({"side": "kvtool", "method": name, "kept": fraction, **grid(recipe)})
            log(rows[-1])
    return rows


def _kvtool_recipe(name: str, fraction: float):
    """A bundled recipe (or a recipe file) at ``fraction`` kept, else a variant of `benchmarks.eviction` (knorm, vatp, ...)."""
    from kvtool.recipe import bundled_recipe_dir, load_recipe

    if (bundled_recipe_dir() / f"{name}.yaml").exists() or name.endswith((".yaml", ".yml")):
        recipe = load_recipe(name)
        return dataclasses.replace(recipe, eviction=dataclasses.replace(recipe.eviction, budget=fraction))
    from benchmarks.eviction import VARIANTS, eviction_recipe

    if name not in VARIANTS:
        raise SystemExit(f"{name!r} is neither a bundled recipe nor a variant of benchmarks.eviction ({', '.join(VARIANTS)})")
    return eviction_recipe(name, fraction)


def _grid(args) -> RetrievalGrid:
    return RetrievalGrid((args.length,), GRID.depths, args.seeds)


def markdown(rows: list[dict]) -> str:
    depths = GRID.depths
    lines = ["| side | method | kept | accuracy | " + " | ".join(f"depth {d:g}" for d in depths) + " |",
             "|---" * (4 + len(depths)) + "|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['side']} | {row['method']} | {row['kept']:g} | failed: {row['error']} |" + " |" * len(depths))
            continue
        cells = [f"{row['by_depth'][d]:g}" for d in depths]
        lines.append(f"| {row['side']} | {row['method']} | {row['kept']:g} | {row['accuracy']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def result_name(args) -> str:
    """peers_passkey_<model>_<side>[_<length>][_agnostic][_facts<K>][_<tag>]: runs that differ never overwrite."""
    return "_".join([f"peers_passkey_{args.model}_{args.side}"] + ([str(args.length)] if args.length != GRID.lengths[0] else [])
                    + (["agnostic"] if args.question_agnostic else []) + ([f"facts{args.facts}"] if args.facts != 1 else [])
                    + ([args.tag] if args.tag else []))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(PRETRAINED))
    parser.add_argument("--side", default="peers", choices=("peers", "kvtool"))
    parser.add_argument("--length", type=int, default=GRID.lengths[0], help="prompt tokens (RESULTS: 512 SmolLM2, 1024 Gemma)")
    parser.add_argument("--seeds", type=int, default=GRID.seeds)
    parser.add_argument("--facts", type=int, default=1, help="pass keys in the context (multi-fact retrieval: one is asked)")
    parser.add_argument("--fractions", type=float, nargs="+", default=FRACTIONS, help="fractions of the prompt kept")
    parser.add_argument("--methods", nargs="+", help="presses (peers) or recipes / benchmarks.eviction variants such as knorm, vatp (kvtool); default: all of the side's")
    parser.add_argument("--no-full", action="store_true", help="skip the full-cache row")
    parser.add_argument("--question-agnostic", action="store_true", help="compress the context before the question")
    parser.add_argument("--sliding", choices=SLIDING, default="global",
                        help="presses on Gemma 3's sliding-window layers (benchmarks.peers.press_context)")
    parser.add_argument("--tag", help="suffix of the JSON file name (runs of one model and side that must not overwrite)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    model, tokenizer, task = load(args.model, args.facts)
    out, saved = RESULTS / f"{result_name(args)}.json", []

    def log(row: dict) -> None:  # print and save after every row: a stopped run keeps what it measured
        saved.append(row)
        print(json.dumps({k: row.get(k) for k in ("side", "method", "kept", "accuracy", "kept_fraction", "seconds", "error")}), flush=True)
        write_json_atomic(out, {"model": args.model, "side": args.side, "grid": dataclasses.asdict(_grid(args)),
                                "question_agnostic": args.question_agnostic, "facts": args.facts, "rows": saved, "environment": environment()})

    rows = (peer_rows if args.side == "peers" else kvtool_rows)(model, tokenizer, task, log, args)
    print(markdown(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
