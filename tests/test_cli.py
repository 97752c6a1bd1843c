"""Tests for the kvtool command line (`kvtool.cli`).

The CLI is a translation layer (options -> one `kvtool.api` call -> Rich output), so most
tests replace the API function with a fake that records its arguments and returns a small
result for the renderers, in the style of fastapi-cli's tests. Commands import
``from kvtool import api`` inside their bodies, so patching attributes of the `kvtool.api`
module (and `kvtool.pipeline.run_pipeline` for ``run``) is enough.

Then: errors a user can hit exit with status 2 and one 'error:' line on stderr, without a
traceback (faked and real bad input), and one real end-to-end run on the tiny stories260K
model (no mocks).

The installed typer's CliRunner keeps the streams apart: ``result.stdout``, ``result.stderr``,
and ``result.output`` with both interleaved. Rich wraps output at 80 columns under it, so text
checks ignore whitespace (`shows`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import kvtool.pipeline
from kvtool import api
from kvtool.api import GenerateResult, LoadOptions
from kvtool.artifact import Artifact, save_artifact
from kvtool.cli import app
from kvtool.data import DataSpec
from kvtool.errors import (
    ArtifactError,
    DataError,
    KvtoolError,
    ModelError,
    RecipeError,
    RuntimeConfigError,
)
from kvtool.hub import check_hub_reachable as REAL_HUB_CHECK
from tests.conftest import shared_path


def stories() -> str:
    """The tiny real model (context 512, head_dim 8, 4 KV heads); skips the test without ../shared."""
    return str(shared_path("models/stories260K"))


def stories_data() -> str:
    return f"{shared_path('data/text/tinystories_val_head.txt')}[0:0.05]"


runner = CliRunner()


@pytest.fixture(scope="session", autouse=True)
def _datasets_cache(tmp_path_factory):
    """Keep the arrow caches datasets writes for test files out of the user's home cache."""
    import datasets

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))
        yield


@pytest.fixture(autouse=True)
def _data_files(tmp_path, monkeypatch):
    """Run every test in a folder holding the small text files the fakes name (the CLI checks --data first)."""
    import kvtool.hub

    monkeypatch.setattr(kvtool.hub, "check_hub_reachable", lambda model_id: None)  # fake ids such as 'm' pass
    monkeypatch.chdir(tmp_path)
    for name in ("f.txt", "file.txt", "book.jsonl"):
        (tmp_path / name).write_text("Some text to read.\n")


# --- helpers ----------------------------------------------------------------------------------


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def ok(result) -> None:
    """Assert exit 0; on failure show the output and the exception."""
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output


def _squash(text: str) -> str:
    """Text without whitespace. Rich wraps long lines (see test_error_message_is_one_line)."""
    return "".join(text.split())


def shows(text: str, *needles: str) -> bool:
    """Every needle appears in text, ignoring whitespace (Rich wraps at 80 columns under CliRunner)."""
    flat = _squash(text)
    return all(_squash(needle) in flat for needle in needles)


def assert_friendly_error(result, *needles: str) -> None:
    """Exit 2, an 'error:' message on stderr naming each needle, no traceback, nothing uncaught."""
    assert result.exit_code == 2, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert result.stderr.startswith("error: "), result.stderr
    assert result.stderr.count("error:") == 1, result.stderr
    assert "error:" not in result.stdout
    for needle in needles:
        assert _squash(needle) in _squash(result.stderr), f"{needle!r} not in {result.stderr!r}"


