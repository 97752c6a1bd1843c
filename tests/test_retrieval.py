"""Retrieval through the real runtime (`kvtool.eval.retrieval`) on the copy model, plus the passkey prompts.

The copy model (`kvtool.eval.copy_model`, fixture ``copy_model``) recalls a random-token
needle from anywhere in its context with the full cache; with a StreamingLLM cache that
keeps 4 sinks + a 32-token window, a needle in the middle is evicted and recall must
collapse, while a needle inside the window is still recalled. Then the API's report, the
CLI on a saved model folder without a tokenizer, bad grids, and the passkey prompts on
kvref-5m's tokenizer (skipped without ../shared).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from typer.testing import CliRunner

from kvtool import api
from kvtool.cli import app
from kvtool.data import DataSpec
from kvtool.errors import DataError, KvtoolError, ModelError, RuntimeConfigError
from kvtool.eval.copy_model import CopyVocab, copy_losses, save_copy_model
from kvtool.eval.retrieval import evaluate_grid
from kvtool.eval.retrieval_request import RetrievalGrid, parse_numbers
from kvtool.eval.retrieval_tasks import CopyTask, PasskeyTask, text_filler
from kvtool.recipe import EvictionSpec, load_recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe
from tests.conftest import SHARED, shared_path

SINKS, WINDOW = 4, 32
GRID_KEYS = {"n", "depth", "accuracy", "baseline_accuracy", "kept_fraction", "cache_bytes", "baseline_cache_bytes"}


def streaming_recipe():
    """Float storage, StreamingLLM eviction: 4 sinks + the last 32 tokens, nothing else."""
    eviction = EvictionSpec(policy="streamingllm", budget_tokens=SINKS + WINDOW, sink_tokens=SINKS, window=WINDOW)
    return dataclasses.replace(uncompressed_recipe(), name="streamingllm-36", eviction=eviction)


def copy_grid(model, recipe, lengths, depths, seeds=3, baseline=True) -> dict:
    task = CopyTask(CopyVocab.for_config(model.config))
    base = CompressedRuntime.from_recipe(model, uncompressed_recipe()) if baseline else None
    runtime = CompressedRuntime.from_recipe(model, recipe)
    return evaluate_grid(model, runtime, task, RetrievalGrid(lengths, depths, seeds), baseline_runtime=base, pad_id=2)


@pytest.fixture(scope="module")
def copy_model_dir(copy_model, tmp_path_factory):
    return save_copy_model(copy_model, tmp_path_factory.mktemp("copy-model") / "model")


# --- the copy model ---------------------------------------------------------------------------


def test_copy_model_copies(copy_model):
    """Held-out blocks: unpredictable at first sight, near-free to predict in their copy."""
    first, second = copy_losses(copy_model)
    assert first > 3.0, first  # no better than guessing (ln 64 = 4.16 for a uniform guess)
    assert second < 0.05, second


def test_needle_recalled_with_the_whole_cache(copy_model):
    report = copy_grid(copy_model, uncompressed_recipe(), (64, 256), (0.0, 0.5, 1.0), baseline=False)
    assert report["accuracy"] >= 0.9, report["grid"]
    assert report["kept_fraction"] == 1.0


def test_needle_recalled_through_a_4bit_cache(copy_model):
    """Quantized, nothing evicted: the needle's keys/values survive 4-bit KIVI."""
    report = copy_grid(copy_model, load_recipe("kivi-4bit"), (256,), (0.0, 0.5), baseline=False)
    assert report["accuracy"] >= 0.9, report["grid"]


# --- eviction: a needle outside sinks + window is lost ---------------------------------------


def test_streamingllm_loses_an_evicted_needle(copy_model):
    report = copy_grid(copy_model, streaming_recipe(), (256,), (0.25, 0.5))
    assert report["baseline_accuracy"] == 1.0, report["grid"]  # the model can: the cache lost it
    assert report["accuracy"] <= 0.1, report["grid"]
    assert report["kept_fraction"] < 0.2  # 36 of ~263 tokens
    assert report["cache_bytes"] < 0.2 * report["baseline_cache_bytes"]


def test_streamingllm_keeps_a_needle_in_its_window(copy_model):
    """At depth 1 the needle (16) and the query (8) are the last 24 prompt tokens: inside the 32-token window."""
    report = copy_grid(copy_model, streaming_recipe(), (256,), (1.0,))
    assert report["accuracy"] >= 0.9, report["grid"]
    assert report["kept_fraction"] < 0.2


