"""kvtool as plain functions: profile, calibrate, export, generate, evaluate, inspect.

Every function takes model ids/paths and file paths, returns plain results, and
never prints; progress goes through an optional ``progress`` wrapper (see
`kvtool.capture.Progress`). The CLI is a thin layer over these.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvtool.artifact import Artifact, check_model, load_artifact, save_artifact
from kvtool.attention_profile import profile_attention
from kvtool.capture import (
    ChannelStats, InputSecondMoments, Progress, QueryKeyMoments, no_progress, stream_batches, stream_queries,
)
from kvtool.calibration import (
    QuantErrorStats,
    RangeStats,
    build_quantizers,
    fit_layers,
    fit_palu_layers,
    fits_ranges,
    fits_queries,
    fits_reservoir,
    needs_fisher,
    needs_gradients,
    needs_fit,
    range_parts,
    uses_palu,
)
from kvtool.context_limit import check_prompt_fits
from kvtool.data import DataSpec, check_source, token_windows
from kvtool.errors import ArtifactError, RuntimeConfigError
from kvtool.eval.generation_report import generation_memory, generation_timing
from kvtool.eval.speed import DecodeClock
from kvtool.fileio import check_output_path
from kvtool.methods.evict.fastgen import FASTGEN_POLICIES, fastgen_token_classes, token_classes
from kvtool.models.adapter import adapter_for
from kvtool.models.cache_argument import with_cache
from kvtool.models.loading import DEFAULT_MODEL_DIR, load_model, resolve_model_path
from kvtool.recipe import EvictionSpec, Recipe, load_recipe
from kvtool.recipe_layers import resolve_layer_kinds
from kvtool.runtime.backend import resolve_backend
from kvtool.runtime.attach import CompressedRuntime, check_context, fastgen_settings, uncompressed_recipe

DEFAULT_MODEL_SOURCE = "kvtool:default-model"
FIT_SAMPLE_TOKENS = 4096  # token vectors per layer kept for fitting codebooks (bounded memory)


@dataclass(frozen=True)
class LoadOptions:
    """How to load the model: dtype (auto|float32|float16|bfloat16), device, device_map.

    max_memory ("cpu=2GiB,0=20GiB"; a bare size caps the CPU) implies device_map "auto" and
    offloads what does not fit to disk (offload_folder where the weights must be rewritten).
    """

    dtype: str = "auto"
    device: str = "cpu"
    device_map: str | None = None
    max_memory: str | None = None
    offload_folder: str | None = None


def _load(model: str | None, options: LoadOptions, tokenizer: bool = True):
    from kvtool.models.offload import parse_max_memory

    return load_model(
        model, dtype=options.dtype, device=options.device, device_map=options.device_map, tokenizer=tokenizer,
        max_memory=parse_max_memory(options.max_memory), offload_folder=options.offload_folder,
    )


def model_source(model: str | None) -> str:
    """What a manifest records as the model: an absolute local path, a hub id, or the embedded default."""
    if model is None:
        return DEFAULT_MODEL_SOURCE
    path = resolve_model_path(model)
    return DEFAULT_MODEL_SOURCE if Path(path) == DEFAULT_MODEL_DIR.resolve() else path


def model_for_artifact(model: str | None, artifact: Artifact) -> str | None:
    """--model if given; else the manifest's model if it can be found here; else the embedded default."""
    if model is not None:
        return model
    source = artifact.manifest.get("model_source", DEFAULT_MODEL_SOURCE)
    if source != DEFAULT_MODEL_SOURCE and Path(source).is_dir():
        return source
    return None


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise RuntimeConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _checked_data(data: str | DataSpec) -> DataSpec:
    """The parsed data spec, with its source checked (exists, supported, not empty) before any model loads."""
    spec = data if isinstance(data, DataSpec) else DataSpec.parse(data)
    check_source(spec)
    return spec


def _windows(tokenizer, data: str | DataSpec, samples: int, seq_len: int, seed: int, mode: str) -> torch.Tensor:
    spec = data if isinstance(data, DataSpec) else DataSpec.parse(data)
    return token_windows(tokenizer, spec, samples=samples, seq_len=seq_len, seed=seed, mode=mode)


def _provenance(data: str | DataSpec, windows: torch.Tensor, seed: int, tokens: int) -> dict:
    spec = data if isinstance(data, DataSpec) else DataSpec.parse(data)
    return {"data": spec.describe(), "samples": windows.shape[0], "seq_len": windows.shape[1], "seed": seed, "tokens": tokens}


# --- profile ----------------------------------------------------------------------------------


