"""The ``kvtool`` command line: Typer options, one call into `kvtool.api`, Rich output.

No logic lives here. Errors a user can hit (`KvtoolError`) are printed without a
traceback and the command exits with status 2.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from kvtool.cli_usage import OneLineErrorsGroup
from kvtool.errors import KvtoolError, RuntimeConfigError

app = typer.Typer(
    cls=OneLineErrorsGroup,  # usage errors: one `error:` line, exit 2
    help="Compress the KV cache of Hugging Face causal LMs: profile, calibrate, export, generate, eval.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
eval_app = typer.Typer(help="Evaluate through the real runtime.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")

console = Console()
err_console = Console(stderr=True)

# --- shared options ---------------------------------------------------------------------------
ModelOpt = Annotated[
    Optional[str],
    typer.Option("--model", "-m", help="Hub id or local model directory. Default: the artifact's model, else the embedded kvref-5m."),
]
DataOpt = Annotated[
    str,
    typer.Option(
        "--data", "-d",
        help="Text: a .txt/.jsonl/.parquet file or folder, or a hub dataset 'name[:config[:split]]'. "
        "A suffix \\[a:b] keeps that fraction of the characters, e.g. file.txt\\[0.9:1].",
    ),
]
TextColumnOpt = Annotated[str, typer.Option(help="Column holding the text (jsonl/parquet/hub data).")]
SamplesOpt = Annotated[int, typer.Option(help="Number of token windows.")]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", help="Tokens per window.")]
SeedOpt = Annotated[int, typer.Option(help="Seed for window sampling.")]
BatchOpt = Annotated[int, typer.Option("--batch-size", help="Windows per forward pass.")]
DtypeOpt = Annotated[str, typer.Option(help="Model dtype: auto (float32 on CPU, checkpoint dtype on GPU), float32, float16, bfloat16.")]
DeviceOpt = Annotated[str, typer.Option(help="Device: cpu, cuda, cuda:N.")]
DeviceMapOpt = Annotated[Optional[str], typer.Option("--device-map", help="transformers device_map (e.g. auto) for models that do not fit one device.")]
RecipeOpt = Annotated[Optional[str], typer.Option("--recipe", "-r", help="Recipe YAML path or bundled recipe name (see `kvtool recipes`). Default: kivi-4bit.")]
ProfileOpt = Annotated[Optional[Path], typer.Option("--profile", "-p", help="Profile from `kvtool profile` (FastGen head policies, fitted layer budgets) for a --recipe that evicts.")]
EvalArtifactOpt = Annotated[Optional[Path], typer.Option("--artifact", "-a", help="Deployable artifact. Without it and --recipe: uncompressed only.")]
EvalRecipeOpt = Annotated[Optional[str], typer.Option("--recipe", "-r", help="Evaluate a recipe directly, without calibration.")]
EvalRecipesOpt = Annotated[Optional[list[str]], typer.Option("--recipe", "-r", help="Evaluate a recipe directly, without calibration. Repeat it to compare several recipes (and an --artifact) on the same windows: one interleaved pass beside one baseline pass, one column each.")]
JsonOutOpt = Annotated[Optional[Path], typer.Option("--json", help="Write the results as JSON here.")]
BackendOpt = Annotated[str, typer.Option("--backend", help="Attention over the compressed cache: auto (triton on CUDA, numba on CPU, where the recipe's formats have a kernel; else torch), torch (pure-torch reference, any device), triton (Triton decode kernel reading the compressed blocks in place; CUDA) or numba (compiled CPU decode kernel for float, uniform/KIVI, int_static, fp8, nuq (KVQuant) and TurboQuant stores, keys before or after RoPE; compiled on first use, then cached on disk).")]
# models bigger than the machine (calibrate)
LayerByLayerOpt = Annotated[bool, typer.Option("--layer-by-layer", help="Calibrate one decoder layer at a time (peak memory: one layer plus activations), with resumable checkpoints in OUT.ckpt/.")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue an interrupted --layer-by-layer run from its checkpoint (starts afresh if there is none).")]
MaxMemoryOpt = Annotated[Optional[str], typer.Option("--max-memory", help="Memory cap per device, e.g. 'cpu=2GiB' or '0=20GiB,cpu=64GiB' (a bare size caps the CPU); implies --device-map auto, the rest is offloaded to disk.")]
OffloadFolderOpt = Annotated[Optional[Path], typer.Option("--offload-folder", help="Folder for offloaded weights when the checkpoint is not safetensors (safetensors are read in place).")]
PlotOpt = Annotated[Optional[Path], typer.Option("--plot", help="Also write the FastGen policy map as a PNG heatmap here (needs the plots extra).")]


def _friendly(fn):
    """Print KvtoolError as one red line and exit 2, instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvtoolError as exc:
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(code=2) from None

    return wrapper