class Recorder:
    """Replaces API functions with fakes that record (args, kwargs) and return a given result."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.calls: dict[str, list[tuple[tuple, dict]]] = {}

    def patch(self, name: str, result=None, target=api, raises: Exception | None = None, effect=None):
        def fake(*args, **kwargs):
            self.calls.setdefault(name, []).append((args, kwargs))
            if effect is not None:
                effect(*args, **kwargs)
            if raises is not None:
                raise raises
            return result

        self.monkeypatch.setattr(target, name, fake)

    def one(self, name: str) -> tuple[tuple, dict]:
        assert len(self.calls.get(name, [])) == 1, self.calls
        return self.calls[name][0]


@pytest.fixture
def rec(monkeypatch):
    return Recorder(monkeypatch)


# --- small fake results (just what the renderers read) -----------------------------------------


def fake_profile() -> Artifact:
    tensors = {}
    for layer in range(2):
        tensors[f"layers.{layer}.keys_pre_rope.absmax"] = torch.full((2, 4), 3.0)
        tensors[f"layers.{layer}.keys.absmax"] = torch.full((2, 4), 2.0)
        tensors[f"layers.{layer}.keys.token_norm"] = torch.tensor([1.5, 2.5])
        tensors[f"layers.{layer}.values.absmax"] = torch.full((2, 4), 1.0)
        tensors[f"layers.{layer}.values.token_norm"] = torch.tensor([0.5, 0.75])
    return Artifact(kind="profile", manifest={}, tensors=tensors)


def fake_calibration() -> Artifact:
    tensors = {f"quality.layers.{layer}.{part}.sqnr_db": torch.tensor([20.0 + layer, 30.0])
               for layer in range(2) for part in ("keys", "values")}
    manifest = {
        "quality": {"keys_sqnr_db": 31.25, "values_sqnr_db": 22.5},
        "expected_bits_per_element": {"keys": 4.5, "values": 5.0, "body": 4.75},
    }
    return Artifact(kind="calibration", manifest=manifest, tensors=tensors)


def fake_deployable() -> Artifact:
    return Artifact(kind="deployable", manifest={"expected_bits_per_element": {"keys": 4.0, "values": 4.5, "body": 4.25}},
                    tensors={"a": torch.zeros(1), "b": torch.zeros(2), "c": torch.zeros(3)})


MEMORY = {"tokens": 12, "batch": 1, "cache_bytes": 1024, "fp16_cache_bytes": 4096,
          "compression_ratio": 4.0, "bits_per_element": 4.0}


def fake_generation(texts: list[str]) -> GenerateResult:
    return GenerateResult(texts=texts, prompt_tokens=4, new_tokens=8, seconds=0.5, tokens_per_s=16.0,
                          memory={**MEMORY, "batch": len(texts)})


def fake_report() -> dict:
    return {
        "recipe": "kivi-4bit", "data": {"source": "x.txt"}, "ppl": 10.5, "nll": 2.35, "scored_tokens": 100,
        "windows": 2, "seq_len": 64, "prefill": 32, "chunk": 1, "exact_decoding": True,
        "cache_bytes": 1000, "fp16_cache_bytes": 4000, "bits_per_element": 4.0, "bytes_per_token": 10.0,
        "decode_tokens_per_s": 50.0, "decode_tokens_per_s_median": 51.0, "decode_tokens_per_s_best": 70.0,
        "decode_steps": 31, "baseline": "16-bit cache", "compression_ratio": 4.0,
        "baseline_ppl": 10.0, "baseline_cache_bytes": 4000, "baseline_bits_per_element": 16.0,
        "baseline_bytes_per_token": 40.0, "baseline_decode_tokens_per_s": 60.0,
        "baseline_decode_tokens_per_s_median": 61.0, "baseline_decode_tokens_per_s_best": 80.0, "delta_pct": 5.0,
        "model_dtype": "float32", "model_dtype_ppl": 10.001, "model_dtype_delta_pct": 0.01,
        "model_dtype_cache_bytes": 8000, "model_dtype_bits_per_element": 32.0, "model_dtype_bytes_per_token": 80.0,
        "model_dtype_decode_tokens_per_s": 58.0, "model_dtype_decode_tokens_per_s_median": 59.0,
        "model_dtype_decode_tokens_per_s_best": 79.0,
    }


def fake_summary() -> dict:
    return {
        "recipe": {"name": "kivi-4bit"},
        "files": {"profile": "out/profile.safetensors"},
        "calibration_quality": {},
        "expected_bits_per_element": {"keys": 4.5, "values": 5.0, "body": 4.75},
        "perplexity": fake_report(),
        "sample": {"prompt": "Once upon a time", "text": " there was a fox", "tokens_per_s": 9.0, "memory": MEMORY},
    }


def fake_retrieval_report() -> dict:
    return {
        "task": "copy", "recipe": "kivi-4bit", "lengths": [64], "depths": [0.0], "seeds": 1,
        "grid": [{"n": 64, "depth": 0.0, "accuracy": 1.0, "baseline_accuracy": 1.0}],
        "accuracy": 1.0, "baseline_accuracy": 1.0, "kept_fraction": 1.0, "cache_bytes": 1024,
        "baseline_cache_bytes": 4096, "fp16_cache_bytes": 4096, "baseline": "16-bit cache",
    }


def fake_inspect_info() -> dict:
    return {
        "path": "a.safetensors", "kind": "deployable",
        "manifest": {"kvtool_version": "0.1", "model_source": "m", "model": {"family": "llama", "num_layers": 2},
                     "recipe": {"name": "kivi-4bit"}},
        "tensors": {"layers.0.keys.sqnr_db": {"shape": [2], "dtype": "float32"}},
    }


# --- translation: profile ----------------------------------------------------------------------


def test_profile_translates_options(rec, tmp_path):
    rec.patch("profile", fake_profile())
    out = tmp_path / "p.safetensors"
    result = invoke("profile", "--data", "book.jsonl[0:0.5]", "--out", out, "--model", "some/model",
                    "--samples", 3, "--seq-len", 128, "--seed", 7, "--batch-size", 2, "--text-column", "body",
                    "--dtype", "float16", "--device", "cuda:1", "--device-map", "auto")
    ok(result)
    args, kwargs = rec.one("profile")
    assert args == (DataSpec("book.jsonl", "body", 0.0, 0.5), out, "some/model")
    assert {k: kwargs[k] for k in ("samples", "seq_len", "seed", "batch_size")} == {
        "samples": 3, "seq_len": 128, "seed": 7, "batch_size": 2}
    assert kwargs["load"] == LoadOptions(dtype="float16", device="cuda:1", device_map="auto")
    assert callable(kwargs["progress"])
    assert shows(result.stdout, "K/V statistics per layer", "wrote profile", str(out))


def test_profile_defaults_and_short_options(rec, tmp_path):
    rec.patch("profile", fake_profile())
    ok(invoke("profile", "-d", "file.txt[0.9:1]", "-o", tmp_path / "p.safetensors"))
    args, kwargs = rec.one("profile")
    spec = args[0]
    assert isinstance(spec, DataSpec)
    assert (spec.source, spec.text_column, spec.start, spec.end) == ("file.txt", "text", 0.9, 1.0)
    assert args[2] is None  # no --model: the API picks the embedded default
    assert {k: kwargs[k] for k in ("samples", "seq_len", "seed", "batch_size")} == {
        "samples": 8, "seq_len": 512, "seed": 0, "batch_size": 4}
    assert kwargs["load"] == LoadOptions()


# --- translation: calibrate --------------------------------------------------------------------


def test_calibrate_translates_options(rec, tmp_path):
    rec.patch("calibrate", fake_calibration())
    out = tmp_path / "c.safetensors"
    result = invoke("calibrate", "-d", "file.txt[0.9:1]", "-o", out, "-m", "m", "-r", "kivi-2bit",
                    "--samples", 2, "--seq-len", 128, "--seed", 3, "--batch-size", 1, "--dtype", "bfloat16")
    ok(result)
    args, kwargs = rec.one("calibrate")
    assert args == (DataSpec("file.txt", "text", 0.9, 1.0), out, "m", "kivi-2bit")
    assert args[0].start == 0.9
    assert {k: kwargs[k] for k in ("samples", "seq_len", "seed", "batch_size")} == {
        "samples": 2, "seq_len": 128, "seed": 3, "batch_size": 1}
    assert kwargs["load"] == LoadOptions(dtype="bfloat16")
    assert shows(result.stdout, "Quantization SQNR per layer", "keys 31.2 dB", "values 22.5 dB", "4.75 bits",
                 "wrote calibration", str(out))


def test_calibrate_leaves_recipe_settings_to_the_recipe(rec, tmp_path):
    """Without --samples/--seq-len/--seed the API gets None, so the recipe's calibration section applies."""
    rec.patch("calibrate", fake_calibration())
    ok(invoke("calibrate", "-d", "f.txt", "-o", tmp_path / "c.safetensors"))
    args, kwargs = rec.one("calibrate")
    assert args[2:] == (None, None)  # model, recipe
    assert kwargs["samples"] is None and kwargs["seq_len"] is None and kwargs["seed"] is None
    assert kwargs["batch_size"] == 4


