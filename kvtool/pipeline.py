"""`kvtool run`: the whole pipeline on one model and one text source, with a summary.

profile -> calibrate -> export -> perplexity (compressed and uncompressed, same
code path) -> a generated sample. The leading ``calib_fraction`` of the text
calibrates; the rest evaluates, so the two never overlap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvtool import api
from kvtool.capture import Progress, no_progress
from kvtool.data import DataSpec, check_source
from kvtool.errors import DataError
from kvtool.recipe import load_recipe
from kvtool.fileio import check_output_path, write_json_atomic


def _split(data: str, fraction: float) -> tuple[DataSpec, DataSpec]:
    if not 0 < fraction < 1:
        raise DataError(f"--calib-fraction {fraction} must be between 0 and 1 (exclusive)")
    spec = DataSpec.parse(data)
    check_source(spec)  # before any model loads
    cut = spec.start + (spec.end - spec.start) * fraction
    calib = DataSpec(spec.source, spec.text_column, spec.start, cut)
    held_out = DataSpec(spec.source, spec.text_column, cut, spec.end)
    return calib, held_out


def run_pipeline(
    data: str,
    out_dir: str | Path,
    model: str | None = None,
    recipe: str | None = None,
    *,
    calib_fraction: float = 0.9,
    samples: int = 8,
    seq_len: int = 512,
    eval_samples: int = 4,
    eval_seq_len: int = 512,
    prompt: str = "Once upon a time",
    max_new_tokens: int = 128,
    load: api.LoadOptions = api.LoadOptions(),
    progress: Progress = no_progress,
    log: Callable[[str], None] = lambda message: None,
) -> dict:
    """Run every stage, write files and ``summary.json`` into ``out_dir``; return the summary."""
    out = Path(out_dir)
    check_output_path(out / "summary.json")  # fail before any work if the folder cannot be written
    calib_data, eval_data = _split(data, calib_fraction)
    load_recipe(recipe)  # a bad recipe fails now, not after profiling
    paths = {name: out / f"{name}.safetensors" for name in ("profile", "calibration", "model.kvt")}
    log(f"profile on {calib_data.source} [{calib_data.start:.2f}:{calib_data.end:.2f}]")
    api.profile(calib_data, paths["profile"], model, samples=samples, seq_len=seq_len, load=load, progress=progress)
    log("calibrate")
    calibration = api.calibrate(calib_data, paths["calibration"], model, recipe, samples=samples, seq_len=seq_len,
                                load=load, progress=progress)
    log("export")
    api.export(paths["calibration"], paths["model.kvt"], model, paths["profile"], load=load)
    log(f"perplexity on held-out [{eval_data.start:.2f}:{eval_data.end:.2f}], compressed and uncompressed")
    ppl = api.evaluate_perplexity(eval_data, model, paths["model.kvt"], samples=eval_samples, seq_len=eval_seq_len,
                                  load=load, progress=progress)
    log("generate a sample")
    sample = api.generate([prompt], model, paths["model.kvt"], max_new_tokens=max_new_tokens, load=load)
    summary = {
        "recipe": calibration.manifest["recipe"],
        "files": {name: str(path) for name, path in paths.items()},
        "calibration_quality": calibration.manifest["quality"],
        "expected_bits_per_element": calibration.manifest["expected_bits_per_element"],
        "perplexity": ppl,
        "sample": {"prompt": prompt, "text": sample.texts[0], "tokens_per_s": sample.tokens_per_s, "memory": sample.memory},
    }
    write_json_atomic(out / "summary.json", summary)
    return summary
