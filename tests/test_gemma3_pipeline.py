"""Gemma 3 270M through the whole pipeline, and quality floors that fail if a method breaks on it.

Gemma 3 is what the generic adapter has to get right at once: 15 sliding-window (512) layers
with RoPE base 10k and 3 global layers with base 1M, MQA (one KV head), head_dim 256, q/k
norms before RoPE. Kept small for CI (one 600-token window of held-out WikiText-2 test,
decode mode after a 544-token prefill, so every decoded token's sliding layers see only
their last 512 tokens).

* the API end to end: `profile` -> `calibrate` (KVQuant 4-bit: Fisher-weighted nuq codebooks
  on pre-RoPE keys, which must be un-rotated with each layer's own RoPE) -> `export` with the
  profile -> `generate` and `evaluate_perplexity` from the artifact;
* perplexity-delta floors per recipe family (uniform 4-/2-bit, KVQuant 4-bit, H2O at 50%
  kept): each must stay under its ceiling AND differ from the uncompressed run (compression
  on), and the bytes held must drop as the recipe promises;
* pass keys for the recipes that evict on the sliding-window layers only (`h2o-local`,
  `turboquant-local`): the needles the full cache answers beyond a halved local window stay
  answered (the global layers hold them).

The ceilings are regression floors from the first measured run (2-core CPU, this window):
uniform 4-bit +3.8%, uniform 2-bit +51%, KVQuant 4-bit (calibrated on 2 x 128 tokens only)
+7.6%, H2O at half the cache +22.8%, each given ~1.5x margin. They are above the issue's
targets (4-bit within 3%): Gemma 3 (one KV head of head_dim 256 feeding every query head) is
more sensitive than SmolLM2, and meeting the targets is open work. A broken method (a wrong
RoPE base, a dropped window) makes perplexity explode far past these floors.
"""

import dataclasses

import pytest
import torch

from kvtool import api
from kvtool.api import calibrate_loaded
from kvtool.artifact import Artifact
from kvtool.data import DataSpec, token_windows
from kvtool.eval.perplexity import perplexity
from kvtool.recipe import Recipe, load_recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe
from tests.conftest import shared_path, test_model_path
from tests.test_eviction_passkey import LOCAL_ONLY

pytestmark = pytest.mark.slow
CALIB = "data/text/wikitext2_valid.txt[0:0.9]"
EVAL = "data/text/wikitext2_test.txt"
SEQ_LEN, PREFILL = 600, 544


def small_calibration(recipe: Recipe, samples: int = 2, seq_len: int = 128) -> Recipe:
    return dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, samples=samples, seq_len=seq_len))


@pytest.fixture(scope="module")
def windows(gemma3):
    _, tokenizer = gemma3
    return token_windows(tokenizer, DataSpec.parse(str(shared_path(EVAL))), samples=1, seq_len=SEQ_LEN, mode="sequential")


def score(gemma3, windows, new_cache):
    model, _ = gemma3
    return perplexity(model, windows, new_cache, prefill=PREFILL, batch_size=1)


@pytest.fixture(scope="module")
def baseline(gemma3, windows):
    model, _ = gemma3
    return score(gemma3, windows, CompressedRuntime.from_recipe(model, uncompressed_recipe()).new_cache)


@pytest.fixture(scope="module")
def kvquant4(gemma3) -> Artifact:
    model, tokenizer = gemma3
    return calibrate_loaded(model, tokenizer, str(shared_path(CALIB)), small_calibration(load_recipe("kvquant-4bit-1pct")))


def test_profile_calibrate_export_generate_evaluate_through_the_api(tmp_path, kvquant4):
    model_dir = str(test_model_path("gemma3-270m"))
    calib = str(shared_path(CALIB))
    prof = api.profile(calib, tmp_path / "profile.kvt", model_dir, samples=2, seq_len=128, batch_size=2)
    heads = prof.tensors["heads.policy"]
    assert tuple(heads.shape) == (18, 1)  # (layers, KV heads): MQA
    from kvtool.artifact import save_artifact

    save_artifact(tmp_path / "calib.kvt", kvquant4)
    api.export(tmp_path / "calib.kvt", tmp_path / "deploy.kvt", model_dir, tmp_path / "profile.kvt")
    result = api.generate(["The capital of France is", "Water boils at"], model_dir, tmp_path / "deploy.kvt", max_new_tokens=6)
    assert len(result.texts) == 2 and all(text.strip() for text in result.texts)  # (12 tokens: all still in float blocks)
    report = api.evaluate_perplexity(
        str(shared_path(EVAL)), model_dir, tmp_path / "deploy.kvt", samples=1, seq_len=160, prefill=128, batch_size=1
    )
    assert abs(report["delta_pct"]) < 5 and report["delta_pct"] != 0, report  # 32 scored tokens: the sign is noise
    assert report["bits_per_element"] < 8, report


def test_baseline_perplexity_is_that_of_a_working_model(baseline):
    assert baseline.ppl < 60, baseline.ppl  # a wrong window or RoPE base gives hundreds


