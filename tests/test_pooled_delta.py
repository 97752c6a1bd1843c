"""Pooling `kvtool eval ppl` reports of disjoint windows into one delta (`kvtool.eval.pooled_delta`, `kvtool eval pool`)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvtool.errors import RuntimeConfigError
from kvtool.eval.paired_delta import BLOCK_TOKENS, Z_95, paired_delta
from kvtool.eval.pooled_delta import pool_reports, pool_rows
from tests.test_cli import assert_friendly_error, invoke, ok, shows
from tests.test_paired_delta import _correlated_differences


def _report(base: torch.Tensor, other: torch.Tensor, start: float, recipe: str = "r", **overrides) -> dict:
    """A report as `kvtool eval ppl --json` writes it, from per-token NLLs (windows, tokens) of the two caches."""
    delta = paired_delta(base, other)
    windows, tokens = base.shape
    report = {
        "recipe": recipe, "model": "/models/gemma3-270m", "data": {"source": "/d/wiki.txt", "start": start, "end": 1.0},
        "window_ids": [f"{start}-{i}" for i in range(windows)], "windows": windows, "seq_len": tokens + 101,
        "prefill": 100, "chunk": 1, "scored_tokens": base.numel(), "ppl": math.exp(other.double().mean()),
        "baseline_ppl": math.exp(base.double().mean()), "cache_bytes": 200 * windows, "fp16_cache_bytes": 1000 * windows,
        "held_fraction_mean": 0.21, **delta.to_dict(),
    }
    report.update(overrides)
    return report


def _sets(count: int, windows: int = 4, tokens: int = 256, shift: float = 0.02, seed: int = 0):
    """``count`` sets of (base, other) NLLs whose other row is worse by ``shift`` nats plus correlated noise."""
    out = []
    for index in range(count):
        gen = torch.Generator().manual_seed(seed * 100 + index)
        base = torch.rand(windows, tokens, generator=gen, dtype=torch.float64) * 4
        out.append((base, base + shift + _correlated_differences(windows, tokens, rho=0.8, seed=seed * 100 + index)))
    return out


def test_the_pooled_delta_is_the_delta_of_every_token_and_its_error_the_stratified_one():
    sets = _sets(2, windows=3) + _sets(1, windows=5, seed=1)  # unequal sets: the pooled mean weighs by tokens
    reports = [_report(base, other, start=i / 4) for i, (base, other) in enumerate(sets)]
    pooled = pool_rows(reports, ["a", "b", "c"])
    every_base = torch.cat([base for base, _ in sets])
    every_other = torch.cat([other for _, other in sets])
    assert pooled.delta_pct == pytest.approx(paired_delta(every_base, every_other).delta_pct, rel=1e-9)
    assert pooled.scored_tokens == every_base.numel() and pooled.windows == 11 and pooled.sets == 3
    # the stratified batch-means error, computed from the blocks: each set's blocks around its own mean
    total, variance = every_base.numel(), 0.0
    for base, other in sets:
        diff = other - base
        sums = torch.stack([diff[:, s:s + BLOCK_TOKENS].sum(1) for s in range(0, diff.shape[1], BLOCK_TOKENS)], 1).flatten()
        counts = torch.tensor([min(BLOCK_TOKENS, diff.shape[1] - s) for s in range(0, diff.shape[1], BLOCK_TOKENS)],
                              dtype=torch.float64).repeat(diff.shape[0])
        residual = sums - sums.sum() / counts.sum() * counts
        variance += sums.numel() / (sums.numel() - 1) * (residual**2).sum().item()
    mean = math.log1p(pooled.delta_pct / 100)
    assert pooled.high_pct == pytest.approx(100 * math.expm1(mean + Z_95 * math.sqrt(variance) / total), rel=1e-9)
    assert pooled.low_pct == pytest.approx(100 * math.expm1(mean - Z_95 * math.sqrt(variance) / total), rel=1e-9)
    assert pooled.end_fraction == pytest.approx(0.2) and pooled.held_fraction_mean == pytest.approx(0.21)
    assert pooled.baseline_ppl == pytest.approx(math.exp(every_base.mean()), rel=1e-9)


def test_pooling_narrows_the_interval_and_still_covers_the_true_delta():
    """Four sets' pooled interval is about half as wide as one set's, and covers a true delta of 0 about 95% of the
    time under correlated per-token damage (the sets' own intervals are batch means)."""
    covered, trials = 0, 120
    for seed in range(trials):
        sets = _sets(4, windows=2, tokens=256, shift=0.0, seed=seed)
        reports = [_report(base, other, start=i / 4) for i, (base, other) in enumerate(sets)]
        pooled = pool_rows(reports, ["a", "b", "c", "d"])
        covered += pooled.low_pct <= 0.0 <= pooled.high_pct
        if seed == 0:
            widths = [r["delta_ci95_pct"][1] - r["delta_ci95_pct"][0] for r in reports]
            assert pooled.high_pct - pooled.low_pct < 0.7 * min(widths)
    assert 0.88 <= covered / trials <= 1.0


def test_pool_refuses_what_is_not_independent_evidence_of_one_protocol():
    (b1, o1), (b2, o2) = _sets(2)
    first, second = _report(b1, o1, 0.0), _report(b2, o2, 0.5)
    with pytest.raises(RuntimeConfigError, match="two or more sets"):
        pool_rows([first], ["a"])
    with pytest.raises(RuntimeConfigError, match="differ in seq_len"):
        pool_rows([first, {**second, "seq_len": 4096}], ["a", "b"])
    with pytest.raises(RuntimeConfigError, match="different models"):
        pool_rows([first, {**second, "model": "HuggingFaceTB/SmolLM2-135M-Instruct"}], ["a", "b"])
    pool_rows([first, {**second, "model": "google/gemma3-270m"}], ["a", "b"])  # the same name from another folder
    with pytest.raises(RuntimeConfigError, match="same windows"):
        pool_rows([first, {**second, "window_ids": ["x", first["window_ids"][2]]}], ["a", "b"])
    older = [{k: v for k, v in r.items() if k != "window_ids"} for r in (first, second)]  # reports from before the ids
    pool_rows(older, ["a", "b"])
    with pytest.raises(RuntimeConfigError, match="same windows"):
        pool_rows([older[0], {**older[1], "data": older[0]["data"]}], ["a", "b"])
    with pytest.raises(RuntimeConfigError, match="same windows"):  # an old and a new report of one slice
        pool_rows([older[0], {**first, "window_ids": ["new-0", "new-1"]}], ["a", "b"])
    with pytest.raises(RuntimeConfigError, match="no interval"):
        pool_reports([("a", first), ("b", {**second, "delta_ci95_pct": None})])
    with pytest.raises(RuntimeConfigError, match="lacks delta_ci95_pct"):
        pool_reports([("a", first), ("b", {k: v for k, v in second.items() if k != "delta_ci95_pct"})])
    with pytest.raises(RuntimeConfigError, match="not a `kvtool eval ppl --json` report"):
        pool_reports([("a", first), ("b", [])])


def test_a_file_of_several_recipes_pools_each_recipe_over_the_files():
    (b1, o1), (b2, o2) = _sets(2)
    one = [_report(b1, o1, 0.0, recipe="x"), _report(b1, o1 + 0.01, 0.0, recipe="y")]
    two = [_report(b2, o2, 0.5, recipe="x"), _report(b2, o2 + 0.01, 0.5, recipe="y")]
    x, y = pool_reports([("one.json", one), ("two.json", two)])
    assert (x.recipe, y.recipe) == ("x", "y")
    assert y.delta_pct == pytest.approx(100 * ((1 + x.delta_pct / 100) * math.exp(0.01) - 1), rel=1e-9)
    with pytest.raises(RuntimeConfigError, match="two or more sets"):
        pool_reports([("one.json", one), ("two.json", two[:1])])  # y is in one file only
    skipped = []
    (alone,) = pool_reports([("one.json", one), ("two.json", two[:1])], skipped)  # or left out where asked
    assert alone.recipe == "x" and skipped == ["y"]
    with pytest.raises(RuntimeConfigError, match="two or more sets"):  # nothing pools at all: refused still
        pool_reports([("one.json", one[:1])], [])


def _report_files(folder, recipe: str) -> list:
    """Two report files of ``recipe`` on disjoint sets (starts 0 and 0.5) in ``folder``."""
    files = []
    for index, (base, other) in enumerate(_sets(2)):
        files.append(folder / f"set{index}.json")
        files[-1].write_text(json.dumps(_report(base, other, index / 2, recipe=recipe)))
    return files


def test_cli_eval_pool_shows_each_set_and_the_pooled_interval(tmp_path):
    files = _report_files(tmp_path, "tq-3.5")
    out = tmp_path / "pooled.json"
    result = invoke("eval", "pool", *files, "--json", out)
    ok(result)
    pooled = json.loads(out.read_text())
    assert [row["recipe"] for row in pooled] == ["tq-3.5"] and pooled[0]["sets"] == 2
    low, high = pooled[0]["delta_ci95_pct"]
    first = pooled[0]["set_deltas"][0]
    assert shows(result.stdout, "tq-3.5: 2 sets", f"{pooled[0]['delta_pct']:+.2f}%", f"{low:+.2f} .. {high:+.2f}%",
                 "wiki.txt[0.5:1]", "21.0%", f"{first['delta_pct']:+.2f}%", "2048 scored tokens")

    truncated = tmp_path / "truncated.json"
    truncated.write_text(files[1].read_text()[:40])
    assert_friendly_error(invoke("eval", "pool", files[0], truncated), "truncated.json", "not valid JSON")
    assert_friendly_error(invoke("eval", "pool", files[0], tmp_path / "missing.json"), "missing.json", "does not exist")
    assert_friendly_error(invoke("eval", "pool", files[0], tmp_path), "is not a file")
    assert_friendly_error(invoke("eval", "pool", files[0], files[0]), "same windows")
    assert not (tmp_path / "none.json").exists()


def test_reports_of_two_slices_from_the_runtime_pool_and_one_slice_twice_does_not(tmp_path):
    """`evaluate_perplexity` names its model and hashes its windows; two slices of a text pool, one slice twice not."""
    from kvtool import api
    from kvtool.fileio import write_json_atomic
    from tests.test_cli import stories, stories_data

    source = stories_data().rsplit("[", 1)[0]
    paths = []
    for name, part in (("a", "[0:0.02]"), ("b", "[0.02:0.05]")):
        report = api.evaluate_perplexity(source + part, stories(), None, ["kivi-2bit", "kivi-4bit"], samples=2,
                                         seq_len=160, batch_size=2, backend="torch")
        assert len(report[0]["window_ids"]) == 2 and report[0]["model"] == stories()
        paths.append(tmp_path / f"{name}.json")
        write_json_atomic(paths[-1], report)
    two, four = api.pool_perplexity(paths)
    assert (two["recipe"], four["recipe"], two["windows"], two["sets"]) == ("kivi-2bit", "kivi-4bit", 4, 2)
    deltas = [each["delta_pct"] for each in two["set_deltas"]]
    assert min(deltas) <= two["delta_pct"] <= max(deltas) and two["delta_pct"] > four["delta_pct"]
    with pytest.raises(RuntimeConfigError, match="same windows"):
        api.pool_perplexity([paths[0], paths[0]])


def test_a_target_reads_each_pooled_interval_and_the_plot_shows_it(tmp_path):
    from kvtool.eval.pooled_delta import verdict

    assert verdict(1.0, 2.9, 3.0) == "under" and verdict(3.1, 4.0, 3.0) == "over" and verdict(2.0, 3.2, 3.0) == "not resolved"
    assert verdict(-1.0, 3.0, 3.0) == "under"  # "<= target": an upper end at the target meets it
    files = _report_files(tmp_path, "tq")
    plot = tmp_path / "forest.png"
    result = invoke("eval", "pool", *files, "--target", 3, "--plot", plot, "--json", tmp_path / "p.json")
    ok(result)
    row = json.loads((tmp_path / "p.json").read_text())[0]
    assert row["target_pct"] == 3 and row["verdict"] == verdict(*row["delta_ci95_pct"], 3.0) == "under"
    assert shows(result.stdout, "<= +3%?", "yes") and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    high = json.loads(invoke("eval", "pool", *files, "--target", 1, "--json", tmp_path / "q.json").stdout and
                      (tmp_path / "q.json").read_text())[0]
    assert high["verdict"] == "over" and high["delta_ci95_pct"][0] > 1
    assert_friendly_error(invoke("eval", "pool", *files, "--plot", tmp_path / "f.jpg"), "PNG", "f.jpg")
    assert_friendly_error(invoke("eval", "pool", *files, "--target", "nan"), "--target nan")
    assert not (tmp_path / "f.jpg").exists()


def test_recorded_intervals_pool_as_their_reports_do():
    from kvtool.eval.pooled_delta import pool_intervals

    sets = _sets(3)
    reports = [_report(base, other, start=i / 4) for i, (base, other) in enumerate(sets)]
    pooled = pool_rows(reports, ["a", "b", "c"])
    recorded = [(r["delta_pct"], *r["delta_ci95_pct"], r["scored_tokens"]) for r in reports]
    assert pool_intervals(recorded) == pytest.approx((pooled.delta_pct, pooled.low_pct, pooled.high_pct), rel=1e-12)
    with pytest.raises(RuntimeConfigError, match="two or more sets"):
        pool_intervals(recorded[:1])
    with pytest.raises(RuntimeConfigError, match="low <= delta <= high"):
        pool_intervals([(1.0, 2.0, 3.0, 10), recorded[0]])
