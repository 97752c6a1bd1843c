"""Quality floors of TOVA, ChunkKV, AdaKV-budgeted SnapKV and CAKE on SmolLM2-135M at 50% of the cache kept.

SmolLM2-135M is a real pretrained model (attention sinks, induction heads), materialized by
``python ../shared/models/fetch_pretrained.py`` into $KVTOOL_TEST_MODELS (default
~/.cache/kvtool-test-models). Held-out WikiText-2 test, 2 windows of 448 tokens: 384
prefilled, 63 decoded one per step with the budget enforced at every step. Floor: 50% kept
within 10% of the full cache's perplexity (same code path, fp16 storage). The issue's 3% is
not met on this short-context decode setup by these policies (nor by H2O, +9.4%; SnapKV
+2.2%): see benchmarks/RESULTS.md. With a 256-token prefill all three lose 15-20%. The kept fraction and
the bytes held are checked too, so a policy that kept everything fails. PyramidInfer has no
floor here: it loses +19.7% in this setting (benchmarks/RESULTS.md).
"""


import pytest

from kvtool.data import DataSpec, token_windows
from kvtool.eval.perplexity import perplexity
from kvtool.recipe import load_recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe
from tests.conftest import shared_path

pytestmark = pytest.mark.slow
SEQ_LEN, PREFILL = 448, 384  # the setting of benchmarks/RESULTS.md (issue 13 section)


@pytest.fixture(scope="module")
def scorer(smollm2):
    model, tokenizer = smollm2
    data = DataSpec.parse(str(shared_path("data/text/wikitext2_test.txt")))
    windows = token_windows(tokenizer, data, samples=2, seq_len=SEQ_LEN, mode="sequential")

    def score(recipe):
        return perplexity(model, windows, CompressedRuntime.from_recipe(model, recipe).new_cache, prefill=PREFILL, batch_size=2)

    return score, score(uncompressed_recipe("float16"))


@pytest.mark.parametrize("name", ["tova", "chunkkv", "ada-snapkv", "cake"])
def test_half_the_cache_stays_within_10_percent(scorer, name):
    score, full = scorer
    recipe = load_recipe(name)
    assert recipe.eviction.budget == 0.5
    result = score(recipe)
    # the budget, plus at most interval - 1 tokens a stream may gain while decoding before it is cut back
    slack = (recipe.eviction.interval - 1) / SEQ_LEN
    assert 0.47 < result.kept_fraction < 0.5 + slack + 0.01, "the cache did not keep the fraction it was asked to"
    assert result.cache_bytes < (0.56 + slack) * full.cache_bytes
    assert 100 * (result.ppl / full.ppl - 1) < 10.0, (result.ppl, full.ppl)