# --- translation: export -----------------------------------------------------------------------


def test_export_translates_options(rec, tmp_path):
    rec.patch("export", fake_deployable())
    calib, out, prof = tmp_path / "c.safetensors", tmp_path / "a.safetensors", tmp_path / "p.safetensors"
    result = invoke("export", "-c", calib, "-o", out, "-m", "m", "-p", prof, "--device", "cuda")
    ok(result)
    args, kwargs = rec.one("export")
    assert args == (calib, out, "m", prof)
    assert kwargs == {"format": "kvtool", "load": LoadOptions(device="cuda")}
    assert shows(result.stdout, "wrote artifact", "3 tensors", "4.25 bits per body element")


def test_export_format_vllm_is_passed_through(rec, tmp_path):
    rec.patch("export", fake_deployable())
    result = invoke("export", "-c", tmp_path / "c.safetensors", "-o", tmp_path / "served", "--format", "vllm")
    ok(result)
    _, kwargs = rec.one("export")
    assert kwargs["format"] == "vllm"
    assert shows(result.stdout, "wrote vLLM model folder", "--kv-cache-dtype fp8")


def test_export_without_profile_or_model(rec, tmp_path):
    rec.patch("export", fake_deployable())
    ok(invoke("export", "--calib", tmp_path / "c.safetensors", "--out", tmp_path / "a.safetensors"))
    args, _ = rec.one("export")
    assert args[2:] == (None, None)


# --- translation: generate ---------------------------------------------------------------------


def test_generate_one_prompt_streams(rec, tmp_path):
    rec.patch("generate", fake_generation([" and a fox."]),
              effect=lambda *a, on_text=None, **k: (on_text(" and a"), on_text(" fox.")))
    artifact = tmp_path / "a.safetensors"
    result = invoke("generate", "--prompt", "Once upon a time", "-a", artifact, "-m", "m", "-n", 8, "--greedy", "--seed", 5)
    ok(result)
    args, kwargs = rec.one("generate")
    assert args == (["Once upon a time"], "m", artifact, None)
    assert kwargs["max_new_tokens"] == 8 and kwargs["do_sample"] is False and kwargs["seed"] == 5
    assert callable(kwargs["on_text"])  # one prompt: streamed
    assert kwargs["load"] == LoadOptions()
    assert result.stdout.startswith("Once upon a time and a fox.")
    assert shows(result.stdout, "KV cache", "4.00x", "16.0 tokens/s")


def test_generate_repeated_prompt_is_a_batch(rec):
    rec.patch("generate", fake_generation([" one", " two"]))
    result = invoke("generate", "--prompt", "A", "--prompt", "B", "-r", "kivi-2bit", "--sample",
                    "--temperature", 0.7, "--top-p", 0.9, "--max-new-tokens", 5)
    ok(result)
    args, kwargs = rec.one("generate")
    assert args == (["A", "B"], None, None, "kivi-2bit")
    assert kwargs["do_sample"] is True and kwargs["temperature"] == 0.7 and kwargs["top_p"] == 0.9
    assert kwargs["max_new_tokens"] == 5
    assert kwargs["on_text"] is None  # a batch is printed at the end, not streamed
    assert shows(result.stdout, "A one", "B two", "8 new tokens x 2")


def test_generate_defaults_to_greedy(rec):
    rec.patch("generate", fake_generation(["x"]))
    ok(invoke("generate", "--prompt", "hi"))
    _, kwargs = rec.one("generate")
    assert kwargs["do_sample"] is False and kwargs["max_new_tokens"] == 64
    assert kwargs["temperature"] == 1.0 and kwargs["top_p"] == 1.0 and kwargs["seed"] == 0


def test_generate_prompt_file_is_appended(rec, tmp_path):
    rec.patch("generate", fake_generation(["x", "y"]))
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("From a file\nwith two lines")
    ok(invoke("generate", "--prompt", "inline", "--prompt-file", prompt_file))
    args, _ = rec.one("generate")
    assert args[0] == ["inline", "From a file\nwith two lines"]


# --- translation: eval ppl ---------------------------------------------------------------------


def test_eval_ppl_translates_options_and_writes_json(rec, tmp_path):
    rec.patch("evaluate_perplexity", fake_report())
    artifact, json_path = tmp_path / "a.safetensors", tmp_path / "sub" / "out.json"
    result = invoke("eval", "ppl", "--data", "file.txt[0.9:1]", "-m", "m", "-a", artifact, "--samples", 2,
                    "--seq-len", 128, "--prefill", 32, "--chunk", 4, "--batch-size", 1, "--no-baseline",
                    "--json", json_path, "--text-column", "t")
    ok(result)
    args, kwargs = rec.one("evaluate_perplexity")
    assert args == (DataSpec("file.txt", "t", 0.9, 1.0), "m", artifact, None)
    assert {k: kwargs[k] for k in ("samples", "seq_len", "prefill", "chunk", "batch_size", "baseline")} == {
        "samples": 2, "seq_len": 128, "prefill": 32, "chunk": 4, "batch_size": 1, "baseline": False}
    assert kwargs["load"] == LoadOptions() and callable(kwargs["progress"])
    report = json.loads(json_path.read_text())
    for key in ("baseline_ppl", "ppl", "bits_per_element", "cache_bytes", "baseline_cache_bytes"):
        assert key in report
    assert report == fake_report()
    assert "wrote" in result.stderr
    assert shows(result.stdout, "10.500", "+5.00%", "16-bit (baseline)", "10.000", "float32 (model dtype)", "10.001",
                 "0.50x", "4.00x", "51.0 / 70.0", "61.0 / 80.0", "median / best of 31 steps", "true decoding")


