"""Retrieval through the real runtime: exact-match accuracy over a grid of context lengths x depths.

For every cell (n, d) the task (`kvtool.eval.retrieval_tasks`) builds one n-token prompt
per seed; the cell runs as one batch through ``model.generate`` with a fresh cache from
the runtime (greedy decoding), then again with the baseline's cache (the 16-bit cache,
`kvtool.eval.baselines`; same code path). The prompt is prefilled in one forward, so the first answer
token is predicted from the uncompressed prompt; every later token attends to what the
cache kept. A cell records accuracy, the cache's ``kept_fraction`` (1.0 for runtimes that
evict nothing) and its bytes per sequence at the end of generation.

Prompts of one cell have exactly n tokens (the filler is cut to fit), so no padding is
needed: padding would put pad tokens among the attention sinks and the tokens an
evicting cache scores.
"""

from __future__ import annotations

import torch

from kvtool.capture import Progress, no_progress
from kvtool.eval.retrieval_request import RetrievalGrid
from kvtool.models.cache_argument import with_cache
from kvtool.models.logits_argument import last_logits_only


@torch.no_grad()
def _generate(model, runtime, prompts: torch.Tensor, new_tokens: int, pad_id: int | None,
              question_tokens: int = 0) -> tuple[torch.Tensor, dict]:
    """Greedy continuation (S, <= new_tokens) of prompts (S, n) with a fresh cache, and its memory report.

    question_tokens > 0 (question-agnostic): the context (all but the last ``question_tokens``)
    is prefilled alone first, so an evicting cache compresses it before the question exists
    (SnapKV-style scores then come from the context's own last tokens); the question follows.
    """
    device = next(model.parameters()).device
    cache = runtime.new_cache()
    ids = prompts.to(device)
    if question_tokens:
        context = ids[:, :-question_tokens]
        model(input_ids=context, attention_mask=torch.ones_like(context), **with_cache(cache), **last_logits_only(model))
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(cache),
        max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
    )
    return out[:, prompts.shape[1] :].cpu(), cache.memory_report()


def _measure(model, runtime, task, prompts, answers, pad_id, question_tokens: int = 0) -> dict:
    generated, report = _generate(model, runtime, prompts, task.new_tokens, pad_id, question_tokens)
    hits = task.score(generated, answers)
    batch = prompts.shape[0]
    return {
        "accuracy": sum(hits) / len(hits),
        "kept_fraction": float(report.get("kept_fraction", 1.0)),
        "cache_bytes": report["cache_bytes"] / batch,
        "reserved_cache_bytes": report.get("reserved_bytes", report["cache_bytes"]) / batch,
        "fp16_cache_bytes": report["fp16_cache_bytes"] / batch,
    }


def evaluate_grid(
    model,
    runtime,
    task,
    grid: RetrievalGrid,
    *,
    baseline_runtime=None,
    pad_id: int | None = None,
    progress: Progress = no_progress,
    question_agnostic: bool = False,
) -> dict:
    """Accuracy of ``task`` over ``grid`` with ``runtime``'s caches (and ``baseline_runtime``'s, if given).

    Returns the summary (means over cells; bytes are per sequence at the end of generation)
    and ``grid``: one row per (n, depth) with accuracy, baseline_accuracy, kept_fraction,
    cache_bytes, reserved_cache_bytes (pool blocks allocated), baseline_cache_bytes and fp16_cache_bytes.

    question_agnostic: compress each prompt's context before its question arrives (one
    compressed document, any question later; see `_generate`). A cell's question part is its
    longest question (``task.question_tokens(n, seeds)``): rows with a shorter one see a few
    context tokens after compression too. The baseline runs the same way.
    """
    runtime.check_context(max(grid.lengths) + task.new_tokens, "lower --lengths")
    cells = [(n, d, *task.cases(n, d, grid.seeds)) for n in grid.lengths for d in grid.depths]  # all built before any run
    rows = []
    for n, depth, prompts, answers in progress(cells, "retrieval grid", len(cells)):
        question = task.question_tokens(n, grid.seeds) if question_agnostic else 0
        row = {"n": n, "depth": depth, **_measure(model, runtime, task, prompts, answers, pad_id, question)}
        if baseline_runtime is not None:
            base = _measure(model, baseline_runtime, task, prompts, answers, pad_id, question)
            row.update(baseline_accuracy=base["accuracy"], baseline_cache_bytes=base["cache_bytes"])
        else:
            row.update(baseline_accuracy=None, baseline_cache_bytes=None)
        rows.append(row)
    return {**_summary(rows), "grid": rows}


def _summary(rows: list[dict]) -> dict:
    def mean(key: str):
        values = [row[key] for row in rows]
        return None if any(v is None for v in values) else sum(values) / len(values)

    keys = ("accuracy", "baseline_accuracy", "kept_fraction", "cache_bytes", "reserved_cache_bytes",
            "baseline_cache_bytes", "fp16_cache_bytes")
    return {key: mean(key) for key in keys}


def retrieval_caveats(report: dict, model) -> dict:
    """The baseline's name, the model-dtype cache's bytes per sequence, chance accuracy and a note at chance."""
    from kvtool.eval.baselines import model_dtype_fields
    from kvtool.eval.caveats import chance_accuracy, retrieval_note

    fields = {**model_dtype_fields(model, report["fp16_cache_bytes"]),
              "chance_accuracy": chance_accuracy(report["task"], report)}
    note = retrieval_note({**report, **fields})
    return {**fields, **({"note": note} if note else {})}
