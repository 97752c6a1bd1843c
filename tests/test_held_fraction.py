"""`eval ppl`'s bytes held averaged over the decode steps (`PerplexityResult.held_fraction_mean`).

The oracle is a loop that decodes the same windows into the same cache and reads ``nbytes()`` / ``fp16_nbytes()``
after every step. On a sliding-window layer a quantized store frees its body blocks only whole and keeps the open
block in fp16, so the bytes after the last token (``cache_bytes``) are one phase of a saw tooth: the mean differs.
"""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from kvtool.cli_render import render_perplexity
from kvtool.eval.perplexity import perplexity
from kvtool.eval.ppl_report import perplexity_report
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import recipe_from_dict
from kvtool.runtime.attach import CompressedRuntime
from tests.tiny_models import featured_model

RECIPE = {
    "name": "u4-windowless",
    "keys": {"method": "uniform", "bits": 4, "axis": "channel"},
    "values": {"method": "uniform", "bits": 4, "axis": "token", "group_size": 32},
    "cache": {"block_size": 32, "sink_tokens": 2, "recent_tokens": 0, "float_dtype": "float16"},
}


def test_the_mean_over_steps_is_what_a_step_loop_reads_and_not_the_last_steps_bytes():
    model = featured_model("gemma3_text")  # layer 0 has a 16-token sliding window, layer 1 full attention
    windows = torch.randint(3, 128, (2, 140), generator=torch.Generator().manual_seed(0))
    runtime = CompressedRuntime.from_recipe(model, recipe_from_dict(RECIPE))
    prefill = 60
    result = perplexity(model, windows, runtime.new_cache, prefill=prefill, batch_size=2)

    cache, seen = runtime.new_cache(), []
    with torch.no_grad():
        model(input_ids=windows[:, :prefill], **with_cache(cache), use_cache=True)
        for step in range(prefill, windows.shape[1] - 1):
            model(input_ids=windows[:, step : step + 1], **with_cache(cache), use_cache=True)
            seen.append(cache.nbytes() / cache.fp16_nbytes())
    assert result.held_fraction_mean == pytest.approx(sum(seen) / len(seen), rel=1e-9)
    assert len(set(seen)) > 2  # the bytes move with the blocks' phase ...
    at_end = result.cache_bytes / result.fp16_cache_bytes
    assert at_end == pytest.approx(seen[-1]) and result.held_fraction_mean != pytest.approx(at_end)  # ... so the end is one phase
    assert 0 < result.held_fraction_mean < 1


def test_the_report_carries_it_for_every_row_and_the_table_prints_it():
    model = featured_model("gemma3_text")
    windows = torch.randint(3, 128, (2, 100), generator=torch.Generator().manual_seed(1))
    runtime = CompressedRuntime.from_recipe(model, recipe_from_dict(RECIPE))
    report = {**perplexity_report(model, windows, runtime, prefill=40, batch_size=2), "recipe": "u4"}  # as the API adds
    assert 0 < report["held_fraction_mean"] < 0.9 < report["baseline_held_fraction_mean"]
    out = io.StringIO()
    render_perplexity(Console(file=out, width=200), report)
    row = next(line for line in out.getvalue().splitlines() if "mean of steps" in line)
    assert f"{100 * report['held_fraction_mean']:.1f}%" in row
    old = {k: v for k, v in report.items() if "held_fraction_mean" not in k}  # a report written before the field
    render_perplexity(Console(file=io.StringIO(), width=200), old)