def profile(
    data: str | DataSpec,
    out: str | Path,
    model: str | None = None,
    *,
    recipe: str | Path | Recipe | None = None,
    threshold: float | None = None,
    local_ratio: float | None = None,
    frequent_ratio: float | None = None,
    samples: int = 8,
    seq_len: int = 512,
    seed: int = 0,
    batch_size: int = 4,
    load: LoadOptions = LoadOptions(),
    progress: Progress = no_progress,
) -> Artifact:
    """Profile a model on calibration text -> profile artifact.

    Holds per-layer, per-KV-head channel statistics of pre-RoPE keys, keys and values,
    and the attention profile (`kvtool.attention_profile`): FastGen's per-KV-head policies
    (``heads.*``) and PyramidKV-style fitted layer budgets (``layers.budget_weight``).
    threshold / local_ratio / frequent_ratio override the recipe's ``eviction`` values
    (default recipe: T = 0.95, r_l = r_f = 0.3, FastGen's paper settings).
    """
    _require_positive(samples=samples, seq_len=seq_len, batch_size=batch_size)
    check_output_path(out)
    spec = _eviction_spec(recipe, threshold=threshold, local_ratio=local_ratio, frequent_ratio=frequent_ratio)
    data = _checked_data(data)
    hf_model, tokenizer = _load(model, load)
    adapter = adapter_for(hf_model)
    windows = _windows(tokenizer, data, samples, seq_len, seed, "random")
    check_context(adapter, seq_len)
    stats = ChannelStats()
    tokens = stream_batches(hf_model, adapter, windows, [stats], batch_size, progress)
    attention = profile_attention(hf_model, adapter, windows, *token_classes(tokenizer), spec, batch_size, progress)
    artifact = Artifact(
        kind="profile",
        manifest={
            "model": adapter.fingerprint(),
            "model_source": model_source(model),
            "calibration": _provenance(data, windows, seed, tokens),
            "statistics": list(ChannelStats.KINDS),
            "fastgen": {
                "threshold": spec.threshold, "local_ratio": spec.local_ratio, "frequent_ratio": spec.frequent_ratio,
                "sink_tokens": spec.sink_tokens, "policies": list(FASTGEN_POLICIES),
                "expected_cache_fraction": attention.expected_cache_fraction,
            },
            "pyramid": {
                "attention_need": attention.tensors["layers.attention_need"].tolist(),
                "budget_weight": attention.tensors["layers.budget_weight"].tolist(),
            },
        },
        tensors={**stats.tensors(), **attention.tensors, "fastgen.settings": fastgen_settings(spec)},
    )
    save_artifact(out, artifact)
    return artifact


def _eviction_spec(recipe: str | Path | Recipe | None, **overrides: float | None) -> EvictionSpec:
    """The recipe's eviction section with the given (non-None) values replaced and validated."""
    resolved = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    return dataclasses.replace(resolved.eviction, **{k: v for k, v in overrides.items() if v is not None})


# --- fit-windows ------------------------------------------------------------------------------


def fit_windows(
    data: str | DataSpec,
    out: str | Path,
    model: str | None = None,
    recipe: str | Path | Recipe | None = None,
    *,
    mean_share: float = 0.3,
    shares: tuple[float, ...] | None = None,
    samples: int = 3,
    seq_len: int | None = None,
    seed: int = 0,
    name: str | None = None,
    load: LoadOptions = LoadOptions(),
    progress: Progress = no_progress,
) -> tuple[Recipe, "WindowFit"]:
    """Fit each sliding-window layer's share of its window on calibration text; write the recipe to ``out`` (YAML).

    ``recipe``: the codes to keep (default: uncompressed); StreamingLLM on the sliding-window layers is added at the
    fitted shares (`kvtool.window_fit`). seq_len: tokens per window (default: twice the model's largest sliding
    window, so every scored token has a full window behind it). Returns (recipe written, what was measured)."""
    from kvtool.fileio import atomic_write
    from kvtool.recipe import dump_recipe
    from kvtool.window_fit import DEFAULT_SHARES, WindowFit, check_fit_base, fit_window_shares, fitted_recipe  # noqa: F401

    _require_positive(samples=samples, seq_len=seq_len)
    check_output_path(out)
    base = recipe if isinstance(recipe, Recipe) else load_recipe(recipe if recipe is not None else "uncompressed")
    check_fit_base(base)  # before minutes of measuring
    data = _checked_data(data)
    hf_model, tokenizer = _load(model, load)
    adapter = adapter_for(hf_model)
    if seq_len is None:
        seq_len = 2 * max((w for w in adapter.geometry.sliding_windows if w), default=1)
    check_context(adapter, seq_len)
    windows = _windows(tokenizer, data, samples, seq_len, seed, "random")
    fit = fit_window_shares(hf_model, windows, mean_share, tuple(shares or DEFAULT_SHARES), progress)
    fitted = fitted_recipe(base, fit, adapter.geometry.sliding_windows, name=name,
                           note=f" on {model_source(model)}, {samples} x {seq_len} tokens of {data.label()}")
    atomic_write(out, lambda tmp: Path(tmp).write_text(dump_recipe(fitted)))
    return fitted, fit


