"""Benchmark: FastGen with head policies profiled offline vs chosen from each prompt, on the pass-key grid.

The grid of `tests/test_eviction_passkey.py` and RESULTS.md "Pass-key retrieval": a pass key at
depths 0 / 0.25 / 0.5 / 0.75 / 1 of ``--length`` tokens of held-out WikiText-2 test, 2 seeds per
depth, asked at the end, greedy decoding through the runtime (`kvtool.eval.retrieval.evaluate_grid`).
Rows: the 16-bit cache; `fastgen-t95` with the policy map of a `kvtool profile` artifact
(``--profile``, skipped without one); `fastgen-prompt-t95` at each of ``--thresholds`` (and
``--window``, the prompt queries whose attention chooses; the recipe's 32). Besides accuracy per depth and the kept fraction, each per-prompt row records
which policies the (layer, sequence, KV head) streams chose at one prompt of each depth (seed 0).

    python -m benchmarks.fastgen_prompt --model smollm2-135m --profile /tmp/smollm2-profile.safetensors
    python -m benchmarks.fastgen_prompt --model gemma3-270m --length 1024
    python -m benchmarks.fastgen_prompt --model smollm2-135m --thresholds 0.95 --explain   # why needles are lost

Writes benchmarks/results/fastgen_prompt_<model>_<length>[_<tag>].json after every row and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from benchmarks.common import PRETRAINED
from benchmarks.peers import RESULTS
from benchmarks.peers_passkey import GRID, load
from kvtool.artifact import load_artifact
from kvtool.eval.baselines import sixteen_bit_recipe
from kvtool.eval.retrieval import evaluate_grid
from kvtool.eval.retrieval_request import RetrievalGrid
from kvtool.fileio import write_json_atomic
from kvtool.methods.evict.fastgen import FASTGEN_POLICIES, fastgen_token_classes
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import load_recipe
from kvtool.runtime.attach import CompressedRuntime


def per_prompt_recipe(threshold: float, window: int):
    """`fastgen-prompt-t95` at another threshold T and choice window (queries whose attention decides)."""
    recipe = load_recipe("fastgen-prompt-t95")
    eviction = dataclasses.replace(recipe.eviction, threshold=threshold, window=window)
    return dataclasses.replace(recipe, name=f"fastgen-prompt T={threshold:g} window {window}", eviction=eviction)


@torch.no_grad()
def chosen_policies(model, runtime, task, length: int, depths) -> dict[str, float]:
    """Share of streams (layers x sequences x KV heads) per chosen policy after one prefill per depth (seed 0)."""
    counts = torch.zeros(len(FASTGEN_POLICIES))
    for depth in depths:
        prompts, _ = task.cases(length, depth, 1)
        cache = runtime.new_cache()
        model(input_ids=prompts, **with_cache(cache), logits_to_keep=1)
        for layer in cache.layers:
            counts += torch.bincount(layer.stream_state.cpu(), minlength=len(FASTGEN_POLICIES)).float()
    return {name: round(float(c / counts.sum()), 3) for name, c in zip(FASTGEN_POLICIES, counts)}


def needle_positions(tokenizer, prompt: torch.Tensor, key: str, question: int) -> list[int]:
    """Positions of the tokens spelling the pass key in the context (the needle sentence writes it twice), not the question."""
    texts = [tokenizer.decode([int(t)]).strip() for t in prompt[:-question]]
    positions = []
    for start in range(len(texts)):  # runs of tokens that spell the key
        if not texts[start]:
            continue
        spelled, end = "", start
        while end < len(texts) and len(spelled) < len(key) and key.startswith(spelled + texts[end]):
            spelled, end = spelled + texts[end], end + 1
        if spelled == key and (not positions or start > positions[-1]):
            positions += list(range(start, end))
    return positions


@torch.no_grad()
def explain(model, tokenizer, task, runtime, length: int, window: int, depths, seeds: int) -> list[dict]:
    """Per case: the (layer, KV head) streams that hold no whole copy of the key after prefill, by chosen policy, and the
    needle's share of those streams' window attention (the last ``window`` queries, GQA group summed; eager attention
    of the same model) against the streams that kept it."""
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32, attn_implementation="eager").eval()
    question = task.question_tokens(length, seeds)
    rows = []
    for depth in depths:
        prompts, keys = task.cases(length, depth, seeds)
        for seed in range(seeds):
            prompt = prompts[seed : seed + 1]
            needle = needle_positions(tokenizer, prompt[0], keys[seed], question)
            copies = [c.tolist() for c in torch.tensor(needle).split(len(needle) // 2)] if needle else []
            cache = runtime.new_cache()
            model(input_ids=prompt, **with_cache(cache), logits_to_keep=1)
            attentions = eager(input_ids=prompt, output_attentions=True).attentions  # per layer (1, H_q, T, T)
            dropped, kept, dropped_layers = {}, [], []
            for index, layer in enumerate(cache.layers):
                _, _, positions, valid = layer.decoded()  # (1, H_kv, N)
                probs = attentions[index][0]  # (H_q, T, T)
                heads = positions.shape[1]
                share = probs.reshape(heads, -1, *probs.shape[1:])[:, :, -window:].sum(dim=(1, 2))  # (H_kv, T)
                share = share[:, needle].sum(dim=1) / share.sum(dim=1)  # (H_kv,)
                for head in range(heads):
                    held = set(positions[0, head][valid[0, head]].tolist())
                    policy = FASTGEN_POLICIES[int(layer.stream_state[head])] if layer.stream_state is not None else "offline"
                    if any(set(copy) <= held for copy in copies):  # a whole copy of the key stays
                        kept.append(float(share[head]))
                    else:
                        dropped.setdefault(policy, []).append(float(share[head]))
                        dropped_layers.append(index)
            rows.append({"depth": depth, "seed": seed, "needle_tokens": len(needle),
                         "dropped_by_policy": {p: len(v) for p, v in dropped.items()}, "dropped_layers": dropped_layers,
                         "dropped_max_share": max((x for v in dropped.values() for x in v), default=0.0),
                         "kept_max_share": max(kept, default=0.0)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(PRETRAINED))
    parser.add_argument("--length", type=int, default=GRID.lengths[0])
    parser.add_argument("--seeds", type=int, default=GRID.seeds)
    parser.add_argument("--profile", help="`kvtool profile` artifact of the model for the offline fastgen-t95 row")
    parser.add_argument("--thresholds", type=float, nargs="*", default=[0.95, 0.9], help="T of the per-prompt rows")
    parser.add_argument("--window", type=int, default=32, help="prompt queries whose attention chooses (the recipe's 32)")
    parser.add_argument("--no-full", action="store_true", help="skip the 16-bit row")
    parser.add_argument("--explain", action="store_true", help="per case: streams that dropped the needle (see `explain`)")
    parser.add_argument("--tag", help="suffix of the JSON file name (parts of one grid run apart)")
    args = parser.parse_args()
    model, tokenizer, task = load(args.model)
    grid = RetrievalGrid((args.length,), GRID.depths, args.seeds)
    tag = f"_{args.tag}" if args.tag else ""
    out, rows = RESULTS / f"fastgen_prompt_{args.model}_{args.length}{tag}.json", []
    classes = fastgen_token_classes(tokenizer)

    def run(label: str, recipe, profile: dict | None) -> dict:
        started = time.time()
        runtime = CompressedRuntime.from_recipe(model, recipe, profile=profile)
        result = evaluate_grid(model, runtime, task, grid, pad_id=tokenizer.pad_token_id)
        row = {"recipe": label, "accuracy": result["accuracy"], "kept_fraction": result["kept_fraction"],
               "cache_bytes": result["cache_bytes"], "by_depth": {r["depth"]: r["accuracy"] for r in result["grid"]}}
        if recipe.eviction.fastgen_per_prompt:
            row["chosen"] = chosen_policies(model, runtime, task, args.length, grid.depths)
        row["seconds"] = round(time.time() - started, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_json_atomic(out, {"model": args.model, "grid": dataclasses.asdict(grid), "rows": rows})
        return row

    if args.explain:
        recipe = per_prompt_recipe(args.thresholds[0], args.window)
        runtime = CompressedRuntime.from_recipe(model, recipe, profile=classes)
        payload = {"recipe": recipe.name, "cases": explain(model, tokenizer, task, runtime, args.length, recipe.eviction.window,
                                                             grid.depths, grid.seeds)}
        write_json_atomic(RESULTS / f"fastgen_prompt_{args.model}_{args.length}_explain.json", payload)
        return
    if not args.no_full:
        run("16-bit cache (full)", sixteen_bit_recipe(), None)
    if args.profile:
        run("fastgen-t95 (offline profile)", load_recipe("fastgen-t95"), load_artifact(args.profile).tensors)
    for threshold in args.thresholds:
        recipe = per_prompt_recipe(threshold, args.window)
        run(recipe.name, recipe, classes)
    print(markdown(rows, grid.depths))


def markdown(rows: list[dict], depths) -> str:
    lines = ["| recipe | accuracy | " + " | ".join(f"depth {d:g}" for d in depths) + " | kept fraction | bytes/sequence |",
             "|---" * (4 + len(depths)) + "|"]
    for row in rows:
        cells = " | ".join(f"{row['by_depth'][d]:g}" for d in depths)
        lines.append(f"| {row['recipe']} | {row['accuracy']:.1f} | {cells} | {row['kept_fraction']:.3f} | {row['cache_bytes']:,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