def test_eval_ppl_and_generate_pass_the_profile_and_show_the_kept_fraction(rec, tmp_path):
    profile = tmp_path / "p.safetensors"
    rec.patch("evaluate_perplexity", {**fake_report(), "recipe": "h2o", "kept_fraction": 0.25})
    result = invoke("eval", "ppl", "--data", "file.txt", "--recipe", "fastgen-t95", "--profile", profile)
    ok(result)
    _, kwargs = rec.one("evaluate_perplexity")
    assert kwargs["profile"] == profile
    assert shows(result.stdout, "kept", "25.0%", "100.0%")
    rec.patch("generate", fake_generation(["x"]))
    ok(invoke("generate", "--prompt", "hi", "--recipe", "h2o", "-p", profile))
    _, kwargs = rec.one("generate")
    assert kwargs["profile"] == profile


def test_eval_ppl_defaults(rec):
    rec.patch("evaluate_perplexity", fake_report())
    result = invoke("eval", "ppl", "-d", "f.txt", "-r", "int8")
    ok(result)
    args, kwargs = rec.one("evaluate_perplexity")
    assert args == (DataSpec("f.txt"), None, None, "int8")
    assert {k: kwargs[k] for k in ("samples", "seq_len", "prefill", "chunk", "batch_size", "baseline")} == {
        "samples": 4, "seq_len": 1024, "prefill": None, "chunk": 1, "batch_size": 4, "baseline": True}
    assert kwargs["model_dtype"] is True
    assert "wrote" not in result.stderr  # no --json, no file


def test_eval_ppl_without_baseline_renders(rec):
    report = {k: v for k, v in fake_report().items()
              if not k.startswith(("baseline_", "model_dtype")) and k != "delta_pct"}
    report.update(chunk=8, exact_decoding=False)
    rec.patch("evaluate_perplexity", report)
    result = invoke("eval", "ppl", "-d", "f.txt", "--no-baseline", "--chunk", 8)
    ok(result)
    assert "(baseline)" not in result.stdout and "(model dtype)" not in result.stdout  # no baseline rows
    assert shows(result.stdout, "APPROXIMATE: chunks of 8 tokens")


def test_eval_ppl_shows_the_paired_interval_of_the_delta(rec):
    rec.patch("evaluate_perplexity", {**fake_report(), "delta_ci95_pct": [1.25, 9.5], "delta_blocks": 8})
    result = invoke("eval", "ppl", "-d", "f.txt")
    ok(result)
    assert shows(result.stdout, "delta 95% interval") and shows(result.stdout, "+1.25 .. +9.50%")
    rec.patch("evaluate_perplexity", fake_report())  # an older report (or one block): no interval row
    assert "95% interval" not in invoke("eval", "ppl", "-d", "f.txt").stdout


# --- --backend on generate and every eval command -----------------------------------------------


@pytest.mark.parametrize("argv, api_name, result", [
    (("generate", "--prompt", "hi"), "generate", fake_generation(["x"])),
    (("eval", "ppl", "-d", "f.txt"), "evaluate_perplexity", fake_report()),
    (("eval", "retrieval", "--task", "copy"), "evaluate_retrieval", None),  # result set in the test
])
@pytest.mark.parametrize("backend", [None, "torch", "triton", "numba"])
def test_backend_option_reaches_the_api(rec, argv, api_name, result, backend):
    rec.patch(api_name, fake_retrieval_report() if result is None else result)
    ok(invoke(*argv, *(("--backend", backend) if backend else ())))
    _, kwargs = rec.one(api_name)
    assert kwargs["backend"] == (backend or "auto")


def test_generate_and_eval_show_the_backend_and_reserved_bytes(rec):
    rec.patch("generate", GenerateResult(texts=["x"], prompt_tokens=4, new_tokens=8, seconds=0.5, tokens_per_s=16.0,
                                         memory={**MEMORY, "reserved_bytes": 3 * 2**20, "backend": "torch"}))
    result = invoke("generate", "--prompt", "hi")
    ok(result)
    assert shows(result.stdout, "KV cache (torch backend)", "reserved", "1.0 KiB", "3.00 MiB")
    rec.patch("evaluate_perplexity", {**fake_report(), "backend": "torch", "reserved_cache_bytes": 2**20})
    result = invoke("eval", "ppl", "-d", "f.txt")
    ok(result)
    assert shows(result.stdout, "cache held", "cache reserved", "1.00 MiB", "torch backend")
    rec.patch("evaluate_retrieval", {**fake_retrieval_report(), "backend": "torch", "reserved_cache_bytes": 2**20})
    result = invoke("eval", "retrieval", "--task", "copy")
    ok(result)
    assert shows(result.stdout, "(1.00 MiB reserved)", "torch backend")


@pytest.mark.parametrize("argv", [("generate", "--prompt", "hi", "-m", "stories"),
                                  ("eval", "ppl", "-d", "f.txt", "-r", "kivi-4bit", "-m", "stories"),
                                  ("eval", "retrieval", "--task", "copy", "-m", "stories")])
def test_backend_triton_is_one_error_line_before_the_model_loads(monkeypatch, argv):
    """Real API, no model on disk needed: the backend is refused before anything loads."""
    import kvtool.api

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the backend was checked")

    monkeypatch.setattr(kvtool.api, "_load", no_load)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU without the interpreter: the kernels cannot run
    result = invoke(*argv, "--backend", "triton")
    assert_friendly_error(result, "--backend triton", "needs a CUDA GPU", "--backend torch")
    result = invoke(*argv, "--backend", "cuda-graphs")
    assert_friendly_error(result, "--backend 'cuda-graphs' is unknown", "auto, torch, triton")


# --- translation: inspect, recipes, run --------------------------------------------------------