def _quiet_libraries() -> None:
    """Silence transformers'/datasets' own progress bars; kvtool shows its own."""
    import datasets
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    datasets.disable_progress_bars()


def _progress(items, description: str, total: int):
    """A rich bar on a terminal; otherwise (a log file, nohup, CI) a plain line at most once a minute."""
    if not err_console.is_terminal:
        from kvtool.progress_lines import progress_lines

        return progress_lines(items, description, total,
                              lambda line: err_console.print(line, markup=False, highlight=False, soft_wrap=True))
    from rich.progress import track

    return track(items, description=description, total=total, console=err_console, transient=True)


def _load_options(dtype: str, device: str, device_map: Optional[str], max_memory: Optional[str] = None,
                  offload_folder: Optional[Path] = None):
    from kvtool.api import LoadOptions

    folder = None if offload_folder is None else str(offload_folder)
    return LoadOptions(dtype=dtype, device=device, device_map=device_map, max_memory=max_memory, offload_folder=folder)


def _data(data: str, text_column: str):
    """The parsed, checked --data (exists, supported, not empty): instant, before torch or a model loads."""
    from kvtool.data import DataSpec, check_source

    spec = DataSpec.parse(data, text_column=text_column)
    check_source(spec)
    return spec


def _check_model(model: Optional[str]) -> None:
    """Refuse an unreachable, uncached hub id in about a second, before torch or a model loads."""
    from kvtool.hub import check_model_option

    check_model_option(model)


def _check_recipe(recipe: Optional[str]) -> None:
    """Refuse a bad --recipe before torch or a model loads (the API loads it again; YAML parsing is instant)."""
    if recipe is not None:
        from kvtool.recipe import load_recipe

        load_recipe(recipe)


def _model_known_early(model: Optional[str], artifact: Optional[Path]) -> bool:
    """Without --model an artifact brings its own model (found when it loads): then only the runtime checks it."""
    return not (model is None and artifact is not None)


def _check_context(model: Optional[str], tokens: int, asked: str, fix: str, artifact: Optional[Path] = None) -> None:
    """Refuse a request longer than the model's context limit from its config.json, before the model loads."""
    if not _model_known_early(model, artifact):
        return
    from kvtool.context_limit import check_context_early

    check_context_early(model, tokens, asked, fix)


def _check_prompts(model: Optional[str], artifact: Optional[Path], prompts: list[str], max_new_tokens: int) -> None:
    """Refuse prompts + --max-new-tokens beyond the context limit before the model loads.

    A token covers at least one byte of UTF-8, so short prompts pass on their length alone; longer
    ones are counted with the model's tokenizer (no weights loaded).
    """
    from kvtool.context_limit import check_prompt_fits, max_positions

    limit = max_positions(model) if _model_known_early(model, artifact) else None
    if limit is None or max(len(p.encode()) for p in prompts) + max_new_tokens + 8 <= limit:
        return
    from kvtool.models.loading import load_tokenizer, resolve_model_path

    tokens = max(len(load_tokenizer(resolve_model_path(model))(p).input_ids) for p in prompts)
    check_prompt_fits(tokens, max_new_tokens, limit)


def _check_plot_path(path: Optional[Path]) -> None:
    if path is not None:
        from kvtool.plotting import check_plot_path

        check_plot_path(path)


def _check_json_path(path: Optional[Path]) -> None:
    """Refuse an unusable --json path before any work starts."""
    if path is not None:
        from kvtool.fileio import check_output_path

        check_output_path(path)


def _write_json(path: Optional[Path], payload: dict | list) -> None:
    if path is None:
        return
    from kvtool.fileio import write_json_atomic

    write_json_atomic(path, payload)
    err_console.print(f"wrote {path}")


