"""Figures that cannot mean anything say so (`kvtool.eval.caveats`, `kvtool.eval.speed`), one baseline
(`kvtool.eval.baselines`), and kvtool keeps the libraries' progress bars out (`kvtool.quiet`)."""

from __future__ import annotations


import pytest
import torch

from kvtool.eval.baselines import BASELINE, model_dtype_fields, sixteen_bit_recipe
from kvtool.eval.caveats import (
    above_chance,
    chance_accuracy,
    first_compressed_length,
    retrieval_note,
    uncompressed_note,
)
from kvtool.eval.speed import DecodeClock, StepTimes, speed_note
from kvtool.recipe import load_recipe

IDLE = {"load_average": 0.0, "cores": 2}


# --- nothing compressed yet ------------------------------------------------------------------


def test_a_short_sequence_in_the_float_window_is_flagged_and_a_long_one_is_not():
    recipe = load_recipe("kivi-4bit")  # 4 sink + 64 recent + blocks of 32
    limit = first_compressed_length(recipe)
    assert limit == 4 + 64 + 32
    note = uncompressed_note(recipe, 20)
    assert note.startswith("nothing compressed yet") and "20 tokens" in note and f"{limit} tokens" in note
    assert uncompressed_note(recipe, limit) is None
    assert uncompressed_note(load_recipe("uncompressed"), 5) is None  # nothing to compress: no claim to qualify


def test_an_eviction_recipe_is_flagged_only_while_it_kept_everything():
    recipe = load_recipe("h2o")
    assert "no token has been evicted yet" in uncompressed_note(recipe, 30, kept_fraction=1.0)
    assert uncompressed_note(recipe, 3000, kept_fraction=0.5) is None


# --- retrieval at chance ---------------------------------------------------------------------


def test_chance_of_a_passkey_and_of_a_copy_needle():
    assert chance_accuracy("passkey", {}) == pytest.approx(1 / 90000)
    # 64 needle ids, 16-token needle, second half (8 tokens) asked: 1 / (56 * 55 * ... * 49)
    expected = 1.0
    for i in range(8):
        expected /= 56 - i
    assert chance_accuracy("copy", {"vocab": {"needle_lo": 64, "needle_hi": 128}, "needle_tokens": 16}) == pytest.approx(expected)


def test_above_chance_is_a_binomial_test():
    assert not above_chance(0, 10, 0.1)
    assert not above_chance(1, 10, 0.1)  # one hit in ten at p = 0.1 is what guessing gives
    assert above_chance(6, 10, 0.1)
    assert above_chance(1, 6, 1 / 90000)  # one exact 5-digit key is not luck


def _report(accuracy, baseline_accuracy=None, task="passkey"):
    grid = [{"n": 64, "depth": d} for d in (0.0, 0.5, 1.0)]
    return {"task": task, "grid": grid, "seeds": 2, "accuracy": accuracy, "baseline_accuracy": baseline_accuracy,
            "chance_accuracy": chance_accuracy(task, {}), "baseline": BASELINE}


def test_a_baseline_at_chance_says_the_model_cannot_do_the_task():
    note = retrieval_note(_report(0.0, 0.0))
    assert "cannot do the passkey task" in note and "--task copy" in note
    assert retrieval_note(_report(0.0, 1.0)) is None  # the baseline works: a 0 for compression is a finding


def test_without_a_baseline_a_chance_score_asks_for_one():
    assert "--baseline" in retrieval_note(_report(0.0))
    assert retrieval_note(_report(0.5)) is None


# --- one baseline ----------------------------------------------------------------------------


def test_the_baseline_is_the_16_bit_cache_and_the_model_dtype_is_an_extra_figure():
    recipe = sixteen_bit_recipe()
    assert recipe.name == BASELINE and recipe.is_noop and recipe.cache.float_dtype == "float16"
    fp32 = torch.nn.Linear(2, 2)
    assert model_dtype_fields(fp32, 100) == {"baseline": BASELINE, "model_dtype": "float32", "model_dtype_cache_bytes": 200}
    assert model_dtype_fields(fp32.to(torch.bfloat16), 100) == {"baseline": BASELINE}


# --- speed from repeated timings -------------------------------------------------------------


def test_median_and_best_step_rates():
    steps = StepTimes()
    for seconds in (0.1, 0.2, 0.1, 0.05, 0.1):
        steps.add(2, seconds)
    summary = steps.summary("x_")
    assert summary == {"x_decode_tokens_per_s_median": pytest.approx(20.0),
                       "x_decode_tokens_per_s_best": pytest.approx(40.0), "x_decode_steps": 5}


def test_speed_note_on_spread_steps_or_a_busy_machine():
    steady, spread = StepTimes(), StepTimes()
    for seconds in (0.1, 0.1, 0.11):
        steady.add(1, seconds)
    for seconds in (0.1, 0.1, 0.02):
        spread.add(1, seconds)
    assert speed_note([steady], IDLE) is None
    assert "vary" in speed_note([steady, spread], IDLE)
    assert "busy" in speed_note([steady], {"load_average": 6.0, "cores": 2})


def test_decode_clock_skips_the_prefill_and_passes_tokens_on():
    seen = []

    class Inner:
        def put(self, value):
            seen.append(value)

        def end(self):
            seen.append("end")

    clock = DecodeClock(Inner())
    for value in range(5):  # prompt, first token (after prefill), three decode steps
        clock.put(value)
    clock.end()
    assert seen == [0, 1, 2, 3, 4, "end"]
    assert clock.steps(batch=3).summary()["decode_steps"] == 3
    assert clock.prefill_seconds() > 0


# --- quiet libraries ---------------------------------------------------------------------------


def test_quiet_progress_bars_restores_the_callers_setting():
    from transformers.utils import logging as transformers_logging

    from kvtool.quiet import quiet_progress_bars

    transformers_logging.enable_progress_bar()
    with quiet_progress_bars():
        assert not transformers_logging.is_progress_bar_enabled()
    assert transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    with quiet_progress_bars():
        pass
    assert not transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()


def test_rows_are_scored_interleaved_step_by_step_and_each_as_if_alone():
    """`perplexities` runs decode step s of every cache before step s + 1 (the rows meet the same machine
    load), and each row's result is what `perplexity` gives for that cache alone."""
    from kvtool.eval.perplexity import perplexities, perplexity
    from kvtool.runtime.attach import CompressedRuntime
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    windows = torch.randint(3, 128, (3, 120), generator=torch.Generator().manual_seed(0))  # 120 > 4 sink + 64 recent + 32
    runtimes = [CompressedRuntime.from_recipe(model, load_recipe(name)) for name in ("kivi-2bit", "uncompressed")]
    order = []
    on_steps = [lambda tokens, seconds, row=row: order.append(row) for row in range(len(runtimes))]
    together = perplexities(model, windows, [r.new_cache for r in runtimes], prefill=100, batch_size=2, on_steps=on_steps)
    assert order == [0, 1] * (len(order) // 2) and len(order) == 2 * 2 * (120 - 1 - 100)  # 2 batches x 19 steps x 2 rows
    for runtime, result in zip(runtimes, together):
        alone = perplexity(model, windows, runtime.new_cache, prefill=100, batch_size=2)
        assert result.ppl == pytest.approx(alone.ppl, rel=1e-6) and result.scored_tokens == alone.scored_tokens
        assert result.cache_bytes == alone.cache_bytes and result.fp16_cache_bytes == alone.fp16_cache_bytes
    assert together[0].cache_bytes < together[1].cache_bytes  # two different caches, not one scored twice
