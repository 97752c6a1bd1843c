"""benchmarks/output_kl.py on the embedded kvref-5m: KL of the next-token distributions through the runtime."""

import pytest

from benchmarks.common import MODELS, SHARED
from benchmarks.output_kl import BASELINE, rows, runtimes, score
from kvtool.data import DataSpec, token_windows
from kvtool.models.loading import load_model

pytestmark = pytest.mark.skipif(not (SHARED / MODELS["kvref-5m"][0]).exists(), reason="needs ../shared/models/kvref-5m")


def test_kl_is_zero_for_the_lossless_cache_and_grows_with_fewer_bits():
    model, tokenizer = load_model(str(SHARED / MODELS["kvref-5m"][0]))
    windows = token_windows(tokenizer, DataSpec.parse(str(SHARED / MODELS["kvref-5m"][2])), samples=2, seq_len=192,
                            mode="sequential")
    runs = runtimes(model, tokenizer, "kvref-5m", ["uncompressed", "kivi-4bit", "kivi-2bit"], calib_samples=1, seq_len=192)
    scored = score(model, windows, runs, batch_size=2)
    assert scored[BASELINE]["kl"].abs().max() < 1e-6  # the baseline against itself
    assert scored["kivi-2bit"]["kl"].shape == (2, 95)  # decoded steps 96 .. 190
    by_name = {row["recipe"]: row for row in rows(scored)}
    assert by_name["uncompressed"]["kl_mean"] < 1e-6 and abs(by_name["uncompressed"]["delta_pct"]) < 1e-3
    assert 0 < by_name["kivi-4bit"]["kl_mean"] < by_name["kivi-2bit"]["kl_mean"]  # compression really on, 2 bits worse
    assert by_name["kivi-2bit"]["kl_median"] <= by_name["kivi-2bit"]["kl_p99"]
    assert by_name["kivi-2bit"]["scored_tokens"] == 190 and len(by_name["kivi-2bit"]["delta_ci95_pct"]) == 2