# --- calibrate --------------------------------------------------------------------------------


def calibrate(
    data: str | DataSpec,
    out: str | Path,
    model: str | None = None,
    recipe: str | Path | Recipe | None = None,
    *,
    samples: int | None = None,
    seq_len: int | None = None,
    seed: int | None = None,
    batch_size: int = 4,
    load: LoadOptions = LoadOptions(),
    progress: Progress = no_progress,
    layer_by_layer: bool = False,
    resume: bool = False,
    on_step: Callable[[str, int], None] | None = None,
) -> Artifact:
    """Measure (and, for methods that learn, fit) the recipe's quantizers on calibration data -> calibration artifact.

    samples / seq_len / seed override the recipe's ``calibration`` section.
    layer_by_layer: one decoder layer in memory at a time (`kvtool.layer_by_layer`; pair it with
    ``load.max_memory`` for models that do not fit), with checkpoints in ``<out>.ckpt/``;
    resume: continue from them after an interruption. on_step(phase, layer): after each saved step.
    """
    _require_positive(samples=samples, seq_len=seq_len, batch_size=batch_size)
    check_output_path(out)
    if resume and not layer_by_layer:
        raise RuntimeConfigError("--resume continues an interrupted --layer-by-layer calibration: add --layer-by-layer")
    resolved = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    overrides = {k: v for k, v in (("samples", samples), ("seq_len", seq_len), ("seed", seed)) if v is not None}
    resolved = dataclasses.replace(resolved, calibration=dataclasses.replace(resolved.calibration, **overrides))
    data = _checked_data(data)
    hf_model, tokenizer = _load(model, load)
    staged = None
    if layer_by_layer:
        from kvtool.calibration_checkpoint import checkpoint_dir_for
        from kvtool.layer_by_layer import LayerByLayer

        staged = LayerByLayer(checkpoint=checkpoint_dir_for(out), resume=resume, on_step=on_step)
    artifact = calibrate_loaded(hf_model, tokenizer, data, resolved, batch_size=batch_size, progress=progress,
                                layer_by_layer=staged)
    artifact.manifest["model_source"] = model_source(model)
    save_artifact(out, artifact)
    if staged is not None:
        from kvtool.calibration_checkpoint import remove_checkpoint

        remove_checkpoint(staged.checkpoint)  # the artifact is written: nothing left to resume
    return artifact


def calibrate_loaded(
    hf_model,
    tokenizer,
    data: str | DataSpec,
    recipe: Recipe,
    *,
    batch_size: int = 4,
    progress: Progress = no_progress,
    layer_by_layer=None,
) -> Artifact:
    """`calibrate` on a loaded model; returns the calibration artifact without writing it.

    layer_by_layer: a `kvtool.layer_by_layer.LayerByLayer` to run one decoder layer at a time.
    """
    adapter = adapter_for(hf_model)
    geometry = adapter.geometry
    written = recipe  # the manifest keeps the recipe as given (layers: sliding / full resolve again at load)
    recipe = resolve_layer_kinds(recipe, geometry.sliding_windows)
    cal = recipe.calibration
    check_context(adapter, cal.seq_len)
    windows = _windows(tokenizer, data, cal.samples, cal.seq_len, cal.seed, "random")
    if layer_by_layer is not None:
        from kvtool.layer_by_layer import calibrate_layer_by_layer

        run = calibrate_layer_by_layer(hf_model, adapter, recipe, windows, batch_size=batch_size,
                                       max_fit_tokens=FIT_SAMPLE_TOKENS, options=layer_by_layer, progress=progress)
        fitted, errors, tokens, fingerprint = run.fitted, run.errors, run.tokens, run.fingerprint
    else:
        fitted = _fit(hf_model, adapter, recipe, windows, batch_size, progress) if needs_fit(recipe) else None
        errors = QuantErrorStats(recipe, geometry.head_dim, fitted)
        tokens = stream_batches(hf_model, adapter, windows, [errors], batch_size, progress)
        fingerprint = adapter.fingerprint()
    tensors = errors.sqnr_db()
    for layer, layer_fitted in enumerate(fitted or []):
        tensors.update({f"layers.{layer}.{name}": t for name, t in layer_fitted.items()})
    provenance = {**_provenance(data, windows, cal.seed, tokens), "fisher": needs_fisher(recipe)}
    if layer_by_layer is not None:
        provenance["layer_by_layer"] = True
    manifest = {
        "model": fingerprint,
        "model_source": "(in memory)",
        "recipe": written.to_dict(),
        "calibration": provenance,
        "expected_bits_per_element": _body_bits(recipe, geometry.head_dim, fitted or [None] * geometry.num_layers),
        "quality": errors.summary(),
    }
    return Artifact(kind="calibration", manifest=manifest, tensors=tensors)


