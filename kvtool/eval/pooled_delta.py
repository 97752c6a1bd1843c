"""One perplexity delta from several `kvtool eval ppl` reports of the same recipe on disjoint sets of windows.

A report's paired interval (`kvtool.eval.paired_delta`) is over its own windows. Eight windows of 2K tokens give
an interval about +-0.8 points wide on Gemma-3-270M: a target such as "<= +3%" is often met as a point estimate and
not resolved. More windows narrow it, but a run is one process per set (the data spec's fraction ``file[a:b]``
chooses where its sequential windows start), so the sets are pooled afterwards, here.

The sets are independent strata: set i has mean per-token NLL difference ``m_i`` (nats, ``log1p(delta_i)``) over
``n_i`` scored tokens and standard error ``se_i`` (recovered from its 95% interval: ``(log1p(high) - log1p(low)) /
(2 z)``, exactly what `paired_delta` computed from its blocks). The pooled mean is the token-weighted mean
``sum(n_i m_i) / N``, the mean difference over all N scored tokens, and its standard error ``sqrt(sum((n_i se_i)^2))
/ N`` (the stratified batch-means error: each set's blocks around its own mean). The interval is normal at 95%,
mapped through ``exp`` like a single report's.

Refused (`RuntimeConfigError`, naming the fix): fewer than two sets, a set without an interval (run without
``--no-baseline`` and with two or more blocks), sets of different protocols (seq_len, prefill, chunk, model), and
sets that share a window (the same windows twice are not independent evidence). Reports carry a hash per window
(``window_ids``); where one lacks them (written before they were added) the sets are told apart by where their data
slice starts, which catches one slice given twice but not two overlapping slices that start apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import RuntimeConfigError
from kvtool.eval.paired_delta import Z_95

PROTOCOL_KEYS = ("seq_len", "prefill", "chunk")  # every set of one recipe must share these
NEEDED_KEYS = ("recipe", "delta_pct", "delta_ci95_pct", "scored_tokens", "windows", "cache_bytes", "fp16_cache_bytes",
               "ppl", "baseline_ppl", *PROTOCOL_KEYS)


@dataclass(frozen=True)
class PooledDelta:
    """A recipe's perplexity change over several disjoint sets of windows, in percent, with its 95% interval."""

    recipe: str
    delta_pct: float
    low_pct: float
    high_pct: float
    sets: int
    windows: int
    scored_tokens: int
    end_fraction: float  # bytes held at the end over the 16-bit cache's, summed over the sets
    held_fraction_mean: float | None  # bytes held over the 16-bit cache's, mean of the steps, token-weighted (None: a
    # report from before it was measured)
    ppl: float  # token-weighted geometric mean over the sets
    baseline_ppl: float
    set_deltas: tuple[tuple[str, int, float, float, float], ...]  # (data, windows, delta, low, high) per set, as given

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "delta_pct": self.delta_pct, "delta_ci95_pct": [self.low_pct, self.high_pct],
                "sets": self.sets, "windows": self.windows, "scored_tokens": self.scored_tokens,
                "end_fraction": self.end_fraction, "held_fraction_mean": self.held_fraction_mean, "ppl": self.ppl,
                "baseline_ppl": self.baseline_ppl,
                "set_deltas": [{"data": d, "windows": n, "delta_pct": x, "delta_ci95_pct": [lo, hi]}
                               for d, n, x, lo, hi in self.set_deltas]}


def report_rows(report: dict | list, source: str) -> list[dict]:
    """The per-recipe reports in one `kvtool eval ppl --json` file (a dict, or a list for several recipes)."""
    rows = report if isinstance(report, list) else [report]
    if not rows or not all(isinstance(row, dict) for row in rows):
        raise RuntimeConfigError(f"{source} is not a `kvtool eval ppl --json` report: expected an object or a list of objects")
    for row in rows:
        missing = [key for key in NEEDED_KEYS if key not in row]
        if missing:
            raise RuntimeConfigError(f"{source} lacks {', '.join(missing)}: pool reports written by `kvtool eval ppl --json` "
                                     "with the baseline (the default; not --no-baseline)")
        if not row["delta_ci95_pct"]:
            raise RuntimeConfigError(f"{source} ({row['recipe']}) has no interval (one block of scored tokens): "
                                     "score more tokens per set (--samples, --seq-len)")
    return rows


def _data_label(row: dict) -> str:
    data = row.get("data") or {}
    if not isinstance(data, dict):
        return str(data)
    source = Path(str(data.get("source", "?"))).name
    start, end = data.get("start", 0.0), data.get("end", 1.0)
    return source if (start, end) == (0.0, 1.0) else f"{source}[{start:g}:{end:g}]"


def _model_name(row: dict) -> str | None:
    model = row.get("model")
    return None if model is None else Path(str(model).rstrip("/")).name