def test_inspect_translates_and_renders(rec):
    rec.patch("inspect", fake_inspect_info())
    result = invoke("inspect", "a.safetensors")
    ok(result)
    assert rec.one("inspect")[0] == (Path("a.safetensors"),)
    assert shows(result.stdout, "deployable artifact", "layers.0.keys.sqnr_db")


def test_inspect_json_prints_parseable_json(rec):
    rec.patch("inspect", fake_inspect_info())
    result = invoke("inspect", "a.safetensors", "--json")
    ok(result)
    assert json.loads(result.stdout) == fake_inspect_info()


def wide_console(monkeypatch) -> None:
    """Table cells unwrapped (the CliRunner console is 80 columns), so whole phrases can be checked."""
    import kvtool.cli

    monkeypatch.setattr(kvtool.cli.console, "width", 300)


def test_recipes_lists_bundled_recipes(monkeypatch):
    wide_console(monkeypatch)
    result = invoke("recipes")
    ok(result)
    for name in ("kivi-4bit", "kivi-2bit", "int8", "uncompressed", "ablation/nuq3", "h2o"):
        assert shows(result.stdout, name)
    # what each really does: quantizer and window for KIVI, policy and budget for eviction (not a made-up window)
    assert shows(result.stdout, "uniform 4-bit per channel", "4 sink + 64 recent float16", "h2o: keep 50%, 4 sink + 32 recent",
                 "fastgen T=0.95", "needs a profile", "nuq 3-bit per channel")


def test_inspect_shows_what_the_recipe_does(rec, monkeypatch):
    from kvtool.recipe import load_recipe

    wide_console(monkeypatch)
    info = fake_inspect_info()
    info["manifest"]["recipe"] = load_recipe("kvquant-3bit-1pct").to_dict()
    rec.patch("inspect", info)
    result = invoke("inspect", "a.safetensors")
    ok(result)
    assert shows(result.stdout, "kvquant-3bit-1pct", "nuq 3-bit per channel", "1% outliers", "pre-RoPE")
    assert "rank_fraction" not in result.stdout and "codebook" not in result.stdout  # no raw dict of inapplicable fields


def test_run_translates_options(rec, tmp_path):
    rec.patch("run_pipeline", fake_summary(), target=kvtool.pipeline,
              effect=lambda *a, log, **k: log("profile step"))
    out_dir = tmp_path / "run"
    result = invoke("run", "-d", "file.txt[0:0.5]", "-o", out_dir, "-m", "m", "-r", "kivi-2bit",
                    "--calib-fraction", 0.8, "--samples", 2, "--seq-len", 64, "--eval-samples", 3,
                    "--eval-seq-len", 96, "--prompt", "Hello", "-n", 5, "--dtype", "float32")
    ok(result)
    args, kwargs = rec.one("run_pipeline")
    assert args == ("file.txt[0:0.5]", out_dir, "m", "kivi-2bit")  # run_pipeline splits the spec itself
    expected = {"calib_fraction": 0.8, "samples": 2, "seq_len": 64, "eval_samples": 3, "eval_seq_len": 96,
                "prompt": "Hello", "max_new_tokens": 5, "load": LoadOptions(dtype="float32")}
    assert {k: kwargs[k] for k in expected} == expected
    assert callable(kwargs["progress"]) and callable(kwargs["log"])
    assert "profile step" in result.stderr
    assert shows(result.stdout, "kvtool run: kivi-4bit", "4.00x smaller", "there was a fox")


def test_run_defaults(rec):
    rec.patch("run_pipeline", fake_summary(), target=kvtool.pipeline)
    ok(invoke("run", "-d", "f.txt"))
    args, kwargs = rec.one("run_pipeline")
    assert args == ("f.txt", Path("kvtool-run"), None, None)
    expected = {"calib_fraction": 0.9, "samples": 8, "seq_len": 512, "eval_samples": 4, "eval_seq_len": 512,
                "prompt": "Once upon a time", "max_new_tokens": 128, "load": LoadOptions()}
    assert {k: kwargs[k] for k in expected} == expected


# --- errors raised by the API ------------------------------------------------------------------

# command line, function name, module that holds it
COMMANDS = {
    "profile": (["profile", "-d", "f.txt", "-o", "p.safetensors"], "profile", api),
    "calibrate": (["calibrate", "-d", "f.txt", "-o", "c.safetensors"], "calibrate", api),
    "export": (["export", "-c", "c.safetensors", "-o", "a.safetensors"], "export", api),
    "generate": (["generate", "--prompt", "hi"], "generate", api),
    "eval ppl": (["eval", "ppl", "-d", "f.txt"], "evaluate_perplexity", api),
    "inspect": (["inspect", "a.safetensors"], "inspect", api),
    "run": (["run", "-d", "f.txt"], "run_pipeline", kvtool.pipeline),
}
ERRORS = [KvtoolError, RecipeError, DataError, ModelError, ArtifactError, RuntimeConfigError]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_kvtool_errors_exit_2_with_one_line(rec, command, error):
    argv, name, target = COMMANDS[command]
    rec.patch(name, target=target, raises=error(f"the {error.__name__} problem"))
    result = invoke(*argv)
    assert_friendly_error(result, f"the {error.__name__} problem")
    assert result.stderr == f"error: the {error.__name__} problem\n"  # short message: exactly one line


def test_unexpected_exceptions_are_not_swallowed(rec):
    """Only KvtoolError is turned into a friendly message; bugs keep their exception."""
    rec.patch("inspect", raises=ValueError("a bug"))
    result = invoke("inspect", "a.safetensors")
    assert result.exit_code == 1 and isinstance(result.exception, ValueError)


def test_error_message_is_one_line(rec):
    message = "artifact '" + "/very/long/path" * 8 + "/model.kvt.safetensors' does not exist"
    rec.patch("inspect", raises=ArtifactError(message))
    result = invoke("inspect", "x.safetensors")
    assert result.exit_code == 2
    assert result.stderr == f"error: {message}\n"


