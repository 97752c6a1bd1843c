"""Pass-key retrieval floors of every bundled eviction recipe at 50% kept, on SmolLM2-135M.

A pass key ("The pass key is 41235. Remember it. ...") hidden at depth d of 512 tokens of
held-out WikiText-2 test, asked for at the end ("What is the pass key? The pass key is");
exact match of the digits, greedy decoding through the runtime (`kvtool.eval.retrieval`).
Depths 0, 0.5 and 1 x 2 seeds = 6 cases per recipe (each cell is the same batch of prompts
whatever the other depths, so these are 6 of the 10 cases of the RESULTS.md table); the
16-bit cache answers all of them (checked). Measured 2026-11-23 on the 2-core CPU VM, cases
of 6: H2O, SnapKV, AdaKV-SnapKV, ChunkKV 6; pyramid-SnapKV 5; CAKE 4; StreamingLLM 3; TOVA 2;
PyramidInfer 2 (kept fractions 0.507-0.508); 2026-11-24: RocketKV (both stages: half the prompt
kept, a quarter of the held tokens read per decode step) 6; FastGen with head policies chosen
from each prompt at T = 0.95 (`fastgen-prompt-t95`, no budget: it keeps ~71%) 5, the needle at
depth 0 lost once; 2026-11-25: RocketKV with `unread: estimate` 6, PyramidInfer computing only the kept
tokens at prefill (`pyramidinfer-prefill`) 2, CAKE with max pooling (`cake-maxpool`) 6. Each floor is one case below the measured count.

Floors (issue 11: at 50% kept, pass-key accuracy within 10 points of the full cache) are met
by the score-based policies that see the question at prefill (H2O, SnapKV and its variants,
ChunkKV, RocketKV; pyramid-SnapKV just: its top layers keep 25% and one early needle is lost).
Measured misses (benchmarks/RESULTS.md, "Pass-key retrieval on SmolLM2-135M"):

* StreamingLLM keeps sinks + the recent half: it must lose the early needles and keep the late
  ones (recency, not a broken cache);
* TOVA scores tokens by the last query's attention averaged over all heads: the question's few
  retrieval heads are diluted and early needles are dropped (0.4 on the 10-case grid);
* CAKE's paper pools token scores by their mean over 5 positions, which spreads the score of a token the
  question attends to over its neighbours and lowers it: the rest of the key's digits drop out (0.6 on the
  10-case grid; with SnapKV's max pooling, `cake-maxpool`, every case of the 6 is answered);
* PyramidInfer keeps each layer a subset of the one below, chosen by the attention of the
  recent prompt queries, which do not ask for the key yet: early needles are dropped (0.4 on the 10-case grid).
"""


import dataclasses

import pytest

from kvtool.data import DataSpec
from kvtool.eval.baselines import sixteen_bit_recipe
from kvtool.eval.retrieval import evaluate_grid
from kvtool.eval.retrieval_request import RetrievalGrid
from kvtool.eval.retrieval_tasks import PasskeyTask, text_filler
from kvtool.methods.evict.fastgen import fastgen_token_classes
from kvtool.recipe import load_recipe
from kvtool.runtime.attach import CompressedRuntime
from tests.conftest import shared_path

pytestmark = pytest.mark.slow
GRID = RetrievalGrid((512,), (0.0, 0.5, 1.0), 2)  # 6 cases; RESULTS.md adds depths 0.25 and 0.75

# recipe -> least cases answered of the 6 (the full cache answers 6); see the module docstring for the misses
FLOORS = {
    "h2o": 5, "snapkv": 5, "ada-snapkv": 5, "chunkkv": 5, "pyramid-snapkv": 4,
    "cake": 3, "cake-maxpool": 5, "streamingllm": 2, "tova": 1, "pyramidinfer": 1, "pyramidinfer-prefill": 1, "rocketkv": 5,
}
# recipes without a budget (the kept fraction follows each prompt) -> (least cases answered, kept fraction range)
UNBUDGETED_FLOORS = {"fastgen-prompt-t95": (4, 0.6, 0.8)}
# recipes that evict on sliding-window layers only (`eviction.sliding_budget`, budget 1.0): SmolLM2 has none, so they
# keep everything here; their floors are on Gemma-3-270M (`tests/test_gemma3_pipeline.py`)
LOCAL_ONLY = {"h2o-local", "turboquant-local"}  # (turboquant-local: over 3.5 / 2.5-bit TurboQuant codes)


