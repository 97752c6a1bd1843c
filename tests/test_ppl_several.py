"""`kvtool eval ppl` with several caches: one interleaved pass beside one baseline pass gives each cache the report it
would get alone (same perplexity, bytes and paired delta), in a list, and the CLI shows one column per cache."""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.errors import RuntimeConfigError
from kvtool.recipe import load_recipe
from tests.test_cli import assert_friendly_error, fake_report, invoke, ok, shows, stories, stories_data
from tests.tiny_models import tiny_model

PER_ROW = ("ppl", "nll", "scored_tokens", "cache_bytes", "bits_per_element", "bytes_per_token", "kept_fraction",
           "delta_pct", "delta_ci95_pct", "baseline_ppl", "baseline_cache_bytes", "model_dtype_ppl")


def test_several_runtimes_get_the_reports_they_get_alone():
    from kvtool.eval.ppl_report import perplexity_report, perplexity_reports
    from kvtool.runtime.attach import CompressedRuntime

    model = tiny_model("llama")
    windows = torch.randint(3, 128, (2, 120), generator=torch.Generator().manual_seed(0))
    runtimes = [CompressedRuntime.from_recipe(model, load_recipe(name), backend="torch") for name in ("kivi-2bit", "h2o")]
    together = perplexity_reports(model, windows, runtimes, prefill=50, batch_size=2)
    assert len(together) == 2
    for runtime, report in zip(runtimes, together):
        alone = perplexity_report(model, windows, runtime, prefill=50, batch_size=2)
        for key in PER_ROW:
            assert report.get(key) == pytest.approx(alone.get(key), rel=1e-6), (runtime.recipe.name, key)
    assert together[0]["ppl"] != together[1]["ppl"]  # the rows are the recipes' own, not one repeated
    assert together[1]["kept_fraction"] < 1.0 and together[0].get("kept_fraction", 1.0) == 1.0
    assert len({report["baseline_ppl"] for report in together}) == 1  # one baseline pass, shared


def test_the_model_dtype_row_is_left_out_of_a_model_dtype_cache_only():
    from kvtool.eval.baselines import model_dtype_recipe
    from kvtool.eval.ppl_report import perplexity_reports
    from kvtool.runtime.attach import CompressedRuntime

    model = tiny_model("llama")  # float32: the model-dtype row differs from the 16-bit baseline
    windows = torch.randint(3, 128, (2, 80), generator=torch.Generator().manual_seed(1))
    runtimes = [CompressedRuntime.from_recipe(model, model_dtype_recipe(model), backend="torch"),
                CompressedRuntime.from_recipe(model, load_recipe("kivi-4bit"), backend="torch")]
    as_dtype, kivi = perplexity_reports(model, windows, runtimes, prefill=40, batch_size=2)
    assert "model_dtype_ppl" not in as_dtype and "model_dtype_ppl" in kivi
    assert as_dtype["ppl"] == pytest.approx(kivi["model_dtype_ppl"], rel=1e-6)  # the same cache, scored twice


def test_api_takes_a_list_of_recipes_and_refuses_an_empty_one():
    from kvtool import api

    reports = api.evaluate_perplexity(stories_data(), stories(), None, ["kivi-2bit", "kivi-4bit"], samples=1,
                                      seq_len=160, batch_size=1, backend="torch")
    assert [r["recipe"] for r in reports] == ["kivi-2bit", "kivi-4bit"]
    assert reports[0]["data"] == reports[1]["data"] and reports[0]["baseline_ppl"] == reports[1]["baseline_ppl"]
    assert reports[0]["bits_per_element"] < reports[1]["bits_per_element"]
    with pytest.raises(RuntimeConfigError, match="at least one --recipe"):
        api.evaluate_perplexity(stories_data(), stories(), None, [], samples=1, seq_len=96)


def test_cli_repeated_recipe_shows_one_column_each_and_writes_a_list(tmp_path):
    out = tmp_path / "several.json"
    result = invoke("eval", "ppl", "-d", stories_data(), "-m", stories(), "-r", "kivi-2bit", "-r", "h2o", "--samples", 1, "--seq-len", 96,
                    "--batch-size", 1, "--backend", "torch", "--json", out)
    ok(result)
    assert shows(result.stdout, "(baseline)", "h2o", "kept") and "windows x 96 tokens" in result.stdout  # narrow columns wrap
    reports = json.loads(out.read_text())
    assert [r["recipe"] for r in reports] == ["kivi-2bit", "h2o"]
    assert reports[1]["kept_fraction"] < 1.0


def test_cli_repeated_recipe_refuses_a_bad_one_before_loading(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Some text to read.\n")
    assert_friendly_error(invoke("eval", "ppl", "-d", text, "-r", "kivi-2bit", "-r", "no-such-recipe"), "no-such-recipe")


def test_no_model_dtype_row_scores_one_pass_fewer_and_changes_no_delta():
    from kvtool.eval.ppl_report import perplexity_reports
    from kvtool.runtime.attach import CompressedRuntime

    model = tiny_model("llama")  # float32: the model-dtype row is there by default
    windows = torch.randint(3, 128, (2, 80), generator=torch.Generator().manual_seed(2))
    runtime = CompressedRuntime.from_recipe(model, load_recipe("kivi-2bit"), backend="torch")
    both = perplexity_reports(model, windows, [runtime], prefill=40, batch_size=2)[0]
    lean = perplexity_reports(model, windows, [runtime], prefill=40, batch_size=2, model_dtype=False)[0]
    assert "model_dtype_ppl" in both and not any(key.startswith("model_dtype") for key in lean)
    for key in ("ppl", "baseline_ppl", "delta_pct", "delta_ci95_pct", "cache_bytes"):
        assert lean[key] == pytest.approx(both[key], rel=1e-9), key


def test_cli_passes_no_model_dtype_row(monkeypatch):
    from kvtool import api

    seen = {}
    monkeypatch.setattr(api, "evaluate_perplexity", lambda *args, **kwargs: seen.update(kwargs) or fake_report())
    ok(invoke("eval", "ppl", "-d", stories_data(), "--no-model-dtype-row"))
    assert seen["model_dtype"] is False