# --- usage errors (Click's parsing): one line too ------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["generate", "--foo"], "error: no such option --foo; see kvtool generate --help"),
    (["generate", "--prompt", "hi", "--sampel"],
     "error: no such option --sampel (did you mean --model or --sample?); see kvtool generate --help"),
    (["eval", "ppl"], "error: missing option '--data' / '-d'; see kvtool eval ppl --help"),
    (["eval", "ppl", "-d", "f.txt", "extra"], "error: got unexpected extra argument(s) (extra); see kvtool eval ppl --help"),
    (["eval", "ppl", "--dtype"], "error: option '--dtype' requires an argument; see kvtool eval ppl --help"),
    (["profile", "-d", "f.txt", "-o", "p.safetensors", "--samples", "abc"],
     "error: invalid value for '--samples': input should be a valid integer"),
    (["inspect"], "error: missing argument 'artifact'; see kvtool inspect --help"),
    (["nosuch"], "error: no such command 'nosuch'; see kvtool --help"),
    (["eval", "nosuch"], "error: no such command 'nosuch'; see kvtool eval --help"),
])
def test_usage_errors_are_one_line_with_exit_2(argv, message):
    result = invoke(*argv)
    assert_friendly_error(result)
    assert result.stderr.startswith(message), result.stderr
    assert result.stderr.count("\n") == 1 and "Usage:" not in result.output and "╭" not in result.output


