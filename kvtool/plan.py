"""`kvtool plan`: which recipe fits a cache budget at a context and batch, and what it costs in quality.

For every candidate recipe (the bundled ones by default) the plan

1. **predicts the bytes** the runtime's cache will hold at ``context`` tokens for ``batch``
   sequences (`kvtool.plan_bytes`), from the same rules the paged store and eviction follow:
   sinks and the recent window in float blocks of 16 tokens, the rest in encoded body blocks of
   ``cache.block_size`` tokens whose size comes from the recipe's own block formats
   (`BlockQuantizer.block_nbytes`, fitted ranks included), plus block tables and lengths; for
   recipes that evict, the most a stream holds between two cuts (its budget at ``context`` plus
   ``interval`` - 1 tokens), quantized when the recipe also quantizes;
2. **measures the quality**: perplexity through the real runtime on a few windows of the
   first half of ``data`` (recipes that learn from data, nuq and palu, are calibrated on
   that half first), as a delta against the uncompressed cache on the same windows;
   **per-layer bit mixes** (`kvtool.plan_mix`, on by default when two uniform candidates differ
   only in their widths, kivi-4bit and kivi-2bit): the sensitivity of groups of layers to the
   lower width is measured, and mixes lowering the least sensitive groups first join the
   candidates (``{high}+{n}x{bits}bit``: n layers at the low width, written as ``layer_overrides``);
3. keeps the candidates that fit (``budget_bytes``, or ``fp16 bytes / target_ratio``) and, when
   ``max_ppl_delta`` is given, whose delta is at most that; chooses the one with the best
   measured delta (ties: fewer bytes);
4. **checks** the choice once on held-out windows (second half of ``data``): a real perplexity
   evaluation, and the bytes the cache really holds after it prefilled half a window and decoded
   the rest (and the most it held on the way), against the prediction for that length.

Not planned (a clear error names the reason, `plan_bytes.unpredictable_reason`): FastGen and
CAKE, whose kept tokens depend on the text, budgets from a profile, AdaKV on quantized blocks.
Per-layer mixes are searched for uniform quantization only (methods that learn from data are
fitted per layer for one spec and refuse ``layer_overrides``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvtool.calibration import needs_fit
from kvtool.errors import RecipeError, RuntimeConfigError
from kvtool.models.cache_argument import with_cache
from kvtool.models.logits_argument import last_logits_only
from kvtool.plan_bytes import check_predictable, fp16_cache_bytes, predict_cache_bytes, unpredictable_reason
from kvtool.plan_mix import greedy_mixes, layer_groups, lowered, mix_pairs
from kvtool.recipe import Recipe, bundled_recipe_dir, load_recipe

def default_candidates() -> list[str]:
    """Bundled recipes whose bytes the plan can predict (`unpredictable_reason` names the others)."""
    names = sorted(p.stem for p in bundled_recipe_dir().glob("*.yaml"))
    return [name for name in names if unpredictable_reason(load_recipe(name)) is None]


@dataclass(frozen=True)
class Candidate:
    """One recipe's predicted cost and measured quality."""

    recipe: str
    predicted_bytes: int
    bits_per_element: float  # predicted bytes over a 16-bit cache's, x 16
    ppl_delta_pct: float  # measured on the search windows
    fits: bool
    chosen: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _runtime(hf_model, tokenizer, recipe: Recipe, calib_data, calib_samples: int, calib_seq_len: int, batch_size: int):
    from kvtool import api
    from kvtool.runtime.attach import CompressedRuntime

    if not needs_fit(recipe):
        return CompressedRuntime.from_recipe(hf_model, recipe)
    small = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, samples=calib_samples, seq_len=calib_seq_len))
    artifact = api.calibrate_loaded(hf_model, tokenizer, calib_data, small, batch_size=batch_size)
    return CompressedRuntime.from_artifact(hf_model, dataclasses.replace(artifact, kind="deployable"))


