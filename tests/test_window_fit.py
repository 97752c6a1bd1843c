"""`kvtool fit-windows` (`kvtool.window_fit`): per-layer shares of the sliding windows from measured costs.

Oracles: a cut of every sliding-window layer to w tokens must score exactly what transformers computes with the
model's ``sliding_window`` set to w (its own mask); the allocation must equal a brute-force search; the written
recipe must run through the runtime with each layer holding its fitted share.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from kvtool.errors import RecipeError, RuntimeConfigError
from kvtool.models.adapter import adapter_for
from kvtool.models.attention_hook import install
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import dump_recipe, load_recipe, recipe_from_dict
from kvtool.runtime.attach import CompressedRuntime
from kvtool.window_fit import _Stack, _kept, allocate, fit_window_shares, fitted_recipe
from tests.tiny_models import featured_model

LAYERS = dict(num_hidden_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"])


def second_half(model, ids):  # ids (1, T) -> (mean loss, log-probs (T/2, V)) over the second half
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    first = ids.shape[1] // 2
    log_probs = torch.log_softmax(logits[first - 1:-1], dim=-1)
    return float(torch.nn.functional.nll_loss(log_probs, ids[0, first:])), log_probs


def test_a_cut_scores_what_transformers_scores_with_that_sliding_window():
    model = featured_model("gemma3_text", sliding_window=32, **LAYERS).eval()
    ids = torch.randint(3, 100, (1, 96), generator=torch.Generator().manual_seed(0))
    install(model)
    stack = _Stack(model, adapter_for(model).layers, ids)
    full_nll, full = second_half(model, ids)
    assert stack.baseline == pytest.approx(full_nll, abs=1e-5)
    shorter = featured_model("gemma3_text", sliding_window=12, **LAYERS).eval()  # the same weights (same seed)
    short_nll, short = second_half(shorter, ids)
    nll, kl = stack.cut({0: 12, 1: 12, 2: 12})
    want_kl = float((full.exp() * (full - short)).sum(-1).mean())  # KL(uncompressed || cut) per scored token
    assert nll == pytest.approx(short_nll, abs=1e-5) and kl == pytest.approx(want_kl, rel=1e-3) and kl > 1e-3
    nll, kl = stack.cut({1: 32})  # the whole window changes nothing
    assert nll == pytest.approx(stack.baseline, abs=1e-6) and abs(kl) < 1e-6
    assert stack.cut({1: 4})[1] > 1e-4


def test_allocation_is_the_brute_force_optimum():
    generator = torch.Generator().manual_seed(3)
    options, windows = [0.125, 0.25, 0.5, 1.0], [64, 64, 128, 32]
    for trial in range(20):
        costs = torch.rand(len(windows), len(options), generator=generator) * torch.tensor([3.0, 2.0, 1.0, 0.5]) - 0.4
        budget = [60, 90, 150, 250][trial % 4]
        picked = allocate(costs, windows, options, budget)
        fixed = costs  # as measured
        kept = lambda choice: sum(_kept(options[o], w) for o, w in zip(choice, windows))  # noqa: E731
        best = min(sum(float(fixed[l, o]) for l, o in enumerate(choice))
                   for choice in itertools.product(range(len(options)), repeat=len(windows)) if kept(choice) <= budget)
        got = sum(float(fixed[l, options.index(s)]) for l, s in enumerate(picked))
        assert got == pytest.approx(best, abs=1e-9), (trial, picked)
        assert kept([options.index(s) for s in picked]) <= budget
    with pytest.raises(RuntimeConfigError, match="smallest candidate share"):
        allocate(torch.zeros(2, 1), [64, 64], [0.5], 32)


def test_fit_writes_a_recipe_whose_layers_hold_their_fitted_shares():
    model = featured_model("gemma3_text", sliding_window=32, **LAYERS).eval()
    ids = torch.randint(3, 100, (2, 96), generator=torch.Generator().manual_seed(1))
    fit = fit_window_shares(model, ids, 0.4, shares=(0.25, 0.5, 1.0))
    assert fit.layers == (0, 1, 2) and fit.windows == (32, 32, 32) and fit.shares == (0.25, 0.4, 0.5, 1.0)
    assert all(row[1] == 0.0 for row in fit.costs)  # the uniform point itself
    assert all(s in fit.shares for s in fit.fitted) and sum(_kept(s, 32) for s in fit.fitted) <= 3 * _kept(0.4, 32)
    assert math.isfinite(fit.fitted_nll) and math.isfinite(fit.uniform_nll)
    assert fit.chosen == (fit.fitted if fit.fitted_kl < fit.uniform_kl else (0.4,) * 3)
    base = load_recipe("kivi-4bit")
    written = fitted_recipe(base, fit, adapter_for(model).geometry.sliding_windows, name="fitted")
    again = recipe_from_dict(__import__("yaml").safe_load(dump_recipe(written)))
    assert again == written and again.keys == base.keys and again.eviction.policy == "streamingllm"
    assert again.eviction.budget == 1.0
    assert [again.for_layer(i).eviction.sliding_budget for i in fit.layers] == list(fit.chosen)
    runtime = CompressedRuntime.from_recipe(model, again)
    cache = runtime.new_cache()
    with torch.no_grad():
        model(input_ids=ids[:, :80], **with_cache(cache), use_cache=True)
    for index, share in zip(fit.layers, fit.chosen):
        assert int(cache.layers[index].store.tokens().max()) <= max(_kept(share, 32) + 15, 32 + 31), index
    assert int(cache.layers[3].store.tokens().max()) == 80  # the global layer keeps everything

    with pytest.raises(RecipeError, match="evicts with h2o"):
        fitted_recipe(load_recipe("h2o"), fit, adapter_for(model).geometry.sliding_windows)
    with pytest.raises(RecipeError, match="already sets sliding-window shares"):
        fitted_recipe(load_recipe("turboquant-local"), fit, adapter_for(model).geometry.sliding_windows)


def test_keys_and_values_overrides_are_kept_and_split_by_share():
    from kvtool.window_fit import WindowFit

    fit = WindowFit(layers=(0, 1, 2), windows=(32,) * 3, shares=(0.25,), costs=((0.0,),) * 3, nll_deltas=((0.0,),) * 3,
                    fitted=(0.25, 1.0, 0.25), mean_share=0.5, baseline_nll=1.0, fitted_nll=1.0, uniform_nll=1.0,
                    fitted_kl=0.1, uniform_kl=0.2, scored_tokens=10)
    raw = load_recipe("kivi-4bit").to_dict()
    raw["layer_overrides"] = [{"layers": "sliding", "keys": {"bits": 2}}]
    written = fitted_recipe(recipe_from_dict(raw), fit, (32, 32, 32, None))
    assert written.eviction.sliding_budget == 0.25
    assert [(o.layers, o.fields("keys"), o.fields("eviction")) for o in written.layer_overrides] == [
        ((0, 2), {"bits": 2}, {}), ((1,), {"bits": 2}, {"sliding_budget": 1.0})]
    lost = dataclasses.replace(fit, fitted_kl=0.3)  # the fitted shares lost the joint check: one share everywhere
    written = fitted_recipe(recipe_from_dict(raw), lost, (32, 32, 32, None))
    assert written.eviction.sliding_budget == 0.5 and [o.fields("eviction") for o in written.layer_overrides] == [{}]


def test_models_without_sliding_windows_and_short_windows_are_refused():
    llama = featured_model("llama").eval()
    ids = torch.randint(3, 100, (1, 64), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeConfigError, match="no sliding-window layers"):
        fit_window_shares(llama, ids, 0.3)
    gemma = featured_model("gemma3_text", sliding_window=64, **LAYERS).eval()
    with pytest.raises(RuntimeConfigError, match="--seq-len of at least 128"):
        fit_window_shares(gemma, ids[:, :100], 0.3)
    with pytest.raises(RuntimeConfigError, match="--mean-share must be in"):
        fit_window_shares(gemma, ids, 1.0)


def test_cli_refuses_a_model_without_sliding_windows_without_a_traceback(tmp_path):
    from typer.testing import CliRunner

    from kvtool.cli import app
    from tests.conftest import shared_path

    out = tmp_path / "fitted.yaml"
    result = CliRunner().invoke(app, ["fit-windows", "-d", str(shared_path("data/text/tinyshakespeare_input.txt")) + "[0:0.05]",
                                      "-o", str(out), "--seq-len", "128", "--samples", "1"])
    assert result.exit_code != 0 and "no sliding-window layers" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()
    result = CliRunner().invoke(app, ["fit-windows", "-r", "h2o", "-d", str(shared_path("data/text/tinyshakespeare_input.txt")),
                                      "-o", str(out)])
    assert result.exit_code != 0 and "evicts with h2o" in result.stderr and not out.exists()


def test_cli_fits_a_tiny_gemma3_and_writes_a_recipe_that_loads(tmp_path):
    import json
    import shutil

    from typer.testing import CliRunner

    from kvtool.cli import app
    from kvtool.recipe import load_recipe as load
    from tests.conftest import shared_path

    kvref = shared_path("models/kvref-5m")
    folder = tmp_path / "tiny-gemma3"
    featured_model("gemma3_text", sliding_window=32, vocab_size=4096, **LAYERS).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(kvref / name, folder / name)
    out, report = tmp_path / "fitted.yaml", tmp_path / "fit.json"
    result = CliRunner().invoke(app, ["fit-windows", "-m", str(folder), "-r", "kivi-4bit", "-d",
                                      str(shared_path("data/text/tinyshakespeare_input.txt")) + "[0:0.05]", "-o", str(out),
                                      "--seq-len", "96", "--samples", "1", "--shares", "0.25,0.5", "--mean-share", "0.5",
                                      "--json", str(report)])
    assert result.exit_code == 0, result.stderr
    assert "fitted share" in result.stdout and "0.5 on every layer" in result.stdout
    written = load(out)
    assert written.name == "kivi-4bit-fitted-windows" and written.keys == load("kivi-4bit").keys
    fitted = json.loads(report.read_text())
    assert [row["layer"] for row in fitted["layers"]] == [0, 1, 2] and fitted["held_share"] <= 0.5
    assert [written.for_layer(row["layer"]).eviction.sliding_budget for row in fitted["layers"]] == \
        [row["share"] for row in fitted["layers"]]
    bad = CliRunner().invoke(app, ["fit-windows", "-m", str(folder), "-d", str(shared_path("data/text/tinyshakespeare_input.txt")),
                                   "-o", str(tmp_path / "x.yaml"), "--shares", "0.25,x"])
    assert bad.exit_code != 0 and "--shares takes comma-separated fractions" in bad.stderr