def _fit(hf_model, adapter, recipe: Recipe, windows, batch_size: int, progress: Progress) -> list[dict]:
    """Sample token vectors (with Fisher weights when needed) and fit every layer's learned quantizers."""
    from contextlib import nullcontext

    from kvtool.sensitivity import SampleReservoir, stream_with_gradients

    # sink tokens stay in float in the cache: fitting on them (huge keys, huge gradients) would skew codebooks and ranks
    skip = recipe.cache.sink_tokens
    reservoir = SampleReservoir(
        max_tokens=FIT_SAMPLE_TOKENS, seed=recipe.calibration.seed, skip_first=skip, keep_gradients=needs_gradients(recipe)
    )
    ranges = None
    if fits_ranges(recipe):
        ranges = RangeStats(max_tokens=FIT_SAMPLE_TOKENS, seed=recipe.calibration.seed, skip_first=skip, parts=range_parts(recipe))
    queries = None
    if fits_queries(recipe):  # query statistics come from the attention call, not the cache: a pass of their own
        queries = QueryKeyMoments(skip_first=skip)
        stream_queries(hf_model, windows, queries.observe, batch_size, progress)
    moments = InputSecondMoments(adapter) if uses_palu(recipe) else nullcontext()
    plain = [ranges] if ranges is not None else []  # observers fed by a plain forward pass
    with moments:
        if fits_reservoir(recipe) and needs_fisher(recipe):
            stream_with_gradients(hf_model, adapter, windows, [reservoir], batch_size=1, progress=progress)
        elif fits_reservoir(recipe):
            plain.append(reservoir)
        if plain:
            stream_batches(hf_model, adapter, windows, plain, batch_size, progress)
    geometry = adapter.geometry
    fitted = fit_layers(
        recipe, geometry.head_dim, geometry.num_layers, reservoir if fits_reservoir(recipe) else None, ranges, queries
    )
    if uses_palu(recipe):
        for layer, palu in enumerate(fit_palu_layers(recipe, adapter, reservoir, moments)):
            fitted[layer].update(palu)
    return fitted


def _body_bits(recipe: Recipe, head_dim: int, fitted: list) -> dict:
    """Stored bits per body element (codes, scales, outliers, latents), averaged over layers."""
    per_layer = [build_quantizers(recipe.for_layer(i), head_dim, fitted=layer) for i, layer in enumerate(fitted)]
    k = sum(q[0].bits_per_element() for q in per_layer) / len(per_layer)
    v = sum(q[1].bits_per_element() for q in per_layer) / len(per_layer)
    return {"keys": k, "values": v, "body": (k + v) / 2}


# --- export -----------------------------------------------------------------------------------


EXPORT_FORMATS = ("kvtool", "vllm")