def plan(
    model: str | None,
    out: str | Path,
    *,
    context: int,
    batch: int = 1,
    budget_gb: float | None = None,
    target_ratio: float | None = None,
    max_ppl_delta: float | None = None,
    data: str,
    recipes: list[str] | None = None,
    samples: int = 2,
    seq_len: int = 256,
    calib_samples: int = 4,
    mix: bool | None = None,
    mix_groups: int = 4,
    batch_size: int = 4,
    load=None,
    progress=None,
    log=lambda message: None,
) -> dict:
    """Search the candidates, write ``plan.yaml`` (the chosen recipe), ``plan.json`` and ``pareto.png`` into ``out``."""
    from kvtool import api
    from kvtool.capture import no_progress
    from kvtool.eval.perplexity import perplexity
    from kvtool.fileio import atomic_write, check_output_path, write_json_atomic
    from kvtool.models.adapter import adapter_for
    from kvtool.pipeline import _split
    from kvtool.recipe import dump_recipe
    from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe

    progress = progress or no_progress
    if (budget_gb is None) == (target_ratio is None):
        raise RuntimeConfigError("give exactly one of --budget-gb (cache bytes) or --target-ratio (times smaller than 16-bit)")
    if budget_gb is not None and not budget_gb > 0:
        raise RuntimeConfigError(f"--budget-gb must be > 0, got {budget_gb}")
    if target_ratio is not None and not target_ratio > 0:
        raise RuntimeConfigError(f"--target-ratio must be > 0, got {target_ratio}")
    if context < 1 or batch < 1 or samples < 1 or seq_len < 4:
        raise RuntimeConfigError("--context, --batch and --samples must be >= 1 and --seq-len >= 4")
    out = Path(out)
    check_output_path(out / "plan.json")
    names = recipes or default_candidates()
    resolved = [load_recipe(name) for name in names]  # bad names fail before the model loads
    for recipe in resolved:
        check_predictable(recipe)
    pairs = mix_pairs(resolved) if mix is not False else []
    if mix and not pairs:
        raise RuntimeConfigError(
            "--mix needs two uniform candidates that differ only in their bits (say kivi-2bit and kivi-4bit); "
            "add them with --recipe, or leave --mix out"
        )
    if mix_groups < 2:
        raise RuntimeConfigError(f"--mix-groups must be >= 2 (layer groups whose sensitivity is measured), got {mix_groups}")
    hf_model, tokenizer = api._load(model, load or api.LoadOptions())
    adapter = adapter_for(hf_model)
    adapter_context = min(seq_len, adapter.geometry.max_positions)
    search_data, check_data = _split(data, 0.5)
    search = api._windows(tokenizer, search_data, samples, adapter_context, 0, "sequential")
    held_out = api._windows(tokenizer, check_data, samples, adapter_context, 0, "sequential")
    prefill = adapter_context // 2
    budget = budget_gb * 1e9 if budget_gb is not None else fp16_cache_bytes(adapter.geometry, context, batch) / target_ratio
    fp16 = fp16_cache_bytes(adapter.geometry, context, batch)

    def ppl(runtime, windows) -> float:
        return perplexity(hf_model, windows, runtime.new_cache, prefill=prefill, batch_size=batch_size).ppl

    baseline = CompressedRuntime.from_recipe(hf_model, uncompressed_recipe())
    base_search, base_check = ppl(baseline, search), ppl(baseline, held_out)
    runtimes = {}

    def measure(recipe: Recipe) -> Candidate:
        log(f"measuring {recipe.name}")
        runtime = _runtime(hf_model, tokenizer, recipe, search_data, calib_samples, adapter_context, batch_size)
        predicted = predict_cache_bytes(runtime, context, batch)
        delta = 100 * (ppl(runtime, search) / base_search - 1)
        runtimes[recipe.name] = runtime
        measured[recipe.name] = Candidate(recipe.name, predicted, 16 * predicted / fp16, delta, predicted <= budget)
        return measured[recipe.name]

    def alias(probe: str, recipe: Recipe) -> Candidate:  # a probe that is also a mix: measured once
        runtimes[recipe.name] = dataclasses.replace(runtimes[probe], recipe=recipe)
        return dataclasses.replace(measured[probe], recipe=recipe.name)

    measured = {}
    rows = [measure(recipe) for recipe in resolved]
    mixes = []
    for high, low in pairs:
        found, report_entry = _mix(high, low, adapter.geometry.num_layers, mix_groups, measure, alias, rows)
        rows += found
        mixes.append(report_entry)
    allowed = [c for c in rows if c.fits and (max_ppl_delta is None or c.ppl_delta_pct <= max_ppl_delta)]
    if not allowed:
        smallest = min(rows, key=lambda c: c.predicted_bytes)
        raise RecipeError(
            f"no candidate fits {budget / 1e9:.3g} GB at context {context} x batch {batch}"
            + (f" with a perplexity delta <= {max_ppl_delta}%" if max_ppl_delta is not None else "")
            + f"; the smallest is {smallest.recipe} at {smallest.predicted_bytes / 1e9:.3g} GB: raise the budget, shorten the context or allow more delta"
        )
    best = min(allowed, key=lambda c: (c.ppl_delta_pct, c.predicted_bytes))
    rows = [dataclasses.replace(c, chosen=c is best) for c in rows]
    chosen = runtimes[best.recipe]
    # the check: one real evaluation on held-out windows, and the bytes the cache really holds there
    check = {
        "ppl_delta_pct": 100 * (ppl(chosen, held_out) / base_check - 1),
        "baseline_ppl": base_check,
        "context": adapter_context,
        **dict(zip(("measured_bytes", "most_bytes_held"), bytes_while_decoding(chosen, held_out[:1], prefill))),
        "predicted_bytes": predict_cache_bytes(chosen, adapter_context, 1),
    }
    report = {
        "model": api.model_source(model),
        "context": context, "batch": batch, "budget_bytes": int(budget), "fp16_cache_bytes": fp16,
        "max_ppl_delta": max_ppl_delta, "data": {"search": search_data.describe(), "check": check_data.describe()},
        "search": {"windows": samples, "seq_len": adapter_context, "baseline_ppl": base_search},
        "chosen": best.recipe, "candidates": [c.to_dict() for c in rows], "check": check, "mixes": mixes,
        "files": {"recipe": str(out / "plan.yaml"), "json": str(out / "plan.json"), "plot": str(out / "pareto.png")},
    }
    out.mkdir(parents=True, exist_ok=True)
    chosen_recipe = chosen.recipe
    atomic_write(out / "plan.yaml", lambda tmp: Path(tmp).write_text(dump_recipe(chosen_recipe)))
    plot_pareto(rows, budget, out / "pareto.png", f"{Path(report['model']).name}: context {context} x batch {batch}")
    write_json_atomic(out / "plan.json", report)
    return report