def test_usage_error_through_the_entry_point():
    """`main()` (the console script) names the program kvtool whatever argv[0] is."""
    import subprocess
    import sys

    code = "import sys; sys.argv[0] = 'whatever'; from kvtool.cli import main; main()"
    done = subprocess.run([sys.executable, "-c", code, "generate", "--foo"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert done.returncode == 2
    assert done.stderr == "error: no such option --foo; see kvtool generate --help\n"


@pytest.mark.parametrize("argv", [[], ["eval"]])
def test_no_arguments_show_the_help(argv):
    result = invoke(*argv)
    assert result.exit_code == 2 and "Usage" in result.stdout and "error" not in result.output


# --- errors from real bad input (no mocks) -----------------------------------------------------


def test_inspect_missing_file(tmp_path):
    result = invoke("inspect", tmp_path / "missing.safetensors")
    assert_friendly_error(result, "missing.safetensors", "does not exist")


def test_inspect_truncated_file(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_artifact(path, Artifact(kind="profile", manifest={"model": {}}, tensors={"x": torch.arange(256.0)}))
    ok(invoke("inspect", path))  # intact: readable
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])
    result = invoke("inspect", path)
    assert_friendly_error(result, "cut.safetensors", "truncated")


def test_inspect_not_an_artifact(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("just some text, not safetensors")
    assert_friendly_error(invoke("inspect", path), "notes.txt", "not a readable safetensors file")


def test_calibrate_empty_data(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = invoke("calibrate", "--data", empty, "-o", tmp_path / "c.safetensors", "--samples", 1, "--seq-len", 16)
    assert_friendly_error(result, "empty.txt")
    assert not (tmp_path / "c.safetensors").exists()


def test_calibrate_bad_recipe(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("name: bad\nkeys: {method: uniform, bits: 5, axis: channel}\n")
    result = invoke("calibrate", "-d", "f.txt", "-o", tmp_path / "c.safetensors", "--recipe", recipe)
    assert_friendly_error(result, "keys.bits", "5", "[2, 3, 4, 8]")


def test_calibrate_unknown_recipe_name(tmp_path):
    result = invoke("calibrate", "-d", "f.txt", "-o", tmp_path / "c.safetensors", "-r", "no-such-recipe")
    assert_friendly_error(result, "no-such-recipe", "not found", "kivi-4bit")


def test_generate_without_prompt():
    assert_friendly_error(invoke("generate"), "--prompt", "--prompt-file")


def test_generate_missing_prompt_file(tmp_path):
    result = invoke("generate", "--prompt-file", tmp_path / "missing.txt")
    assert_friendly_error(result, "missing.txt", "does not exist")


def test_generate_empty_prompt_file(tmp_path):
    path = tmp_path / "blank.txt"
    path.write_text("  \n")
    assert_friendly_error(invoke("generate", "--prompt-file", path), "blank.txt", "empty")


def test_eval_seq_len_beyond_context(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a little cat.\n" * 20)
    result = invoke("eval", "ppl", "-d", text, "--seq-len", 4096, "--samples", 1)
    assert_friendly_error(result, "4096", "context limit of 2048")


def test_generate_beyond_context_names_its_own_options():
    result = invoke("generate", "--prompt", "Once upon a time", "-m", stories(), "-n", 600)
    assert_friendly_error(result, "--max-new-tokens 600", "context limit of 512")
    assert "--seq-len" not in result.stderr


@pytest.mark.parametrize("spec, needle", [("f.txt[0.5:0.2]", "invalid"), ("f.txt[a:1]", "not a number"),
                                         ("f.txt[abc]", "slice in 'f.txt[abc]' is malformed"),
                                         ("f.txt[0.9:1", "malformed")])
def test_bad_data_slice(tmp_path, spec, needle):
    result = invoke("profile", "-d", spec, "-o", tmp_path / "p.safetensors")
    assert_friendly_error(result, needle)


@pytest.mark.parametrize("argv", [
    ("profile", "-o", "p.safetensors"), ("calibrate", "-o", "c.safetensors"), ("eval", "ppl"),
    ("eval", "retrieval", "--task", "passkey"), ("run",),
])
@pytest.mark.parametrize("data, needle", [("missing.txt", "does not exist"), ("empty.txt", "is empty (0 bytes)"),
                                          ("f.txt[abc]", "malformed"), ("table.csv", "unsupported extension")])
def test_bad_data_fails_before_anything_loads(rec, monkeypatch, argv, data, needle):
    """Bad --data is one error line before the API (torch, the model) is reached."""
    Path("empty.txt").write_text("")
    Path("table.csv").write_text("a,b\n")
    for name in ("profile", "calibrate", "evaluate_perplexity", "evaluate_retrieval"):
        rec.patch(name, raises=AssertionError("the API was called before --data was checked"))
    rec.patch("run_pipeline", target=kvtool.pipeline, raises=AssertionError("the pipeline ran before --data was checked"))
    assert_friendly_error(invoke(*argv, "-d", data), needle)


@pytest.mark.parametrize("argv, needles", [
    (("profile", "-d", "f.txt", "-o", "p.safetensors", "--seq-len", "600"), ("--seq-len 600", "512 positions", "lower --seq-len")),
    (("calibrate", "-d", "f.txt", "-o", "c.safetensors", "--seq-len", "600"), ("--seq-len 600", "lower --seq-len")),
    (("eval", "ppl", "-d", "f.txt", "--seq-len", "1024"), ("--seq-len 1024", "512 positions")),
    (("eval", "retrieval", "--task", "copy", "--lengths", "256,4096"), ("--lengths up to 4096", "lower --lengths")),
    (("generate", "--prompt", "hi", "-n", "600"), ("--max-new-tokens 600", "lower --max-new-tokens")),
    (("run", "-d", "f.txt", "--eval-seq-len", "700"), ("--eval-seq-len 700", "512 positions")),
])
def test_context_beyond_the_model_fails_before_anything_loads(rec, argv, needles):
    """The model's context limit is read from its config.json: the API (torch, the model) is never reached."""
    Path("f.txt").write_text("some text\n")
    for name in ("profile", "calibrate", "evaluate_perplexity", "evaluate_retrieval", "generate"):
        rec.patch(name, raises=AssertionError(f"the API ({name}) was called before the context was checked"))
    rec.patch("run_pipeline", target=kvtool.pipeline, raises=AssertionError("the pipeline ran before the context was checked"))
    assert_friendly_error(invoke(*argv, "-m", stories()), *needles, "stories260K")


def test_a_prompt_beyond_the_context_is_counted_with_the_tokenizer_before_the_model_loads(rec):
    rec.patch("generate", raises=AssertionError("the API was called before the prompt was checked"))
    long_prompt = "Once upon a time there was a cat. " * 120  # ~1000 tokens, the model holds 512
    assert_friendly_error(invoke("generate", "--prompt", long_prompt, "-m", stories(), "-n", "8"),
                          "--max-new-tokens 8", "context limit of 512", "shorten the prompt")


def test_a_short_prompt_is_not_tokenized_and_an_artifact_brings_its_own_limit(rec, monkeypatch):
    import kvtool.models.loading

    monkeypatch.setattr(kvtool.models.loading, "load_tokenizer", lambda path: (_ for _ in ()).throw(
        AssertionError("a short prompt was tokenized")))
    rec.patch("generate", fake_generation(["Once upon a time there was"]))
    ok(invoke("generate", "--prompt", "Once upon a time", "-m", stories(), "-n", "8"))
    rec.patch("evaluate_perplexity", fake_report())  # no --model: the artifact's model decides (checked when it loads)
    ok(invoke("eval", "ppl", "-d", "f.txt", "--artifact", "a.kvt.safetensors", "--seq-len", "4096"))


def test_context_limit_of_the_embedded_model_and_of_unreadable_configs(tmp_path):
    from kvtool.context_limit import max_positions

    assert max_positions(None) == 2048  # kvref-5m, embedded
    assert max_positions(str(tmp_path)) is None  # a folder without config.json: the model load says why
    (tmp_path / "config.json").write_text("{not json")
    assert max_positions(str(tmp_path)) is None
    (tmp_path / "config.json").write_text('{"text_config": {"max_position_embeddings": 32768}}')  # Gemma 3 style
    assert max_positions(str(tmp_path)) == 32768
    assert max_positions("nobody/uncached-model") is None  # not cached: nothing to read, no network touched


@pytest.mark.parametrize("argv, needle", [
    (("--task", "bogus"), "--task 'bogus' is unknown"),
    (("--task", "passkey"), "give held-out text with --data"),
    (("--task", "copy", "--depths", "0,2"), "--depths"),
    (("--task", "copy", "--lengths", "a,b"), "--lengths 'a,b'"),
    (("--task", "copy", "--plot", "grid.jpg"), "PNG"),
])
def test_bad_retrieval_request_fails_before_anything_loads(rec, argv, needle):
    rec.patch("evaluate_retrieval", raises=AssertionError("the API was called before the request was checked"))
    assert_friendly_error(invoke("eval", "retrieval", *argv), needle)


def test_bad_recipe_fails_before_anything_loads(rec):
    rec.patch("evaluate_perplexity", raises=AssertionError("the API was called before --recipe was checked"))
    assert_friendly_error(invoke("eval", "ppl", "-d", "f.txt", "-r", "no-such-recipe"), "no-such-recipe")


def test_run_bad_calib_fraction(tmp_path):
    result = invoke("run", "-d", "f.txt", "-o", tmp_path / "run", "--calib-fraction", 1.5)
    assert_friendly_error(result, "--calib-fraction", "1.5")
    assert not (tmp_path / "run").exists()


# Bad values that once escaped as raw exceptions (exit 1, traceback) instead of an 'error:' line.
def test_batch_size_zero_is_a_friendly_error(tmp_path):
    result = invoke("eval", "ppl", "-d", stories_data(), "-m", stories(), "--samples", 1, "--seq-len", 16,
                    "--batch-size", 0, "--no-baseline")
    assert_friendly_error(result, "--batch-size")


def test_sample_temperature_zero_is_a_friendly_error():
    result = invoke("generate", "--prompt", "hi", "-m", stories(), "-n", 2, "--sample", "--temperature", 0)
    assert_friendly_error(result, "temperature")


def test_out_is_a_directory_is_a_friendly_error(rec, tmp_path):
    rec.patch("evaluate_perplexity", fake_report())
    result = invoke("eval", "ppl", "-d", "f.txt", "--json", tmp_path)
    assert_friendly_error(result, str(tmp_path))


# --- help ----------------------------------------------------------------------------------------

HELP_COMMANDS = [[], ["profile"], ["calibrate"], ["export"], ["generate"], ["eval"], ["eval", "ppl"],
                 ["inspect"], ["recipes"], ["run"]]


def _flat_help(text: str) -> str:
    """Help text without whitespace and Rich box characters (options wrap inside a box)."""
    return "".join(ch for ch in text if not ch.isspace() and ch not in "│╭╮╰╯─")


@pytest.mark.parametrize("argv", HELP_COMMANDS, ids=lambda a: " ".join(a) or "kvtool")
def test_help_exits_0(argv):
    result = invoke(*argv, "--help")
    ok(result)
    assert "Usage" in result.stdout


@pytest.mark.parametrize("argv, needles", [
    (["eval", "ppl"], ["--seq-len", "Tokensperwindow.", "[default:1024]", "--prefill", "Default:seq_len/2",
                       "--chunk", "1=truedecoding"]),
    (["profile"], ["--seq-len", "Tokensperwindow.", "[default:512]", "--samples", "[default:8]"]),
    (["calibrate"], ["--seq-len", "Default:therecipe'scalibration.seq_len", "--batch-size", "[default:4]"]),
    (["generate"], ["--max-new-tokens", "Tokenstogenerateperprompt.", "[default:64]", "--sample", "--greedy"]),
    (["run"], ["--calib-fraction", "[default:0.9]", "--eval-seq-len", "halfprefill", "[default:512]"]),
])
def test_help_mentions_units_and_defaults(argv, needles):
    flat = _flat_help(invoke(*argv, "--help").stdout)
    for needle in needles:
        assert needle in flat, needle
    assert flat.index(needles[0]) < flat.index(needles[2])  # the default follows its option


def test_help_shows_data_slice_syntax():
    assert "suffix[a:b]keeps" in _flat_help(invoke("calibrate", "--help").stdout)


# --- one real end-to-end run (no mocks) ------------------------------------------------------------


def test_end_to_end_on_stories260k(tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        "name: tiny-e2e\n"
        "keys: {method: uniform, bits: 4, axis: channel, group_size: 8}\n"  # head_dim is 8
        "values: {method: uniform, bits: 4, axis: token, group_size: 8}\n"
        "cache: {block_size: 32, sink_tokens: 2, recent_tokens: 16}\n"
    )
    calib, artifact, report = tmp_path / "calib.safetensors", tmp_path / "model.kvt.safetensors", tmp_path / "r.json"

    result = invoke("calibrate", "-d", stories_data(), "-o", calib, "-m", stories(), "-r", recipe,
                    "--samples", 2, "--seq-len", 128)
    ok(result)
    assert calib.is_file() and shows(result.stdout, "wrote calibration")

    # No --model from here on: the artifact records stories260K and the commands find it.
    result = invoke("export", "-c", calib, "-o", artifact)
    ok(result)
    assert artifact.is_file() and shows(result.stdout, "wrote artifact")

    result = invoke("inspect", artifact)
    ok(result)
    assert shows(result.stdout, "deployable artifact", "tiny-e2e")
    info = json.loads(invoke("inspect", artifact, "--json").stdout)
    assert info["kind"] == "deployable"
    assert info["manifest"]["model"]["head_dim"] == 8 and info["manifest"]["model"]["num_kv_heads"] == 4

    result = invoke("generate", "--prompt", "Once upon a time", "-a", artifact, "-n", 8, "--backend", "torch")
    ok(result)
    assert result.stdout.startswith("Once upon a time") and shows(result.stdout, "KV cache (torch backend)", "reserved", "tokens/s")

    result = invoke("eval", "ppl", "-d", stories_data(), "-a", artifact, "--samples", 2, "--seq-len", 160,
                    "--json", report)
    ok(result)
    assert report.is_file()
    data = json.loads(report.read_text())
    assert data["recipe"] == "tiny-e2e" and data["seq_len"] == 160 and data["windows"] == 2
    assert math.isfinite(data["ppl"]) and math.isfinite(data["baseline_ppl"])
    assert 1 < data["ppl"] < 100 and 1 < data["baseline_ppl"] < 100
    assert data["cache_bytes"] < data["baseline_cache_bytes"]
    from kvtool.runtime.kernels.cpu_decode import numba_available

    assert data["backend"] == ("numba" if numba_available() else "torch")  # auto on CPU
    assert data["reserved_cache_bytes"] >= data["cache_bytes"]
    assert data["bits_per_element"] < 16


# --- an unreachable hub id fails at once -----------------------------------------------------------


def test_unreachable_hub_id_is_one_line_before_anything_loads(rec, monkeypatch):
    import socket

    import kvtool.hub

    import huggingface_hub

    def unreachable(*args, **kwargs):
        raise socket.gaierror("no network")

    monkeypatch.setattr(kvtool.hub, "check_hub_reachable", REAL_HUB_CHECK)  # undo the autouse stub
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # CI sets HF_HUB_OFFLINE=1
    rec.patch("generate", raises=AssertionError("the API was called before --model was checked"))
    result = invoke("generate", "--prompt", "hi", "-m", "someone/some-model")
    assert_friendly_error(result, "someone/some-model", "cannot be reached", "local directory")


def test_uncached_hub_id_offline_is_one_line_before_anything_loads(rec, monkeypatch):
    import kvtool.hub

    import huggingface_hub

    monkeypatch.setattr(kvtool.hub, "check_hub_reachable", REAL_HUB_CHECK)  # undo the autouse stub
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    rec.patch("generate", raises=AssertionError("the API was called before --model was checked"))
    result = invoke("generate", "--prompt", "hi", "-m", "someone/some-model")
    assert_friendly_error(result, "someone/some-model", "HF_HUB_OFFLINE", "local directory")


def test_cached_hub_id_and_local_folders_pass_the_check(monkeypatch, tmp_path):
    import huggingface_hub

    from kvtool.hub import check_model_option

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: "/cache/config.json")
    check_model_option("someone/some-model")  # cached: transformers reads it offline
    check_model_option(str(tmp_path))
    check_model_option(None)