def export(
    calib: str | Path,
    out: str | Path,
    model: str | None = None,
    profile_path: str | Path | None = None,
    *,
    format: str = "kvtool",
    load: LoadOptions = LoadOptions(),
) -> Artifact:
    """Validate a calibration (and optional profile) against the model and write what it deploys to.

    ``format="kvtool"``: the deployable artifact (one .safetensors file) kvtool's runtime loads;
    ``format="vllm"``: a model folder vLLM serves with ``--kv-cache-dtype fp8`` and the calibrated
    ``k_scale`` / ``v_scale`` (fp8 static recipes only; see `kvtool.export_vllm`).
    Returns the deployable artifact (for ``vllm`` too: what kvtool itself would load).
    """
    if format not in EXPORT_FORMATS:
        raise ArtifactError(f"export format '{format}' is not one of {list(EXPORT_FORMATS)}")
    if format == "vllm" and profile_path is not None:
        raise ArtifactError("--format vllm exports fp8 KV scales only; vLLM does not read a kvtool profile (drop --profile)")
    if format == "kvtool":
        check_output_path(out)
    calibration = load_artifact(calib, expect_kind="calibration")
    if format == "vllm":
        from kvtool.export_vllm import check_vllm_recipe

        check_vllm_recipe(load_recipe_dict(calibration))
    hf_model, tokenizer = _load(model_for_artifact(model, calibration), load)
    fingerprint = adapter_for(hf_model).fingerprint()
    check_model(calibration, fingerprint, source=f"calibration '{calib}'")
    tensors = dict(calibration.tensors)
    manifest = {k: v for k, v in calibration.manifest.items() if k not in ("kind", "tensors_sha256", "kvtool_version")}
    if profile_path is not None:
        prof = load_artifact(profile_path, expect_kind="profile")
        check_model(prof, fingerprint, source=f"profile '{profile_path}'")
        tensors.update({f"profile.{k}": v for k, v in prof.tensors.items()})
        manifest["profile"] = prof.manifest.get("calibration", {})
    artifact = Artifact(kind="deployable", manifest=manifest, tensors=tensors)
    CompressedRuntime.from_artifact(hf_model, artifact)  # the runtime can really load it
    if format == "vllm":
        from kvtool.export_vllm import scale_tensors, write_vllm_folder

        scales = scale_tensors(artifact, hf_model, adapter_for(hf_model))
        write_vllm_folder(out, hf_model, tokenizer, scales, load_recipe_dict(calibration))
    else:
        save_artifact(out, artifact)
    return artifact


def load_recipe_dict(artifact: Artifact) -> Recipe:
    """The validated recipe an artifact's manifest records."""
    from kvtool.recipe import recipe_from_dict

    return recipe_from_dict(artifact.manifest["recipe"])


# --- runtime: generate and evaluate ----------------------------------------------------------


def load_runtime(
    model: str | None = None,
    artifact: str | Path | None = None,
    recipe: str | Path | Recipe | None = None,
    *,
    profile: str | Path | None = None,
    load: LoadOptions = LoadOptions(),
    tokenizer: bool = True,
    backend: str = "auto",
):
    """(model, tokenizer, runtime) from a deployable artifact, or from a recipe (no calibration), or uncompressed.

    ``backend`` (`kvtool.runtime.backend`: auto, torch, triton) is checked before the model loads.

    ``profile`` (from `kvtool profile`) supplies FastGen head policies and fitted layer budgets to a
    recipe that evicts; a deployable artifact carries its own (``kvtool export --profile``).
    ``tokenizer=False``: no tokenizer is loaded (None), for token-id models without one.
    """
    if artifact is not None and recipe is not None:
        raise ArtifactError("give either an artifact or a recipe, not both")
    if artifact is not None and profile is not None:
        raise ArtifactError("a deployable artifact carries its profile: export it with --profile instead of passing both")
    loaded = load_artifact(artifact, expect_kind="deployable") if artifact is not None else None
    prof = load_artifact(profile, expect_kind="profile") if profile is not None else None
    resolve_backend(backend, torch.device(load.device))  # an impossible backend fails before the model loads
    hf_model, tokenizer = _load(model_for_artifact(model, loaded) if loaded else model, load, tokenizer)
    if loaded is not None:
        return hf_model, tokenizer, CompressedRuntime.from_artifact(hf_model, loaded, backend=backend)
    return hf_model, tokenizer, recipe_runtime(hf_model, recipe, prof, profile, tokenizer, backend)


def recipe_runtime(hf_model, recipe, prof=None, profile_path=None, tokenizer=None, backend: str = "auto"):
    """A `CompressedRuntime` for ``recipe`` (a name, a path or a `Recipe`; None: uncompressed) on a loaded model, with
    the tensors of a loaded profile artifact ``prof`` (from ``profile_path``) checked against the model."""
    resolved = recipe if isinstance(recipe, Recipe) else (load_recipe(recipe) if recipe else uncompressed_recipe())
    profile_tensors = None
    if prof is not None:
        check_model(prof, adapter_for(hf_model).fingerprint(), source=f"profile '{profile_path}'")
        profile_tensors = prof.tensors
    profile_tensors = with_token_classes(hf_model, resolved, profile_tensors, tokenizer)
    return CompressedRuntime.from_recipe(hf_model, resolved, profile=profile_tensors, backend=backend)