def test_question_agnostic_compression_cannot_aim_at_the_question(copy_model):
    """SnapKV (pooling 15) at 50% keeps the needle when the question is in its window; compressing the
    context first (the question arrives later) leaves it only the filler's attention, so the needle goes."""
    eviction = EvictionSpec(policy="snapkv", budget=0.5, sink_tokens=SINKS, window=WINDOW, pooling=15)
    runtime = CompressedRuntime.from_recipe(copy_model, dataclasses.replace(uncompressed_recipe(), name="snapkv", eviction=eviction))
    base = CompressedRuntime.from_recipe(copy_model, uncompressed_recipe())
    task, grid = CopyTask(CopyVocab.for_config(copy_model.config)), RetrievalGrid((256,), (0.25, 0.5), 3)
    aware = evaluate_grid(copy_model, runtime, task, grid, pad_id=2)
    agnostic = evaluate_grid(copy_model, runtime, task, grid, baseline_runtime=base, pad_id=2, question_agnostic=True)
    assert aware["accuracy"] >= 0.9, aware["grid"]
    assert agnostic["baseline_accuracy"] == 1.0, agnostic["grid"]  # prefilling in two parts loses nothing by itself
    assert agnostic["accuracy"] <= 0.5, agnostic["grid"]
    assert abs(agnostic["kept_fraction"] - aware["kept_fraction"]) < 0.02


# --- API, CLI ----------------------------------------------------------------------------------


def test_report_is_json_with_grid_and_plot(copy_model_dir, tmp_path):
    plot = tmp_path / "heat.png"
    report = api.evaluate_retrieval(str(copy_model_dir), recipe="kivi-4bit", task="copy", lengths=[64, 96],
                                    depths=[0.0, 1.0], seeds=2, plot=plot)
    json.dumps(report)
    for key in ("accuracy", "baseline_accuracy", "kept_fraction", "cache_bytes", "baseline_cache_bytes", "grid",
                "task", "lengths", "depths", "seeds", "recipe"):
        assert key in report, key
    assert (report["task"], report["recipe"], report["lengths"], report["depths"], report["seeds"]) == \
        ("copy", "kivi-4bit", [64, 96], [0.0, 1.0], 2)
    assert len(report["grid"]) == 4 and all(GRID_KEYS <= set(row) for row in report["grid"])
    assert report["accuracy"] >= 0.9 and report["baseline_accuracy"] == 1.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_eval_retrieval_copy(copy_model_dir, tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["eval", "retrieval", "--model", str(copy_model_dir), "--task", "copy",
                                      "--lengths", "64,96", "--depths", "0,1", "--seeds", "2", "--json", str(out)])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    flat = "".join(result.stdout.split())
    assert "64tokens" in flat and "96tokens" in flat and "uncompressed:accuracy1.000" in flat
    report = json.loads(out.read_text())
    assert report["accuracy"] == 1.0 and len(report["grid"]) == 4


def fake_report(baseline: bool = True) -> dict:
    row = {"n": 64, "depth": 0.5, "accuracy": 0.5, "baseline_accuracy": 1.0 if baseline else None,
           "kept_fraction": 0.25, "cache_bytes": 1024.0, "baseline_cache_bytes": 4096.0 if baseline else None}
    summary = {k: v for k, v in row.items() if k not in ("n", "depth")}
    return {"task": "passkey", "recipe": "snapkv", "lengths": [64], "depths": [0.5], "seeds": 2, **summary, "grid": [row]}


def test_cli_translates_options(monkeypatch, tmp_path):
    """The CLI as a translation layer: options -> one api.evaluate_retrieval call -> table and JSON."""
    calls = []
    monkeypatch.setattr(api, "evaluate_retrieval", lambda *args, **kwargs: calls.append((args, kwargs)) or fake_report(False))
    out = tmp_path / "r.json"
    (tmp_path / "t.txt").write_text("held-out text\n")  # the CLI checks --data and --model before anything loads
    model = str(tmp_path)
    result = CliRunner().invoke(app, ["eval", "retrieval", "-m", model, "-r", "snapkv", "--data", f"{tmp_path / 't.txt'}[0.9:1]",
                                      "--lengths", "64,128", "--depths", "0,0.5", "--seeds", "2", "--facts", "3",
                                      "--no-baseline", "--plot", str(tmp_path / "p.png"), "--json", str(out)])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    (args, kwargs), = calls
    assert args == (model, None, "snapkv")
    assert kwargs["data"] == DataSpec(str(tmp_path / "t.txt"), start=0.9, end=1.0)
    assert (kwargs["task"], kwargs["lengths"], kwargs["depths"], kwargs["seeds"], kwargs["facts"], kwargs["baseline"]) == \
        ("passkey", (64, 128), (0.0, 0.5), 2, 3, False)
    assert kwargs["plot"] == tmp_path / "p.png"
    assert kwargs["question_agnostic"] is False
    assert "snapkv:accuracy0.500" in "".join(result.stdout.split())
    assert json.loads(out.read_text())["grid"][0]["kept_fraction"] == 0.25


