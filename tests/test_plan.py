"""`kvtool plan`: predicted cache bytes equal what the runtime holds; the search picks within the budget.

The bytes oracle is the real cache after a prefill (`KvtoolCache.nbytes`), for every bundled
recipe the plan predicts (calibrated ones on kvref-5m), several contexts and batches.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.calibration import needs_fit
from kvtool.errors import RecipeError, RuntimeConfigError
from kvtool.plan import Candidate, default_candidates, pareto_front, plan, predict_cache_bytes
from kvtool.recipe import load_recipe
from kvtool.runtime.attach import CompressedRuntime
from tests.conftest import shared_path
from tests.tiny_models import featured_model, tiny_model


def data() -> str:
    return f"{shared_path('data/text/wikitext2_valid.txt')}[0:0.2]"


def held_bytes(runtime, context: int, batch: int) -> int:
    cache = runtime.new_cache()
    ids = torch.randint(3, 100, (batch, context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        runtime.model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache.nbytes()


UNFITTED = [name for name in default_candidates() if not needs_fit(load_recipe(name))]


@pytest.mark.parametrize("name", UNFITTED)
@pytest.mark.parametrize("context,batch", [(37, 1), (200, 3)])
def test_predicted_bytes_match_the_runtime(name, context, batch):
    model = tiny_model("llama")
    runtime = CompressedRuntime.from_recipe(model, load_recipe(name))
    predicted, held = predict_cache_bytes(runtime, context, batch), held_bytes(runtime, context, batch)
    assert abs(predicted - held) <= 0.02 * held, (predicted, held)


@pytest.mark.parametrize("name", ["uncompressed", "kivi-4bit", "kivi-2bit"])
@pytest.mark.parametrize("family", ["gemma3_text", "mistral"])
def test_predicted_bytes_match_the_runtime_with_sliding_window_layers(family, name):
    model = featured_model(family)
    runtime = CompressedRuntime.from_recipe(model, load_recipe(name))
    assert any(w is not None for w in runtime.adapter.geometry.sliding_windows)
    for context, batch in [(10, 2), (200, 2)]:  # inside and far beyond the windows
        predicted, held = predict_cache_bytes(runtime, context, batch), held_bytes(runtime, context, batch)
        assert abs(predicted - held) <= 0.02 * held, (context, batch, predicted, held)


@pytest.mark.parametrize("name", ["kvquant-3bit-1pct", "palu-30", "palu-30-3bit"])
def test_predicted_bytes_match_the_runtime_for_fitted_recipes(kvref, name):
    model, tokenizer = kvref
    recipe = load_recipe(name)
    from kvtool.plan import _runtime

    runtime = _runtime(model, tokenizer, recipe, data(), calib_samples=2, calib_seq_len=64, batch_size=2)
    for context, batch in [(150, 2), (300, 1)]:
        predicted, held = predict_cache_bytes(runtime, context, batch), held_bytes(runtime, context, batch)
        assert abs(predicted - held) <= 0.02 * held, (context, batch, predicted, held)


def test_evicting_recipes_are_refused_with_a_reason(tmp_path):
    with pytest.raises(RecipeError, match="evicts tokens"):
        plan(None, tmp_path, context=64, budget_gb=1.0, data=data(), recipes=["h2o"])
    with pytest.raises(RuntimeConfigError, match="exactly one of"):
        plan(None, tmp_path, context=64, data=data())


def test_pareto_front_keeps_the_undominated():
    rows = [Candidate("a", 10, 1, 5.0, True), Candidate("b", 20, 2, 1.0, True), Candidate("c", 30, 3, 2.0, True),
            Candidate("d", 5, 1, 9.0, True)]
    assert [c.recipe for c in pareto_front(rows)] == ["d", "a", "b"]


def test_plan_chooses_the_best_fitting_recipe_and_checks_it(kvref, tmp_path):
    model = str(shared_path("models/kvref-5m"))
    recipes = ["kivi-2bit", "kivi-4bit", "int8", "uncompressed"]
    report = plan(model, tmp_path / "p", context=512, batch=2, target_ratio=2.0, data=data(), recipes=recipes,
                  samples=1, seq_len=96)
    fp16 = report["fp16_cache_bytes"]
    rows = {c["recipe"]: c for c in report["candidates"]}
    assert not rows["uncompressed"]["fits"] and not rows["int8"]["fits"]  # int8 is ~1.5x smaller at 512 tokens (float window), not 2x
    assert rows["kivi-4bit"]["fits"] and rows["kivi-2bit"]["fits"]
    fitting = [c for c in report["candidates"] if c["fits"]]
    best = min(fitting, key=lambda c: c["ppl_delta_pct"])
    assert report["chosen"] == best["recipe"] and rows[best["recipe"]]["predicted_bytes"] <= fp16 / 2
    check = report["check"]
    assert abs(check["predicted_bytes"] - check["measured_bytes"]) <= 0.02 * check["measured_bytes"]
    assert load_recipe(tmp_path / "p/plan.yaml").name == report["chosen"]
    assert (tmp_path / "p/pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "p/plan.json").read_text())["chosen"] == report["chosen"]
    with pytest.raises(RecipeError, match="no candidate fits"):
        plan(model, tmp_path / "q", context=512, batch=2, target_ratio=100.0, data=data(), recipes=recipes[:2],
             samples=1, seq_len=96)