def _mix(high: Recipe, low: Recipe, num_layers: int, groups: int, measure, alias, rows: list[Candidate]) -> tuple[list[Candidate], dict]:
    """Per-layer bit mixes between ``high`` and ``low`` (`kvtool.plan_mix`): the measured mixes, and a report entry.

    measure(recipe) -> Candidate; alias(probe name, recipe) -> Candidate: a probe measured already, renamed."""
    parts = layer_groups(num_layers, groups)
    entry = {"high": high.name, "low": low.name, "groups": [list(p) for p in parts], "added_delta_pct": [], "mixes": {}}
    if len(parts) < 2:
        return [], entry
    high_delta = next(c.ppl_delta_pct for c in rows if c.recipe == high.name)
    probes = {part: lowered(high, low, list(part), name=f"probe:{high.name}+layers{part[0]}-{part[-1]}") for part in parts}
    entry["added_delta_pct"] = [measure(probes[part]).ppl_delta_pct - high_delta for part in parts]
    found = []
    for recipe in greedy_mixes(high, low, parts, entry["added_delta_pct"]):
        layers = recipe.layer_overrides[0].layers
        found.append(alias(probes[layers].name, recipe) if layers in probes else measure(recipe))
        entry["mixes"][recipe.name] = list(layers)
    return found, entry


def bytes_while_decoding(runtime, ids: torch.Tensor, prefill: int) -> tuple[int, int]:
    """(bytes held at the end, most bytes held) of a cache that prefills ids[:, :prefill] (B, T), then decodes the rest.

    Evicting caches hold their most between two cuts, before the end; a quantizing cache holds a
    little more just before it encodes a full block of its float window than just after.
    """
    cache = runtime.new_cache()
    most = 0
    with torch.no_grad():
        for start, end in [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.shape[1])]:
            runtime.model(input_ids=ids[:, start:end], **with_cache(cache), use_cache=True, **last_logits_only(runtime.model))
            most = max(most, cache.nbytes())
    return cache.nbytes(), most


def pareto_front(rows: list[Candidate]) -> list[Candidate]:
    """Candidates no other one beats on both bytes and delta, by increasing bytes."""
    front, best_delta = [], math.inf
    for c in sorted(rows, key=lambda c: (c.predicted_bytes, c.ppl_delta_pct)):
        if c.ppl_delta_pct < best_delta:
            front.append(c)
            best_delta = c.ppl_delta_pct
    return front


def plot_pareto(rows: list[Candidate], budget: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtool.fileio import atomic_write

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = np.array([c.predicted_bytes / 2**20 for c in rows])
    ys = np.array([c.ppl_delta_pct for c in rows])
    ax.scatter(xs, ys, color=["tab:blue" if c.fits else "tab:gray" for c in rows], zorder=3)
    for c, x, y in zip(rows, xs, ys):
        ax.annotate(c.recipe, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    front = pareto_front(rows)
    ax.plot([c.predicted_bytes / 2**20 for c in front], [c.ppl_delta_pct for c in front], "--", color="tab:orange", label="Pareto front")
    chosen = [c for c in rows if c.chosen]
    if chosen:
        ax.scatter([chosen[0].predicted_bytes / 2**20], [chosen[0].ppl_delta_pct], s=160, facecolors="none",
                   edgecolors="tab:red", linewidths=2, zorder=4, label=f"chosen: {chosen[0].recipe}")
    ax.axvline(budget / 2**20, color="tab:red", linestyle=":", label="budget")
    ax.set_xlabel("predicted cache MiB")
    ax.set_ylabel("perplexity delta %")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