def test_cli_question_agnostic_option(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(api, "evaluate_retrieval", lambda *args, **kwargs: calls.append(kwargs) or fake_report(False))
    result = CliRunner().invoke(app, ["eval", "retrieval", "-m", str(tmp_path), "-r", "snapkv", "--task", "copy", "--question-agnostic"])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert calls[0]["question_agnostic"] is True


def test_cli_error_is_one_line(copy_model_dir):
    result = CliRunner().invoke(app, ["eval", "retrieval", "--model", str(copy_model_dir), "--task", "copy",
                                      "--depths", "0,1.5"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.startswith("error: ") and "--depths" in result.stderr


# --- bad requests -----------------------------------------------------------------------------


@pytest.mark.parametrize("lengths, depths, seeds, needle", [
    ((), (0.5,), 1, "grid is empty"),
    ((64,), (), 1, "grid is empty"),
    ((64,), (1.5,), 1, "[0, 1]"),
    ((64,), (-0.1,), 1, "[0, 1]"),
    ((1,), (0.5,), 1, ">= 2"),
    ((64,), (0.5,), 0, "--seeds"),
])
def test_bad_grids(lengths, depths, seeds, needle):
    with pytest.raises(RuntimeConfigError, match=None) as info:
        RetrievalGrid(lengths, depths, seeds)
    assert needle in str(info.value)


def test_bad_number_lists():
    assert parse_numbers("256, 512", int, "--lengths") == (256, 512)
    with pytest.raises(RuntimeConfigError, match="--lengths"):
        parse_numbers("256,5x", int, "--lengths")


def test_context_too_short_for_the_needle(copy_model_dir):
    with pytest.raises(RuntimeConfigError, match="cannot hold BOS, the 16-token needle"):
        api.evaluate_retrieval(str(copy_model_dir), task="copy", lengths=[24], depths=[0.5], seeds=1)


def test_context_beyond_the_model_limit(copy_model_dir):
    with pytest.raises(RuntimeConfigError, match="context limit"):
        api.evaluate_retrieval(str(copy_model_dir), task="copy", lengths=[2048], depths=[0.5], seeds=1)


@pytest.mark.parametrize("kwargs, error, needle", [
    ({"task": "passkey"}, DataError, "--data"),
    ({"task": "passkey", "data": str(SHARED / "data/text/tinystories_val_head.txt")}, ModelError, "--task copy"),  # no tokenizer
    ({"task": "copy", "facts": 2}, RuntimeConfigError, "--facts"),
    ({"task": "needle"}, RuntimeConfigError, "--task"),
])
def test_bad_requests(copy_model_dir, kwargs, error, needle):
    with pytest.raises(error) as info:
        api.evaluate_retrieval(str(copy_model_dir), lengths=[64], depths=[0.5], seeds=1, **kwargs)
    assert needle in str(info.value)
    assert isinstance(info.value, KvtoolError)


# --- passkey prompts (kvref-5m's tokenizer; the model itself cannot retrieve) ------------------


@pytest.fixture(scope="module")
def kvref_tokenizer():
    from kvtool.models.loading import load_tokenizer

    return load_tokenizer(str(shared_path("models/kvref-5m")))


def held_out_text() -> DataSpec:
    return DataSpec.parse(f"{shared_path('data/text/tinystories_val_head.txt')}[0.9:1]")


@pytest.mark.parametrize("facts", [1, 3])
def test_passkey_prompts(kvref_tokenizer, facts):
    task = PasskeyTask(kvref_tokenizer, text_filler(kvref_tokenizer, held_out_text()), facts)
    prompts, keys = task.cases(200, 0.5, 3)
    assert prompts.shape == (3, 200) and len(set(keys)) == 3
    question = task.question_tokens(200, 3)
    for row in prompts:  # the question is the prompt's tail: "\nWhat is the pass key..." (names vary in length)
        assert "\nWhat is" in kvref_tokenizer.decode(row[-question:])
        assert "What is" not in kvref_tokenizer.decode(row[:-question])
    for row, key in zip(prompts, keys):
        text = kvref_tokenizer.decode(row, skip_special_tokens=True)
        assert text.count(f"is {key}. Remember it. {key} is the pass key") == 1
        assert text.endswith("is") and "\nWhat is the pass key" in text
        sentence = text.rfind("The pass key", 0, text.index(f"is {key}."))
        assert 0.25 < sentence / len(text) < 0.75  # near depth 0.5
        assert re.search(r"(^|[.!?][\"')\]]*\s*|\n\s*)$", text[:sentence]), text[:sentence][-30:]  # at a sentence boundary
    digits = torch.tensor([kvref_tokenizer(f" {keys[0]}.", add_special_tokens=False)["input_ids"]])
    assert task.score(digits, keys[:1]) == [True]
    assert task.score(digits, keys[1:2]) == [False]


def test_passkey_through_the_api(tmp_path):
    """kvref-5m cannot retrieve (see its README), so this checks the plumbing, not accuracy."""
    report = api.evaluate_retrieval(str(shared_path("models/kvref-5m")), task="passkey", data=held_out_text(),
                                    lengths=[96], depths=[1.0], seeds=2, baseline=False)
    assert report["baseline_accuracy"] is None and 0.0 <= report["accuracy"] <= 1.0
    assert report["data"]["start"] == 0.9 and report["facts"] == 1