def with_token_classes(hf_model, recipe: Recipe, profile: dict | None, tokenizer=None) -> dict | None:
    """``profile`` plus the tokenizer's FastGen token classes when FastGen chooses per prompt and has none.

    The tokenizer is loaded from the model's folder when none was (``tokenizer`` None).
    """
    if not recipe.eviction.fastgen_per_prompt or (profile and "tokens.special" in profile):
        return profile
    from kvtool.models.loading import load_tokenizer

    return {**(profile or {}), **fastgen_token_classes(tokenizer or load_tokenizer(hf_model.name_or_path))}


@dataclass(frozen=True)
class GenerateResult:
    texts: list[str]
    prompt_tokens: int
    new_tokens: int  # per sequence (the longest)
    seconds: float
    tokens_per_s: float  # generated tokens per second, all sequences together
    memory: dict  # cache.memory_report() + baseline / model_dtype_cache_bytes / note (kvtool.eval.baselines)
    timing: dict = dataclasses.field(default_factory=dict)  # decode step rates: median, best (kvtool.eval.speed)


class _Streamer:
    """Minimal streamer for generate(): decodes new tokens of a single sequence and hands text to a callback."""

    def __init__(self, tokenizer, on_text: Callable[[str], None]) -> None:
        self.tokenizer, self.on_text = tokenizer, on_text
        self.ids: list[int] = []
        self.printed = 0
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first sends the prompt
            self.prompt_seen = True
            return
        self.ids.extend(value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for complete UTF-8 characters
            self.on_text(text[self.printed :])
            self.printed = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.on_text(text[self.printed :])


def generate(
    prompts: list[str],
    model: str | None = None,
    artifact: str | Path | None = None,
    recipe: str | Path | Recipe | None = None,
    *,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    on_text: Callable[[str], None] | None = None,
    profile: str | Path | None = None,
    load: LoadOptions = LoadOptions(),
    backend: str = "auto",
) -> GenerateResult:
    """Generate with the compressed cache; batches of prompts are left-padded. Streams text when one prompt."""
    if not prompts or any(not p for p in prompts):
        raise RuntimeConfigError("give at least one non-empty prompt")
    _require_positive(max_new_tokens=max_new_tokens)
    if do_sample and not (temperature > 0 and 0 < top_p <= 1):
        raise RuntimeConfigError(f"sampling needs --temperature > 0 and 0 < --top-p <= 1; got {temperature} and {top_p}")
    hf_model, tokenizer, runtime = load_runtime(model, artifact, recipe, profile=profile, load=load, backend=backend)
    device = next(hf_model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
    check_prompt_fits(enc.input_ids.shape[1], max_new_tokens, runtime.adapter.geometry.max_positions)
    cache = runtime.new_cache()
    streamer = DecodeClock(_Streamer(tokenizer, on_text) if on_text and len(prompts) == 1 else None)
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if do_sample else {"do_sample": False}
    start = time.perf_counter()
    with torch.no_grad():
        out = hf_model.generate(
            **enc, **with_cache(cache), max_new_tokens=max_new_tokens, streamer=streamer,
            pad_token_id=tokenizer.pad_token_id, **sampling,
        )
    seconds = time.perf_counter() - start
    new = out[:, enc.input_ids.shape[1] :]
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    return GenerateResult(
        texts=texts,
        prompt_tokens=enc.input_ids.shape[1],
        new_tokens=new.shape[1],
        seconds=seconds,
        tokens_per_s=new.numel() / seconds if seconds else 0.0,
        memory=generation_memory(cache, hf_model, runtime.recipe),
        timing=generation_timing(streamer, len(prompts)),
    )


def evaluate_perplexity(
    data: str | DataSpec,
    model: str | None = None,
    artifact: str | Path | None = None,
    recipe: str | Path | Recipe | list | tuple | None = None,
    *,
    samples: int = 4,
    seq_len: int = 1024,
    prefill: int | None = None,
    chunk: int = 1,
    batch_size: int = 4,
    baseline: bool = True,
    profile: str | Path | None = None,
    load: LoadOptions = LoadOptions(),
    progress: Progress = no_progress,
    backend: str = "auto",
    model_dtype: bool = True,
) -> dict | list[dict]:
    """Perplexity through the runtime on sequential windows, against the 16-bit baseline from the same code path.

    Returns a JSON-able dict (`kvtool.eval.ppl_report`): ppl, bits_per_element, cache_bytes,
    fp16_cache_bytes, bytes_per_token, compression_ratio, decode tokens/s (mean, median, best);
    with ``baseline`` the same as ``baseline_*`` for the 16-bit cache (``baseline``: its name)
    and delta_pct with its paired 95% interval delta_ci95_pct (`kvtool.eval.paired_delta`), and
    ``model_dtype_*`` for the model-dtype cache where that is not 16-bit (unless ``model_dtype=False``: one pass fewer);
    notes where a figure cannot mean much; the settings.

    Several caches on the same windows: ``recipe`` a list or tuple of recipes (and optionally an ``artifact`` beside
    them, listed first) gives a list of such dicts, one per cache, scored in one interleaved pass beside one baseline
    pass (`kvtool.eval.ppl_report.perplexity_reports`); ``profile`` then goes to the recipes, not the artifact.
    """
    from kvtool.eval.ppl_report import perplexity_reports

    _require_positive(samples=samples, seq_len=seq_len, batch_size=batch_size, chunk=chunk)
    prefill = seq_len // 2 if prefill is None else prefill
    if not 1 <= prefill <= seq_len - 2:
        raise RuntimeConfigError(f"--prefill {prefill} must be between 1 and --seq-len - 2 = {seq_len - 2}")
    several = isinstance(recipe, (list, tuple))
    recipes = list(recipe) if several else []
    if several and not recipes and artifact is None:
        raise RuntimeConfigError("no recipe to evaluate: give at least one --recipe (or an --artifact)")
    for entry in recipes:  # a bad recipe fails before the model loads
        if not isinstance(entry, Recipe):
            load_recipe(entry)
    data = _checked_data(data)
    if several:
        first = None if artifact is not None else recipes.pop(0)
        hf_model, tokenizer, runtime = load_runtime(model, artifact, first, profile=None if artifact and recipes else profile,
                                                    load=load, backend=backend)
        prof = load_artifact(profile, expect_kind="profile") if profile is not None and recipes else None
        runtimes = [runtime, *(recipe_runtime(hf_model, entry, prof, profile, tokenizer, backend) for entry in recipes)]
    else:
        hf_model, tokenizer, runtime = load_runtime(model, artifact, recipe, profile=profile, load=load, backend=backend)
        runtimes = [runtime]
    for each in runtimes:
        each.check_context(seq_len)
    windows = _windows(tokenizer, data, samples, seq_len, 0, "sequential")
    reports = perplexity_reports(hf_model, windows, runtimes, prefill=prefill, chunk=chunk, batch_size=batch_size,
                                 baseline=baseline, model_dtype=model_dtype, progress=progress)
    provenance = _provenance(data, windows, 0, windows.numel())["data"]
    identity = {"model": hf_model.name_or_path, "data": provenance, "window_ids": window_ids(windows)}
    reports = [{"recipe": each.recipe.name, **identity, **report} for each, report in zip(runtimes, reports)]
    return reports if several else reports[0]


def window_ids(windows: torch.Tensor) -> list[str]:
    """A short hash of each window's token ids (N,): `pool_perplexity` refuses sets that share a window."""
    return [hashlib.sha256(row.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16] for row in windows]


def pool_perplexity(reports: list[str | Path], target_pct: float | None = None, skipped: list[str] | None = None) -> list[dict]:
    """One delta per recipe from several `evaluate_perplexity` JSON reports on disjoint windows (`kvtool eval pool`).

    Each file is one report or a list (several recipes scored together); a recipe is pooled over the files that hold
    it (`kvtool.eval.pooled_delta`: the sets as independent strata, token-weighted, one 95% interval). Unreadable
    files, reports without the baseline's interval, sets of different protocols or models and sets that share a
    window are refused with the fix. With ``target_pct`` each row also says where its interval stands against
    "delta <= target" (``verdict``: under, over, not resolved). With a ``skipped`` list, recipes found in one
    report only are named there and left out instead of refused.
    """
    from kvtool.eval.pooled_delta import pool_reports, verdict

    if target_pct is not None and not math.isfinite(target_pct):
        raise RuntimeConfigError(f"--target {target_pct} is not a number of percent: give e.g. --target 3 for <= +3%")

    loaded = []
    for path in map(Path, reports):
        if not path.is_file():
            raise RuntimeConfigError(f"report {path} does not exist or is not a file: give the files "
                                     "`kvtool eval ppl --json` wrote")
        try:
            loaded.append((str(path), json.loads(path.read_text())))
        except OSError as error:
            raise RuntimeConfigError(f"report {path} cannot be read ({error.strerror}): check its permissions") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise RuntimeConfigError(f"report {path} is not valid JSON ({error}): it may be truncated; run "
                                     "`kvtool eval ppl --json` for that set again") from None
    rows = [pooled.to_dict() for pooled in pool_reports(loaded, skipped)]
    if target_pct is not None:
        for row in rows:
            row.update(target_pct=target_pct, verdict=verdict(row["delta_ci95_pct"][0], row["delta_ci95_pct"][1], target_pct))
    return rows


def inspect(path: str | Path) -> dict:
    """Manifest and tensor table of any kvtool artifact."""
    artifact = load_artifact(path)
    tensors = {name: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")} for name, t in artifact.tensors.items()}
    return {"path": str(path), "kind": artifact.kind, "manifest": artifact.manifest, "tensors": tensors}


# --- retrieval --------------------------------------------------------------------------------


def evaluate_retrieval(
    model: str | None = None,
    artifact: str | Path | None = None,
    recipe: str | Path | Recipe | None = None,
    *,
    task: str = "passkey",
    data: str | DataSpec | None = None,
    lengths: tuple[int, ...] | list[int] = (256, 512),
    depths: tuple[float, ...] | list[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    seeds: int = 3,
    facts: int = 1,
    baseline: bool = True,
    plot: str | Path | None = None,
    profile: str | Path | None = None,
    load: LoadOptions = LoadOptions(),
    progress: Progress = no_progress,
    backend: str = "auto",
    question_agnostic: bool = False,
) -> dict:
    """Fact retrieval through the runtime over lengths x depths x seeds, with the 16-bit cache as the baseline.

    task "passkey": pass key sentence(s) (``facts``) hidden in held-out text from ``data``; needs
    the model's tokenizer. task "copy": a needle of random token ids, for token-id models such as
    `kvtool.eval.copy_model` (their folders need no tokenizer). Returns a JSON-able dict:
    accuracy, baseline_accuracy, kept_fraction, cache_bytes, baseline_cache_bytes (bytes per
    sequence at the end of generation; all means over cells), grid (one row per (n, depth)),
    chance_accuracy and a ``note`` when the baseline is not above chance (the model cannot do the
    task), and the settings. ``plot``: also write a depth x length heatmap PNG there. ``question_agnostic``:
    compress each context before its question is fed (one compressed document, any question).
    """
    from kvtool.eval.baselines import sixteen_bit_recipe
    from kvtool.eval.retrieval import evaluate_grid, retrieval_caveats
    from kvtool.eval.retrieval_request import RetrievalGrid, check_retrieval_request

    grid = RetrievalGrid(tuple(lengths), tuple(depths), seeds)
    check_retrieval_request(task, data, facts, plot)
    spec = None if data is None else _checked_data(data)
    hf_model, _, runtime = load_runtime(model, artifact, recipe, profile=profile, load=load, tokenizer=False,
                                    backend=backend)
    tokenizer = _passkey_tokenizer(hf_model) if task == "passkey" else None
    prompts = _retrieval_task(task, hf_model, tokenizer, spec, facts)
    base = CompressedRuntime.from_recipe(hf_model, sixteen_bit_recipe(), backend=runtime.backend) if baseline else None
    pad_id = tokenizer.pad_token_id if tokenizer is not None else hf_model.config.pad_token_id
    result = evaluate_grid(hf_model, runtime, prompts, grid, baseline_runtime=base, pad_id=pad_id, progress=progress,
                           question_agnostic=question_agnostic)
    report = {
        "task": task, "recipe": runtime.recipe.name, "question_agnostic": question_agnostic,
        "lengths": list(grid.lengths), "depths": list(grid.depths),
        "seeds": grid.seeds, "backend": runtime.backend, **prompts.describe(), **({"data": spec.describe()} if spec is not None else {}), **result,
    }
    report.update(retrieval_caveats(report, hf_model))  # baseline name, model-dtype bytes, chance, note
    if plot is not None:
        from kvtool.eval.plots import plot_retrieval

        report["plot"] = str(plot_retrieval(report, plot))
    return report


def _passkey_tokenizer(hf_model):
    """The tokenizer from the folder the model came from, with a hint toward --task copy when it has none."""
    from kvtool.errors import ModelError
    from kvtool.models.loading import load_tokenizer

    try:
        return load_tokenizer(hf_model.name_or_path)
    except ModelError as exc:
        raise ModelError(f"{exc}. The passkey task needs the model's tokenizer; "
                         "for a token-id model without one use --task copy") from exc


def _retrieval_task(task: str, hf_model, tokenizer, spec: DataSpec | None, facts: int):
    from kvtool.eval.copy_model import CopyVocab
    from kvtool.eval.retrieval_tasks import CopyTask, PasskeyTask, text_filler

    if task == "copy":
        return CopyTask(CopyVocab.for_config(hf_model.config))
    return PasskeyTask(tokenizer, text_filler(tokenizer, spec), facts)