# --- commands ---------------------------------------------------------------------------------
@app.command()
@_friendly
def profile(
    data: DataOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Profile artifact to write (.safetensors).")],
    model: ModelOpt = None,
    samples: SamplesOpt = 8,
    seq_len: SeqLenOpt = 512,
    seed: SeedOpt = 0,
    batch_size: BatchOpt = 4,
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help="Recipe whose eviction section sets T, r_l, r_f and the sink tokens. Default: FastGen's paper settings.")] = None,
    threshold: Annotated[Optional[float], typer.Option(help="FastGen attention-mass threshold T in (0, 1]. Default: the recipe's eviction.threshold (0.95).")] = None,
    local_ratio: Annotated[Optional[float], typer.Option("--local-ratio", help="FastGen local window as a fraction of the length. Default: the recipe's (0.3).")] = None,
    frequent_ratio: Annotated[Optional[float], typer.Option("--frequent-ratio", help="FastGen heavy hitters as a fraction of the length. Default: the recipe's (0.3).")] = None,
    plot: PlotOpt = None,
    text_column: TextColumnOpt = "text",
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    device_map: DeviceMapOpt = None,
):
    """Per-layer, per-KV-head K/V statistics and FastGen attention policies on calibration text."""
    spec = _data(data, text_column)
    _check_recipe(recipe)
    _check_model(model)
    _check_context(model, seq_len, f"--seq-len {seq_len}", "lower --seq-len")
    _check_plot_path(plot)
    from kvtool import api
    from kvtool.attention_profile import policy_map
    from kvtool.cli_render import render_profile

    _quiet_libraries()
    artifact = api.profile(
        spec, out, model, recipe=recipe, threshold=threshold, local_ratio=local_ratio,
        frequent_ratio=frequent_ratio, samples=samples, seq_len=seq_len, seed=seed,
        batch_size=batch_size, load=_load_options(dtype, device, device_map), progress=_progress,
    )
    render_profile(console, artifact)
    console.print(f"wrote profile [bold]{out}[/]")
    _write_plot(plot, policy_map(artifact.tensors))


def _write_plot(path: Optional[Path], policies) -> None:
    if path is None:
        return
    from kvtool.plots_profile import write_policy_heatmap

    if policies is None:
        raise KvtoolError("the artifact holds no FastGen policy map (heads.policy): make one with `kvtool profile`")
    write_policy_heatmap(policies, path)
    err_console.print(f"wrote {path}")


@app.command()
@_friendly
def calibrate(
    data: DataOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Calibration artifact to write (.safetensors).")],
    model: ModelOpt = None,
    recipe: RecipeOpt = None,
    samples: Annotated[Optional[int], typer.Option(help="Calibration windows. Default: the recipe's calibration.samples.")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per window. Default: the recipe's calibration.seq_len.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed. Default: the recipe's calibration.seed.")] = None,
    batch_size: BatchOpt = 4,
    text_column: TextColumnOpt = "text",
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    device_map: DeviceMapOpt = None,
    layer_by_layer: LayerByLayerOpt = False,
    resume: ResumeOpt = False,
    max_memory: MaxMemoryOpt = None,
    offload_folder: OffloadFolderOpt = None,
):
    """Fit and measure the recipe's quantizers on calibration text."""
    spec = _data(data, text_column)
    _check_recipe(recipe)
    _check_model(model)
    if seq_len is not None:
        _check_context(model, seq_len, f"--seq-len {seq_len}", "lower --seq-len")
    from kvtool import api
    from kvtool.cli_render import render_calibration

    _quiet_libraries()
    artifact = api.calibrate(
        spec, out, model, recipe, samples=samples, seq_len=seq_len, seed=seed,
        batch_size=batch_size, load=_load_options(dtype, device, device_map, max_memory, offload_folder),
        progress=_progress, layer_by_layer=layer_by_layer, resume=resume,
    )
    render_calibration(console, artifact)
    console.print(f"wrote calibration [bold]{out}[/]")


@app.command()
@_friendly
def export(
    calib: Annotated[Path, typer.Option("--calib", "-c", help="Calibration artifact from `kvtool calibrate`.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Deployable artifact to write (.safetensors), or a new folder for --format vllm.")],
    model: ModelOpt = None,
    profile: Annotated[Optional[Path], typer.Option("--profile", "-p", help="Profile artifact from `kvtool profile` to include.")] = None,
    format: Annotated[str, typer.Option("--format", "-f", help="kvtool (deployable artifact) or vllm (model folder for `vllm serve --kv-cache-dtype fp8`).")] = "kvtool",
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    device_map: DeviceMapOpt = None,
):
    """Validate calibration (and profile) against the model and write one deployable artifact."""
    from kvtool import api

    _quiet_libraries()
    artifact = api.export(calib, out, model, profile, format=format, load=_load_options(dtype, device, device_map))
    if format == "vllm":
        console.print(f"wrote vLLM model folder [bold]{out}[/] (serve it with: vllm serve {out} --kv-cache-dtype fp8)")
        return
    bits = artifact.manifest.get("expected_bits_per_element", {})
    console.print(f"wrote artifact [bold]{out}[/] ({len(artifact.tensors)} tensors, {bits.get('body', 0):.2f} bits per body element)")


@app.command()
@_friendly
def generate(
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="Prompt text; repeat for a batch (left-padded).")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", help="File whose whole text is one prompt.")] = None,
    model: ModelOpt = None,
    artifact: Annotated[Optional[Path], typer.Option("--artifact", "-a", help="Deployable artifact from `kvtool export`.")] = None,
    recipe: RecipeOpt = None,
    profile: ProfileOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate per prompt.")] = 64,
    sample: Annotated[bool, typer.Option("--sample/--greedy", help="Sample instead of greedy decoding.")] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (with --sample).")] = 1.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (with --sample).")] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed for sampling (with --sample; greedy decoding needs none).")] = 0,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    device_map: DeviceMapOpt = None,
    backend: BackendOpt = "auto",
):
    """Generate with the compressed cache; ends with cache bytes vs the 16-bit cache and tokens/s."""
    from kvtool.cli_render import read_prompts

    prompts = read_prompts(prompt, prompt_file)
    _check_recipe(recipe)
    _check_model(model)
    _check_context(model, max_new_tokens + 1, f"--max-new-tokens {max_new_tokens} after a prompt",
                   "lower --max-new-tokens (-n)", artifact)
    _check_prompts(model, artifact, prompts, max_new_tokens)
    from kvtool import api
    from kvtool.cli_render import render_generation

    _quiet_libraries()
    stream = _prompt_then_text(prompts[0]) if len(prompts) == 1 else None
    result = api.generate(
        prompts, model, artifact, recipe, max_new_tokens=max_new_tokens, do_sample=sample,
        temperature=temperature, top_p=top_p, seed=seed, on_text=stream, profile=profile,
        load=_load_options(dtype, device, device_map), backend=backend,
    )
    render_generation(console, prompts, result, streamed=stream is not None)