@pytest.fixture(scope="module")
def passkey(smollm2):
    model, tokenizer = smollm2
    task = PasskeyTask(tokenizer, text_filler(tokenizer, DataSpec.parse(str(shared_path("data/text/wikitext2_test.txt")))))

    def accuracy(recipe) -> dict:
        classes = fastgen_token_classes(tokenizer) if recipe.eviction.fastgen_per_prompt else None
        runtime = CompressedRuntime.from_recipe(model, recipe, profile=classes)
        return evaluate_grid(model, runtime, task, GRID, pad_id=tokenizer.pad_token_id)

    return accuracy


def by_depth(result: dict) -> dict[float, float]:
    return {row["depth"]: row["accuracy"] for row in result["grid"]}


def test_the_full_cache_answers_every_case(passkey):
    assert passkey(sixteen_bit_recipe())["accuracy"] == 1.0


def test_every_bundled_evicting_recipe_at_half_the_cache_has_a_floor():
    from kvtool.recipe import bundled_recipe_dir

    recipes = [load_recipe(path.stem) for path in bundled_recipe_dir().glob("*.yaml")]  # top level, not ablations
    evicting = {r.name for r in recipes if r.evicts and not r.eviction.fastgen_offline}  # offline fastgen: needs a profile
    assert evicting == set(FLOORS) | set(UNBUDGETED_FLOORS) | LOCAL_ONLY


@pytest.mark.parametrize("name", sorted(LOCAL_ONLY))
def test_a_local_only_recipe_keeps_everything_on_a_model_without_sliding_layers(passkey, name):
    recipe = load_recipe(name)
    assert recipe.eviction.budget == 1.0 and recipe.eviction.sliding_budget is not None
    result = passkey(recipe)
    assert result["kept_fraction"] == 1.0 and result["accuracy"] == 1.0, (result["kept_fraction"], by_depth(result))


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_pass_key_floor_at_half_the_cache(passkey, name):
    recipe = load_recipe(name)
    assert recipe.eviction.budget == 0.5
    result = passkey(recipe)
    assert 0.45 <= result["kept_fraction"] <= 0.6, result["kept_fraction"]  # it really evicted
    assert round(result["accuracy"] * 6) >= FLOORS[name], (name, result["accuracy"], by_depth(result))
    if name == "streamingllm":  # recency: the early needles are gone, the last ones kept
        depths = by_depth(result)
        assert depths[0.0] == 0.0 and depths[1.0] == 1.0, depths


@pytest.mark.parametrize("name", sorted(UNBUDGETED_FLOORS))
def test_pass_key_floor_of_a_recipe_without_a_budget(passkey, name):
    floor, low, high = UNBUDGETED_FLOORS[name]
    result = passkey(load_recipe(name))
    assert low <= result["kept_fraction"] <= high, result["kept_fraction"]  # it really evicted, about as measured
    assert round(result["accuracy"] * 6) >= floor, (name, result["accuracy"], by_depth(result))


# issue 13: at 12.5% kept (64 tokens per stream) -> least cases answered of the 6. Measured 2026-11-24 on the 10-case
# grid: snapkv, chunkkv, rocketkv 10/10 (each 6 of these 6); with the recipes' whole 32-token window (before
# `eviction.window_share`) 3/10 (3 of these 6): the window held half the budget and its filler queries scored it.
EIGHTH_FLOORS = {"snapkv": 5, "chunkkv": 5}


@pytest.mark.parametrize("name", sorted(EIGHTH_FLOORS))
def test_pass_key_floor_at_an_eighth_of_the_cache(passkey, name):
    recipe = load_recipe(name)
    recipe = dataclasses.replace(recipe, eviction=dataclasses.replace(recipe.eviction, budget=0.125))
    result = passkey(recipe)
    assert 0.12 <= result["kept_fraction"] <= 0.15, result["kept_fraction"]
    assert round(result["accuracy"] * 6) >= EIGHTH_FLOORS[name], (name, result["accuracy"], by_depth(result))