def _check_disjoint(rows: list[dict], sources: list[str]) -> None:
    """No window in two sets: by the windows' token hashes where the reports have them, else by where they start."""
    seen: dict[str, str] = {}
    hashed = all(row.get("window_ids") for row in rows)  # one report without them: every set by where it starts
    for row, source in zip(rows, sources):
        data = row.get("data") or {}
        start = f"start:{data.get('source')}:{data.get('start', 0.0)}" if isinstance(data, dict) else str(data)
        for key in row["window_ids"] if hashed else [start]:
            if key in seen:
                raise RuntimeConfigError(f"{seen[key]} and {source} ({row['recipe']}) score the same windows: pool disjoint sets, "
                                         "e.g. -d file.txt[0:1], file.txt[0.25:1], file.txt[0.5:1] (sequential windows from "
                                         "where each slice starts)")
            seen[key] = source


def pool_intervals(sets: list[tuple[float, float, float, int]]) -> tuple[float, float, float]:
    """(delta %, low %, high %) pooled from disjoint sets' (delta %, low %, high %, scored tokens): the module's
    stratified formula, for figures recorded without their reports (e.g. in `benchmarks/RESULTS.md`)."""
    if len(sets) < 2 or any(n < 1 or not low <= delta <= high for delta, low, high, n in sets):
        raise RuntimeConfigError("pool_intervals needs two or more sets of (delta, low <= delta <= high, tokens >= 1)")
    total = sum(n for *_, n in sets)
    mean = sum(n * math.log1p(delta / 100) for delta, _, _, n in sets) / total  # nats per scored token
    errors = [(math.log1p(high / 100) - math.log1p(low / 100)) / (2 * Z_95) for _, low, high, _ in sets]
    se = math.sqrt(sum((n * e) ** 2 for (*_, n), e in zip(sets, errors))) / total
    percent = lambda nats: 100 * math.expm1(nats)  # noqa: E731
    return percent(mean), percent(mean - Z_95 * se), percent(mean + Z_95 * se)


def pool_rows(rows: list[dict], sources: list[str]) -> PooledDelta:
    """Pool one recipe's reports (``sources``: where each came from, for errors) into one delta and interval."""
    if len(rows) < 2:
        raise RuntimeConfigError(f"{rows[0]['recipe'] if rows else 'the recipe'}: pooling needs two or more sets of "
                                 f"windows (got {len(rows)}): run `kvtool eval ppl` on another slice of the data")
    recipe = rows[0]["recipe"]
    for key in PROTOCOL_KEYS:
        values = {row[key] for row in rows}
        if len(values) > 1:
            raise RuntimeConfigError(f"{recipe}: the sets differ in {key} ({sorted(values)}): pool reports of one protocol")
    models = {_model_name(row) for row in rows} - {None}
    if len(models) > 1:
        raise RuntimeConfigError(f"{recipe}: the sets come from different models ({sorted(models)}): pool one model's reports")
    _check_disjoint(rows, sources)
    tokens = [int(row["scored_tokens"]) for row in rows]
    total = sum(tokens)
    delta, low, high = pool_intervals([(row["delta_pct"], *row["delta_ci95_pct"], n) for row, n in zip(rows, tokens)])
    geometric = lambda key: math.exp(sum(n * math.log(row[key]) for n, row in zip(tokens, rows)) / total)  # noqa: E731
    return PooledDelta(
        recipe=recipe, delta_pct=delta, low_pct=low, high_pct=high,
        sets=len(rows), windows=sum(int(row["windows"]) for row in rows), scored_tokens=total,
        end_fraction=sum(row["cache_bytes"] for row in rows) / sum(row["fp16_cache_bytes"] for row in rows),
        held_fraction_mean=None if any(row.get("held_fraction_mean") is None for row in rows)
        else sum(n * row["held_fraction_mean"] for n, row in zip(tokens, rows)) / total,
        ppl=geometric("ppl"), baseline_ppl=geometric("baseline_ppl"),
        set_deltas=tuple((_data_label(row), int(row["windows"]), row["delta_pct"], *row["delta_ci95_pct"]) for row in rows),
    )


def pool_reports(reports: list[tuple[str, dict | list]], skipped: list[str] | None = None) -> list[PooledDelta]:
    """Pool ``(source, report)`` pairs (`kvtool eval ppl --json` files, each one recipe or several) per recipe.

    Every recipe found is pooled over the files that hold it, in the order the files were given. A recipe in only
    one file is refused (nothing to pool), or, where ``skipped`` is a list, left out and named there (the files of
    a run with more recipes than the others); at least one recipe must pool.
    """
    by_recipe: dict[str, tuple[list[dict], list[str]]] = {}
    for source, report in reports:
        for row in report_rows(report, source):
            rows, sources = by_recipe.setdefault(row["recipe"], ([], []))
            rows.append(row)
            sources.append(source)
    if not by_recipe:
        raise RuntimeConfigError("no reports to pool: give two or more `kvtool eval ppl --json` files")
    if skipped is not None:
        alone = [recipe for recipe, (rows, _) in by_recipe.items() if len(rows) == 1]
        if len(alone) < len(by_recipe):
            skipped.extend(alone)
            by_recipe = {recipe: entry for recipe, entry in by_recipe.items() if recipe not in alone}
    return [pool_rows(rows, sources) for rows, sources in by_recipe.values()]


def verdict(low_pct: float, high_pct: float, target_pct: float) -> str:
    """Where an interval stands against a tolerance "delta <= target": under it, over it, or not resolved."""
    if high_pct <= target_pct:
        return "under"
    if low_pct > target_pct:
        return "over"
    return "not resolved"