def _prompt_then_text(prompt: str):
    """Streaming callback: the prompt (dim) before the first generated text, so errors print no prompt."""
    started = []

    def show(text: str) -> None:
        if not started:
            console.print(prompt, end="", style="dim", highlight=False, markup=False)
            started.append(True)
        console.print(text, end="", highlight=False, markup=False)

    return show


@eval_app.command("ppl")
@_friendly
def eval_ppl(
    data: DataOpt,
    model: ModelOpt = None,
    artifact: EvalArtifactOpt = None,
    recipe: EvalRecipesOpt = None,
    profile: ProfileOpt = None,
    samples: SamplesOpt = 4,
    seq_len: SeqLenOpt = 1024,
    prefill: Annotated[Optional[int], typer.Option(help="Tokens written to the cache before scoring. Default: seq_len / 2.")] = None,
    chunk: Annotated[int, typer.Option(help="Tokens per decode forward. 1 = true decoding; >1 is a faster approximation.")] = 1,
    batch_size: BatchOpt = 4,
    baseline: Annotated[bool, typer.Option("--baseline/--no-baseline", help="Also score the 16-bit cache (the baseline) and, where the model is not 16-bit, its own dtype's cache.")] = True,
    model_dtype_row: Annotated[bool, typer.Option("--model-dtype-row/--no-model-dtype-row", help="With the baseline, also score the cache in the model's own dtype where it is not 16-bit (float32 on CPU). --no-model-dtype-row: one pass fewer; the delta is against the 16-bit cache either way.")] = True,
    json_out: JsonOutOpt = None,
    text_column: TextColumnOpt = "text",
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    device_map: DeviceMapOpt = None,
    backend: BackendOpt = "auto",
):
    """Perplexity through the real runtime: prefill into the cache, then score while decoding."""
    spec = _data(data, text_column)
    recipes = list(recipe or [])
    for each in recipes:
        _check_recipe(each)
    _check_model(model)
    _check_json_path(json_out)
    _check_context(model, seq_len, f"--seq-len {seq_len}", "lower --seq-len", artifact)
    from kvtool import api
    from kvtool.cli_render import render_perplexity

    _quiet_libraries()
    several = len(recipes) + (artifact is not None) > 1  # one column per cache, a JSON list
    report = api.evaluate_perplexity(
        spec, model, artifact, recipes if several else (recipes[0] if recipes else None), samples=samples, seq_len=seq_len, prefill=prefill,
        chunk=chunk, batch_size=batch_size, baseline=baseline, profile=profile,
        load=_load_options(dtype, device, device_map), progress=_progress, backend=backend, model_dtype=model_dtype_row,
    )
    render_perplexity(console, report)
    _write_json(json_out, report)