def _uniform(bits: int) -> Recipe:
    recipe = Recipe(name=f"uniform-{bits}").with_bits(bits)
    return dataclasses.replace(recipe, values=dataclasses.replace(recipe.values, group_size=64))


@pytest.mark.parametrize(
    "name, ceiling, max_bytes",
    # max_bytes: of transformers' own 16-bit cache, whose sliding layers hold 511 of the 600 tokens (measured
    # 2026-11-24: 0.445, 0.336, 0.349, 0.537)
    [("uniform-4", 0.06, 0.50), ("uniform-2", 0.80, 0.38), ("kvquant-4", 0.12, 0.40), ("h2o-50", 0.35, 0.60),
     ("uniform-3bit-prerope", 0.12, 0.32),  # measured 2026-11-24: +6.90% (one 56-token window: noisy), 0.286
     ("turboquant-k3.5-v2.5", 0.12, 0.27),  # measured 2026-11-28: +2.90%, 0.261 (600 tokens: the open block weighs)
     ("h2o-local", 0.05, 0.66),  # H2O on the 15 sliding layers only (half of each window): measured 2026-11-30 -0.75%, 0.628
     ("turboquant-local", 0.20, 0.15)],  # n8-int8's codes, the sliding layers at half their window: 2026-12-07 +12.42%, 0.127 (Kronecker rotation: +8.26%)
)
def test_perplexity_floor_per_recipe_family(gemma3, windows, baseline, kvquant4, name, ceiling, max_bytes):
    model, _ = gemma3
    if name in ("uniform-3bit-prerope", "turboquant-k3.5-v2.5", "h2o-local", "turboquant-local"):  # bundled (the first stores keys before RoPE)
        runtime = CompressedRuntime.from_recipe(model, load_recipe(name))
    elif name.startswith("uniform"):
        runtime = CompressedRuntime.from_recipe(model, _uniform(int(name[-1])))
    elif name == "kvquant-4":
        runtime = CompressedRuntime.from_artifact(model, kvquant4)
    else:
        runtime = CompressedRuntime.from_recipe(model, load_recipe("h2o"))
    result = score(gemma3, windows, runtime.new_cache)
    delta = result.ppl / baseline.ppl - 1
    print(f"gemma3 {name}: ppl {result.ppl:.3f} vs {baseline.ppl:.3f} ({100 * delta:+.2f}%), "
          f"bytes {result.cache_bytes / result.fp16_cache_bytes:.3f} of a 16-bit cache")
    assert delta < ceiling, (name, result.ppl, baseline.ppl)
    assert result.ppl != baseline.ppl  # compression is on
    assert result.cache_bytes < max_bytes * result.fp16_cache_bytes, (result.cache_bytes, result.fp16_cache_bytes)
    assert torch.isfinite(torch.tensor(result.ppl))


# Pass key on Gemma-3-270M for the recipes that evict on its 15 sliding-window layers only (`eviction.sliding_budget`;
# SmolLM2, which has none, keeps everything with them: `tests/test_eviction_passkey.py`). Plain text, 768 tokens, the
# needle at depths 0 and 0.5 (one seed: 2 cases): both beyond the 256 tokens a halved local window holds, inside the
# full 512 window for the second. The global layers hold the long-range reads, so every case the full cache answers
# must stay answered (measured 2026-11-30 on the 20-case grid at 1K-2K: 0.95 for the full cache and both recipes, the
# same miss at 2048). A recipe that evicted on the global layers too would lose the early needle.
LOCAL_ONLY_PASSKEY_GRID = (768,), (0.0, 0.5), 1


@pytest.fixture(scope="module")
def gemma3_passkey(gemma3):
    from kvtool.eval.retrieval import evaluate_grid
    from kvtool.eval.retrieval_request import RetrievalGrid
    from kvtool.eval.retrieval_tasks import PasskeyTask, text_filler

    model, tokenizer = gemma3
    task = PasskeyTask(tokenizer, text_filler(tokenizer, DataSpec.parse(str(shared_path(EVAL)))))
    grid = RetrievalGrid(*LOCAL_ONLY_PASSKEY_GRID)

    def accuracy(recipe: Recipe) -> dict:
        return evaluate_grid(model, CompressedRuntime.from_recipe(model, recipe), task, grid, pad_id=tokenizer.pad_token_id)

    return accuracy


def test_the_full_cache_answers_the_local_only_pass_keys(gemma3_passkey):
    from kvtool.eval.baselines import sixteen_bit_recipe

    full = gemma3_passkey(sixteen_bit_recipe())
    assert full["accuracy"] == 1.0, full["grid"]  # the prompt works on this model at this length


@pytest.mark.parametrize("name", sorted(LOCAL_ONLY))  # every bundled one (`tests/test_eviction_passkey.py` checks the list)
def test_local_only_eviction_keeps_the_full_caches_pass_keys(gemma3_passkey, name):
    result = gemma3_passkey(load_recipe(name))
    assert result["accuracy"] == 1.0, (name, result["grid"])
    assert result["cache_bytes"] < 0.75 * result["fp16_cache_bytes"], result  # it evicted (and quantized, for turboquant-local)
