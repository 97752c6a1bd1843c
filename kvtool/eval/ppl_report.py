"""`kvtool eval ppl`'s report: the runtime's cache against the 16-bit baseline, plus the model-dtype cache.

Rows, each through `kvtool.eval.perplexity` (the same code path):

* the runtime's cache (recipe or artifact): unprefixed keys;
* the 16-bit cache (`kvtool.eval.baselines.BASELINE`): ``baseline_*`` keys; ``delta_pct`` and
  ``compression_ratio`` are relative to it;
* where the model does not compute in 16 bits (float32 on CPU), its own dtype's cache:
  ``model_dtype_*`` keys, ``model_dtype`` names the dtype.

Several runtimes (`perplexity_reports`): one report each, all rows scored in the same interleaved pass, the
baseline rows once and repeated in every report.

``delta_ci95_pct`` is the 95% interval of ``delta_pct`` from the two rows' per-token NLLs on the
same tokens (`kvtool.eval.paired_delta`: batch means over blocks of 32 tokens); ``None`` with
fewer than two blocks.

Decode speed is the mean over the run (``decode_tokens_per_s``) plus the median and best
per-step rates (`kvtool.eval.speed`); progress advances per decoded token. The rows are
timed alike, so their speeds compare: every runtime (all on the runtime's backend) is
first warmed up on the same short window (prefill + `WARMUP_STEPS` decode steps, not
counted), then all rows score the same windows in the same batches *interleaved*: decode
step s runs for every row before step s + 1 (`kvtool.eval.perplexity.perplexities`), so a
change of machine load during the run slows every row alike instead of one.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvtool.capture import Progress, no_progress
from kvtool.eval.baselines import (
    BASELINE,
    is_model_dtype_cache,
    model_dtype_differs,
    model_dtype_name,
    model_dtype_recipe,
    sixteen_bit_recipe,
)
from kvtool.eval.caveats import uncompressed_note
from kvtool.eval.paired_delta import paired_delta
from kvtool.eval.perplexity import perplexities, perplexity
from kvtool.eval.speed import StepTimes, machine_load, speed_note

ROW_KEYS = ("ppl", "cache_bytes", "reserved_cache_bytes", "bits_per_element", "bytes_per_token", "decode_tokens_per_s",
            "held_fraction_mean")
WARMUP_STEPS = 4  # untimed decode steps per runtime before its row (first-call allocations, lazy imports)


def perplexity_report(model, windows: torch.Tensor, runtime, **options) -> dict:
    """JSON-able report for windows (N, T): the runtime's row, and with ``baseline`` the 16-bit and model-dtype rows.

    ``options``: those of `perplexity_reports` (prefill, chunk, batch_size, baseline, progress, make_runtime).
    """
    return perplexity_reports(model, windows, [runtime], **options)[0]


def perplexity_reports(
    model,
    windows: torch.Tensor,
    runtimes: list,
    *,
    prefill: int,
    chunk: int = 1,
    batch_size: int = 4,
    baseline: bool = True,
    model_dtype: bool = True,
    progress: Progress = no_progress,
    make_runtime: Callable | None = None,
) -> list[dict]:
    """One report per runtime (`perplexity_report`), all scored in one interleaved pass beside one shared baseline pass.

    make_runtime(recipe) builds the baselines' runtimes (default: `CompressedRuntime.from_recipe` on the first
    runtime's backend).

    Every report is complete on its own (the same keys as `perplexity_report`'s, the baseline rows repeated in each),
    and the deltas are paired over the same tokens: comparing N recipes costs N + 2 passes instead of 3 N. The
    baselines run on the first runtime's backend. ``model_dtype=False`` leaves the model-dtype row out (one pass
    fewer; the deltas are against the 16-bit cache either way).
    """
    if not runtimes:
        raise ValueError("perplexity_reports needs at least one runtime")
    first = runtimes[0]
    if make_runtime is None:
        from kvtool.runtime.attach import CompressedRuntime

        make_runtime = lambda recipe: CompressedRuntime.from_recipe(model, recipe, backend=first.backend)  # noqa: E731
    rows = [("", runtime) for runtime in runtimes]
    if baseline:
        rows.append(("baseline_", make_runtime(sixteen_bit_recipe())))
        if model_dtype and model_dtype_differs(model) and not all(is_model_dtype_cache(runtime.recipe) for runtime in runtimes):
            rows.append(("model_dtype_", make_runtime(model_dtype_recipe(model))))
    settings = {"prefill": prefill, "chunk": chunk, "batch_size": batch_size}
    for _, row_runtime in rows:
        _warm_up(model, windows, row_runtime, settings)
    times = [StepTimes() for _ in rows]
    results = _score(model, windows, [row_runtime for _, row_runtime in rows], times, progress, settings)
    shared = {}  # the baseline rows' keys, the same in every report
    for (prefix, _), result, steps in list(zip(rows, results, times))[len(runtimes):]:
        result = result.to_dict()
        shared.update({prefix + key: result[key] for key in ROW_KEYS})
        shared.update(steps.summary(prefix))
    reports = []
    baseline_results = results[len(runtimes):]
    for i, runtime in enumerate(runtimes):
        report = {"backend": runtime.backend, **results[i].to_dict(), **times[i].summary(""), **shared}
        if "model_dtype_ppl" in report and is_model_dtype_cache(runtime.recipe):
            report = {key: value for key, value in report.items() if not key.startswith("model_dtype_")}
        row_times = [times[i], *times[len(runtimes):]]
        reports.append({**report, **_relative(report, model, [results[i], *baseline_results]),
                        **_notes(report, runtime, windows, row_times)})
    return reports


def _warm_up(model, windows: torch.Tensor, runtime, settings: dict) -> None:
    """Prefill and `WARMUP_STEPS` decode steps of the first batch through a fresh cache, untimed and unscored."""
    prefill, chunk = settings["prefill"], settings["chunk"]
    length = min(windows.shape[1], prefill + WARMUP_STEPS * chunk + 1)
    perplexity(model, windows[: settings["batch_size"], :length], runtime.new_cache, prefill=min(prefill, length - 2),
               chunk=chunk, batch_size=settings["batch_size"])


def _score(model, windows, runtimes: list, times: list[StepTimes], progress: Progress, settings: dict):
    """One interleaved perplexity pass of every runtime, with a progress bar that advances per decoded token."""
    total = len(runtimes) * windows.shape[0] * (windows.shape[1] - 1 - settings["prefill"])
    names = " vs ".join(runtime.recipe.name for runtime in runtimes)
    bar = iter(progress(range(total), f"{names}: scoring while decoding", total))

    def on_step_of(steps: StepTimes):
        def on_step(tokens: int, seconds: float) -> None:
            steps.add(tokens, seconds)
            for _ in range(tokens):
                next(bar, None)

        return on_step

    try:
        return perplexities(model, windows, [runtime.new_cache for runtime in runtimes],
                            on_steps=[on_step_of(steps) for steps in times], **settings)
    finally:
        for _ in bar:  # finish (and close) the bar
            pass


def _relative(report: dict, model, results: list) -> dict:
    """The baseline's name, and the compressed row (and model-dtype row) relative to it: ``delta_pct`` and its
    interval paired over the same tokens (``results``: the compressed row, then the baseline rows, if any)."""
    out = {"baseline": BASELINE, "compression_ratio": report["fp16_cache_bytes"] / report["cache_bytes"]}
    if len(results) > 1:
        out.update(paired_delta(results[1].token_nll, results[0].token_nll).to_dict())
    if "model_dtype_ppl" in report:
        out["model_dtype"] = model_dtype_name(model)
        out["model_dtype_delta_pct"] = 100 * (report["model_dtype_ppl"] / report["baseline_ppl"] - 1)
    return out


def _notes(report: dict, runtime, windows: torch.Tensor, times: list[StepTimes]) -> dict:
    load = machine_load()
    notes = {"machine": load}
    compressed = uncompressed_note(runtime.recipe, windows.shape[1] - 1, report.get("kept_fraction"))
    if compressed:
        notes["note"] = compressed
    speed = speed_note(times, load)
    if speed:
        notes["speed_note"] = speed
    return notes