@eval_app.command("pool")
@_friendly
def eval_pool(
    reports: Annotated[list[Path], typer.Argument(help="`kvtool eval ppl --json` reports of the same protocol on disjoint windows, e.g. -d file.txt, file.txt\\[0.25:1], file.txt\\[0.5:1].")],
    target: Annotated[Optional[float], typer.Option(help="A tolerance in percent (e.g. 3 for <= +3%): each recipe's pooled interval is read against it (under / over / not resolved).")] = None,
    json_out: JsonOutOpt = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a forest plot here (.png; needs matplotlib): each set's delta and interval, the pooled one, the target.")] = None,
):
    """One perplexity delta per recipe over several sets of windows: the sets' paired intervals pooled into one."""
    _check_json_path(json_out)
    if plot is not None:
        from kvtool.plotting import check_plot_path

        check_plot_path(plot)
    from kvtool import api
    from kvtool.cli_render import render_pooled

    skipped: list[str] = []
    pooled = api.pool_perplexity(reports, target_pct=target, skipped=skipped)
    render_pooled(console, pooled)
    if skipped:
        console.print(f"[yellow]note:[/] not pooled, in one report only: {escape(', '.join(skipped))}", highlight=False)
    if plot is not None:
        from kvtool.eval.plots import plot_pooled

        err_console.print(f"wrote {plot_pooled(pooled, plot, target)}")
    _write_json(json_out, pooled)


@eval_app.command("retrieval")
@_friendly
def eval_retrieval(
    model: ModelOpt = None,
    artifact: EvalArtifactOpt = None,
    recipe: EvalRecipeOpt = None,
    profile: ProfileOpt = None,
    task: Annotated[str, typer.Option(help="passkey: pass key sentences in --data text (needs a tokenizer); copy: random-token needle (token-id models).")] = "passkey",
    data: Annotated[Optional[str], typer.Option("--data", "-d", help="Held-out filler text for --task passkey (same forms as other commands' --data).")] = None,
    lengths: Annotated[str, typer.Option(help="Context lengths in tokens, comma-separated.")] = "256,512",
    depths: Annotated[str, typer.Option(help="Depths of the fact, fractions of the context (0 = start, 1 = just before the question).")] = "0,0.25,0.5,0.75,1",
    seeds: Annotated[int, typer.Option(help="Cases per (length, depth) cell, one batch.")] = 3,
    facts: Annotated[int, typer.Option(help="Pass keys in the context (--task passkey); one is asked.")] = 1,
    baseline: Annotated[bool, typer.Option("--baseline/--no-baseline", help="Also run the 16-bit cache (the baseline).")] = True,
    question_agnostic: Annotated[bool, typer.Option("--question-agnostic", help="Compress the context before the question is fed (one compressed document, any question).")] = False,
    json_out: JsonOutOpt = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a depth x length accuracy heatmap here (.png; needs matplotlib).")] = None,
    text_column: TextColumnOpt = "text",
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    device_map: DeviceMapOpt = None,
    backend: BackendOpt = "auto",
):
    """Retrieval through the real runtime: a fact at depth d of an n-token context, asked at the end; exact-match accuracy."""
    from kvtool.eval.retrieval_request import RetrievalGrid, check_retrieval_request, parse_numbers

    spec = None if data is None else _data(data, text_column)
    grid = RetrievalGrid(parse_numbers(lengths, int, "--lengths"), parse_numbers(depths, float, "--depths"), seeds)
    check_retrieval_request(task, spec, facts, plot)
    _check_recipe(recipe)
    _check_model(model)
    _check_json_path(json_out)
    _check_context(model, max(grid.lengths), f"--lengths up to {max(grid.lengths)}", "lower --lengths", artifact)
    from kvtool import api
    from kvtool.cli_render import render_retrieval

    _quiet_libraries()
    report = api.evaluate_retrieval(
        model, artifact, recipe, task=task, data=spec, lengths=grid.lengths, depths=grid.depths,
        seeds=seeds, facts=facts, baseline=baseline, plot=plot, profile=profile,
        load=_load_options(dtype, device, device_map), progress=_progress, backend=backend, question_agnostic=question_agnostic,
    )
    render_retrieval(console, report)
    _write_json(json_out, report)


