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
benchmarks/results/peers_passkey_<model>_<side>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from benchmarks.common import PRETRAINED, SHARED
from benchmarks.peers import RESULTS, environment, make_press
from kvtool.data import DataSpec
from kvtool.eval.retrieval_request import RetrievalGrid
from kvtool.eval.retrieval_tasks import PasskeyTask, text_filler
from kvtool.fileio import write_json_atomic
from kvtool.quiet import quiet_progress_bars

GRID = RetrievalGrid((512,), (0.0, 0.25, 0.5, 0.75, 1.0), 2)
FRACTIONS = (0.5, 0.25, 0.125)  # fraction of the prompt kept
PRESSES = ("StreamingLLMPress", "SnapKVPress", "TOVAPress", "ExpectedAttentionPress", "KnormPress", "PyramidKVPress", "AdaKVPress")
KVTOOL = ("snapkv", "ada-snapkv", "chunkkv", "h2o", "tova", "rocketkv")


def load(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, _, _ = PRETRAINED[name]
    with quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = PasskeyTask(tokenizer, text_filler(tokenizer, DataSpec.parse(str(SHARED / "data/text/wikitext2_test.txt"))))
    return model, tokenizer, task


@torch.no_grad()
def press_accuracy(model, task, press) -> dict:
    """Accuracy per depth of one press (None: the full cache) over the grid."""
    from transformers import DynamicCache

    by_depth = {}
    for n in GRID.lengths:
        for depth in GRID.depths:
            prompts, answers = task.cases(n, depth, GRID.seeds)  # (seeds, n)
            cache = DynamicCache()
            context = press(model) if press is not None else _null()
            with context:
                logits = model(input_ids=prompts, attention_mask=torch.ones_like(prompts), past_key_values=cache).logits
            token = logits[:, -1:].argmax(-1)
            generated = [token]
            position = torch.full((prompts.shape[0], 1), n)
            for _ in range(task.new_tokens - 1):
                logits = model(input_ids=token, past_key_values=cache, position_ids=position).logits
                token = logits[:, -1:].argmax(-1)
                generated.append(token)
                position = position + 1
            hits = task.score(torch.cat(generated, dim=1), answers)
            by_depth[depth] = sum(hits) / len(hits)
    return {"accuracy": sum(by_depth.values()) / len(by_depth), "by_depth": by_depth}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def peer_rows(model, task, log) -> list[dict]:
    import kvpress

    rows = [{"side": "peers", "method": "DynamicCache (full)", "kept": 1.0, **press_accuracy(model, task, None)}]
    log(rows[-1])
    for fraction in FRACTIONS:
        for name in PRESSES:
            started = time.time()
            row = {"side": "peers", "method": name, "kept": fraction,
                   **press_accuracy(model, task, make_press(kvpress, name, 1.0 - fraction)), "seconds": time.time() - started}
            rows.append(row)
            log(row)
    return rows


def kvtool_rows(model, tokenizer, task, log) -> list[dict]:
    from kvtool.eval.baselines import sixteen_bit_recipe
    from kvtool.eval.retrieval import evaluate_grid
    from kvtool.recipe import load_recipe
    from kvtool.runtime.attach import CompressedRuntime

    def grid(recipe) -> dict:
        result = evaluate_grid(model, CompressedRuntime.from_recipe(model, recipe), task, GRID, pad_id=tokenizer.pad_token_id)
        by_depth = {}
        for row in result["grid"]:
            by_depth[row["depth"]] = row["accuracy"]
        return {"accuracy": result["accuracy"], "by_depth": by_depth, "kept_fraction": result["kept_fraction"]}

    rows = [{"side": "kvtool", "method": "16-bit cache (full)", "kept": 1.0, **grid(sixteen_bit_recipe())}]
    log(rows[-1])
    for fraction in FRACTIONS:
        for name in KVTOOL:
            recipe = load_recipe(name)
            recipe = dataclasses.replace(recipe, eviction=dataclasses.replace(recipe.eviction, budget=fraction))
            rows.append({"side": "kvtool", "method": name, "kept": fraction, **grid(recipe)})
            log(rows[-1])
    return rows


def markdown(rows: list[dict]) -> str:
    depths = GRID.depths
    lines = ["| side | method | kept | accuracy | " + " | ".join(f"depth {d:g}" for d in depths) + " |",
             "|---" * (4 + len(depths)) + "|"]
    for row in rows:
        cells = [f"{row['by_depth'][d]:g}" for d in depths]
        lines.append(f"| {row['side']} | {row['method']} | {row['kept']:g} | {row['accuracy']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(PRETRAINED))
    parser.add_argument("--side", default="peers", choices=("peers", "kvtool"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer, task = load(args.model)
    log = lambda row: print(json.dumps({k: row[k] for k in ("side", "method", "kept", "accuracy")}), flush=True)  # noqa: E731
    rows = peer_rows(model, task, log) if args.side == "peers" else kvtool_rows(model, tokenizer, task, log)
    out = RESULTS / f"peers_passkey_{args.model}_{args.side}.json"
    write_json_atomic(out, {"model": args.model, "side": args.side, "grid": dataclasses.asdict(GRID), "rows": rows,
                            "environment": environment()})
    print(markdown(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
