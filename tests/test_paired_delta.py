"""The paired perplexity-delta interval (`kvtool.eval.paired_delta`) and the per-token NLLs it reads."""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.errors import RuntimeConfigError
from kvtool.eval.paired_delta import paired_delta
from kvtool.recipe import load_recipe


def _nll(shape, seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 5


def test_the_delta_is_the_perplexity_ratio_of_the_same_tokens():
    base, other = _nll((3, 100), 0), _nll((3, 100), 1)
    result = paired_delta(base, other)
    assert result.delta_pct == pytest.approx(100 * (math.exp(other.mean()) / math.exp(base.mean()) - 1), rel=1e-9)
    assert result.low_pct < result.delta_pct < result.high_pct
    assert result.blocks == 3 * 4 and result.scored_tokens == 300  # blocks of 32: 32 + 32 + 32 + 4 per window


def test_identical_rows_and_a_constant_shift_have_no_spread():
    base = _nll((2, 70), 0)
    same = paired_delta(base, base.clone())
    assert (same.delta_pct, same.low_pct, same.high_pct) == (0.0, 0.0, 0.0)
    shifted = paired_delta(base, base + 0.01)
    assert shifted.delta_pct == pytest.approx(100 * math.expm1(0.01), rel=1e-9)
    assert shifted.low_pct == pytest.approx(shifted.delta_pct, abs=1e-9) == pytest.approx(shifted.high_pct, abs=1e-9)


def test_one_block_gives_no_interval_and_bad_input_is_refused():
    single = paired_delta(_nll((1, 20), 0), _nll((1, 20), 1))
    assert single.low_pct is None and single.to_dict()["delta_ci95_pct"] is None
    with pytest.raises(RuntimeConfigError, match="same"):
        paired_delta(_nll((2, 20), 0), _nll((2, 21), 1))
    with pytest.raises(RuntimeConfigError, match="no scored tokens"):
        paired_delta(torch.zeros(2, 0), torch.zeros(2, 0))
    with pytest.raises(RuntimeConfigError, match="block_tokens"):
        paired_delta(_nll((2, 20), 0), _nll((2, 20), 1), block_tokens=0)


def _correlated_differences(windows: int, tokens: int, rho: float, seed: int) -> torch.Tensor:
    """AR(1) per-token differences with mean 0: neighbouring tokens' damage is correlated, as a cache's is."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(windows, tokens, generator=gen, dtype=torch.float64)
    out = torch.empty_like(noise)
    out[:, 0] = noise[:, 0]
    for t in range(1, tokens):
        out[:, t] = rho * out[:, t - 1] + math.sqrt(1 - rho**2) * noise[:, t]
    return 0.05 * out


def test_batch_means_cover_the_true_delta_where_per_token_errors_would_not():
    """With correlated per-token damage, blocks of 32 tokens cover a true delta of 0 about 95% of the time;
    treating tokens as independent (blocks of 1) covers it far less often: the reason for the blocks."""
    trials, covered_blocks, covered_tokens = 200, 0, 0
    for seed in range(trials):
        diff = _correlated_differences(4, 256, rho=0.8, seed=seed)
        base = torch.zeros_like(diff)
        blocks, tokens = paired_delta(base, diff), paired_delta(base, diff, block_tokens=1)
        covered_blocks += blocks.low_pct <= 0.0 <= blocks.high_pct
        covered_tokens += tokens.low_pct <= 0.0 <= tokens.high_pct
    assert 0.88 <= covered_blocks / trials <= 0.99
    assert covered_tokens / trials < 0.75


def test_perplexity_keeps_every_scored_token_and_the_report_gives_the_interval():
    """`perplexity` returns the (windows, scored tokens) NLLs whose mean is its NLL (JSON leaves them out), and
    `perplexity_report` adds the paired interval of the runtime's row against the 16-bit baseline."""
    from kvtool.eval.perplexity import perplexity
    from kvtool.eval.ppl_report import perplexity_report
    from kvtool.runtime.attach import CompressedRuntime
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    windows = torch.randint(3, 128, (3, 120), generator=torch.Generator().manual_seed(0))
    runtime = CompressedRuntime.from_recipe(model, load_recipe("kivi-2bit"))
    result = perplexity(model, windows, runtime.new_cache, prefill=50, batch_size=2)
    assert result.token_nll.shape == (3, 120 - 1 - 50) and result.scored_tokens == result.token_nll.numel()
    assert result.token_nll.double().mean().item() == pytest.approx(result.nll, rel=1e-5)
    assert "token_nll" not in result.to_dict()

    report = perplexity_report(model, windows, runtime, prefill=50, batch_size=2)
    low, high = report["delta_ci95_pct"]
    assert low < report["delta_pct"] < high and report["delta_blocks"] == 3 * 3  # 69 tokens: blocks of 32, 32, 5
    assert report["delta_pct"] == pytest.approx(100 * (report["ppl"] / report["baseline_ppl"] - 1), rel=1e-4, abs=1e-6)
    assert "delta_ci95_pct" not in perplexity_report(model, windows, runtime, prefill=50, batch_size=2, baseline=False)
