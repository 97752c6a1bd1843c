"""CLI commands for scale and sharing: ``kvtool plan``, ``kvtool push``, ``kvtool pull``.

Registered on the CLI's app by `register(app)` (called at the end of `kvtool.cli`); thin like the rest:
options, one call into `kvtool.plan` / `kvtool.hub`, Rich output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from kvtool.cli import DataOpt, DtypeOpt, DeviceOpt, ModelOpt, _friendly, _load_options, _quiet_libraries, console, err_console


@_friendly
def plan(
    data: DataOpt,
    model: ModelOpt = None,
    context: Annotated[int, typer.Option("--context", "-c", help="Tokens per sequence the cache must hold.")] = 4096,
    batch: Annotated[int, typer.Option("--batch", "-b", help="Sequences held at once.")] = 1,
    budget_gb: Annotated[Optional[float], typer.Option("--budget-gb", help="Cache budget in GB (10^9 bytes), K and V of every layer.")] = None,
    target_ratio: Annotated[Optional[float], typer.Option("--target-ratio", help="Instead of --budget-gb: times smaller than a 16-bit cache.")] = None,
    max_ppl_delta: Annotated[Optional[float], typer.Option("--max-ppl-delta", help="Refuse candidates whose measured perplexity delta (%) is larger.")] = None,
    recipe: Annotated[Optional[list[str]], typer.Option("--recipe", "-r", help="Candidate recipe (repeat). Default: every bundled recipe whose bytes it can predict (all but FastGen and CAKE).")] = None,
    out_dir: Annotated[Path, typer.Option("--out-dir", "-o", help="Folder for plan.yaml (the chosen recipe), plan.json and pareto.png.")] = Path("kvtool-plan"),
    samples: Annotated[int, typer.Option(help="Windows the quality of each candidate is measured on.")] = 2,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per measurement window (half prefill, half decoded).")] = 256,
    calib_samples: Annotated[int, typer.Option(help="Calibration windows for candidates that learn from data (nuq, palu).")] = 4,
    mix: Annotated[Optional[bool], typer.Option("--mix/--no-mix", help="Per-layer bit mixes between uniform candidates that differ only in bits (kivi-4bit and kivi-2bit): the least sensitive layers lowered first. Default: on when such candidates are listed; --mix requires them.")] = None,
    mix_groups: Annotated[int, typer.Option("--mix-groups", help="Contiguous layer groups whose sensitivity to the lower width is measured (mixes lower 1 .. N-1 of them; costs 2N-2 measurements per pair).")] = 4,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
):
    """Which recipe fits a cache budget at a context and batch: predicted bytes, measured quality, a Pareto plot."""
    from kvtool.plan import plan as run_plan

    _quiet_libraries()
    report = run_plan(
        model, out_dir, context=context, batch=batch, budget_gb=budget_gb, target_ratio=target_ratio,
        max_ppl_delta=max_ppl_delta, data=data, recipes=recipe, samples=samples, seq_len=seq_len,
        calib_samples=calib_samples, mix=mix, mix_groups=mix_groups, load=_load_options(dtype, device, None),
        log=lambda msg: err_console.print(f"[cyan]>[/] {msg}"),
    )
    table = Table("recipe", "predicted cache", "bits/elem", "ppl delta % (search)", "fits", title=(
        f"budget {report['budget_bytes'] / 1e9:.3g} GB, context {report['context']} x batch {report['batch']} "
        f"(16-bit: {report['fp16_cache_bytes'] / 1e9:.3g} GB)"))
    for c in sorted(report["candidates"], key=lambda c: c["predicted_bytes"]):
        mark = "[bold green]chosen[/]" if c["chosen"] else ("yes" if c["fits"] else "[dim]no[/]")
        table.add_row(c["recipe"], f"{c['predicted_bytes'] / 1e9:.4g} GB", f"{c['bits_per_element']:.2f}",
                      f"{c['ppl_delta_pct']:+.2f}", mark)
    console.print(table)
    check = report["check"]
    console.print(
        f"check on held-out text: {report['chosen']} perplexity delta {check['ppl_delta_pct']:+.2f}% "
        f"(baseline {check['baseline_ppl']:.3f}); cache after {check['context']} tokens: "
        f"{check['measured_bytes']} bytes held (at most {check['most_bytes_held']} on the way) vs {check['predicted_bytes']} predicted"
    )
    for entry in report["mixes"]:
        console.print(
            f"mixes {entry['high']} / {entry['low']}: perplexity delta added by each layer group at the low width: "
            + ", ".join(f"layers {g[0]}-{g[-1]}: {d:+.2f}%" for g, d in zip(entry["groups"], entry["added_delta_pct"]))
        )
    for name, path in report["files"].items():
        console.print(f"wrote {name}: {path}")


@_friendly
def push(
    artifact: Annotated[Path, typer.Argument(help="A kvtool artifact (usually the deployable one from `kvtool export`).")],
    repo_id: Annotated[str, typer.Argument(help="Hub repository, owner/name (created if missing).")],
    filename: Annotated[Optional[str], typer.Option(help="File name in the repository. Default: the artifact's.")] = None,
    private: Annotated[bool, typer.Option(help="Create the repository private.")] = False,
):
    """Upload an artifact and its model card to a Hugging Face hub repository."""
    from kvtool.hub import push as push_artifact

    spec = push_artifact(artifact, repo_id, filename=filename, private=private)
    console.print(f"pushed: load it with --artifact {spec}")


@_friendly
def pull(
    spec: Annotated[str, typer.Argument(help="owner/name:file.safetensors[@revision]")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Also copy it here (atomically).")] = None,
):
    """Download a hub artifact (validated) into the hub cache, and optionally copy it to --out."""
    import shutil

    from kvtool.artifact import load_artifact
    from kvtool.fileio import atomic_write
    from kvtool.hub import resolve_artifact

    path = resolve_artifact(spec)
    loaded = load_artifact(path)
    if out is not None:
        atomic_write(out, lambda tmp: shutil.copyfile(path, tmp))
    console.print(f"{loaded.kind} artifact for {loaded.manifest.get('model_source', '?')}: {out or path}")


@_friendly
def card(
    artifact: Annotated[str, typer.Argument(help="A kvtool artifact path or owner/name:file.safetensors.")],
):
    """Print an artifact's model-card section (Markdown): recipe, model, calibration data, measured quality."""
    from kvtool.artifact import load_artifact
    from kvtool.hub import model_card

    print(model_card(load_artifact(artifact).manifest))


def register(app: typer.Typer) -> None:
    """Add plan, push, pull and card to the ``kvtool`` app."""
    for command in (plan, push, pull, card):
        app.command()(command)