@app.command()
@_friendly
def inspect(
    artifact: Annotated[Path, typer.Argument(help="Any kvtool artifact (profile, calibration or deployable).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest and tensor list as JSON.")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the artifact's model-card section (Markdown), "
                                           "ready for a hub README.")] = False,
    plot: PlotOpt = None,
):
    """Show an artifact's manifest, model, recipe, quality, tensors and FastGen policy map."""
    from kvtool import api
    from kvtool.attention_profile import load_policy_map
    from kvtool.cli_render import render_inspect, render_policy_map

    if as_json and markdown:
        raise RuntimeConfigError("--json and --markdown are two output formats: pass one of them")
    _check_plot_path(plot)
    info = api.inspect(artifact)
    if markdown:
        from kvtool.hub import model_card

        print(model_card(info["manifest"]))
        return
    has_map = any(name.endswith("heads.policy") for name in info["tensors"])
    policies = load_policy_map(artifact) if has_map else None
    _write_plot(plot, policies)
    if as_json:
        console.print_json(json.dumps(info))
    else:
        render_inspect(console, info)
        if policies is not None:
            render_policy_map(console, policies, info["manifest"].get("fastgen", {}).get("threshold"))


@app.command()
def recipes():
    """List the bundled recipes (and the ablation set) with what each stores and drops."""
    from kvtool.cli_render import recipe_table
    from kvtool.recipe import bundled_recipe_dir, load_recipe
    from kvtool.recipe_summary import recipe_summary

    table = recipe_table(title="Bundled recipes (descriptions: the YAML files in recipes/)")
    root = bundled_recipe_dir()
    for path in [*sorted(root.glob("*.yaml")), *sorted(root.glob("ablation/*.yaml"))]:
        recipe = load_recipe(path)
        name = path.relative_to(root).with_suffix("").as_posix()  # 'kivi-4bit', 'ablation/nuq3' (what --recipe takes)
        table.add_row(name, *recipe_summary(recipe).values())
    console.print(table)


@app.command()
@_friendly
def run(
    data: DataOpt,
    out_dir: Annotated[Path, typer.Option("--out-dir", "-o", help="Folder for profile, calibration, artifact and report.")] = Path("kvtool-run"),
    model: ModelOpt = None,
    recipe: RecipeOpt = None,
    calib_fraction: Annotated[float, typer.Option(help="Leading fraction of the text used to calibrate; the rest evaluates.")] = 0.9,
    samples: Annotated[int, typer.Option(help="Calibration windows.")] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per calibration window.")] = 512,
    eval_samples: Annotated[int, typer.Option(help="Evaluation windows.")] = 4,
    eval_seq_len: Annotated[int, typer.Option(help="Tokens per evaluation window (half prefill, half decoded).")] = 512,
    prompt: Annotated[str, typer.Option(help="Prompt for the generated sample.")] = "Once upon a time",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate for the sample (enough to fill a quantized block).")] = 128,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
):
    """The whole pipeline: profile, calibrate, export, perplexity with and without compression, a sample."""
    _data(data, "text")  # bad data or recipe: one error line before torch or a model loads
    _check_recipe(recipe)
    _check_model(model)
    _check_context(model, seq_len, f"--seq-len {seq_len}", "lower --seq-len")
    _check_context(model, eval_seq_len, f"--eval-seq-len {eval_seq_len}", "lower --eval-seq-len")
    from kvtool.cli_render import render_summary
    from kvtool.pipeline import run_pipeline

    _quiet_libraries()
    summary = run_pipeline(
        data, out_dir, model, recipe, calib_fraction=calib_fraction, samples=samples, seq_len=seq_len,
        eval_samples=eval_samples, eval_seq_len=eval_seq_len, prompt=prompt, max_new_tokens=max_new_tokens,
        load=_load_options(dtype, device, None), progress=_progress, log=lambda msg: err_console.print(f"[cyan]>[/] {msg}"),
    )
    render_summary(console, summary)


if __name__ != "__main__":  # under `python -m kvtool.cli` the imported module registers them (below)
    from kvtool.cli_scale import register as _register_scale_commands

    _register_scale_commands(app)  # plan, push, pull, card
    from kvtool.cli_fit import register as _register_fit_commands

    _register_fit_commands(app)  # fit-windows


def main() -> None:  # console-script entry point
    app(prog_name="kvtool")


if __name__ == "__main__":
    from kvtool.cli import main as _main  # the imported module: every command registered

    _main()
