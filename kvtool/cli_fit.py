"""CLI command ``kvtool fit-windows``: each sliding-window layer's share of its window, fitted from its measured cost.

Registered on the CLI's app by `register(app)` (called at the end of `kvtool.cli`); thin: options, one call into
`kvtool.api.fit_windows`, a Rich table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from kvtool.cli import (
    DataOpt, DeviceOpt, DtypeOpt, JsonOutOpt, ModelOpt, SeedOpt, TextColumnOpt, _check_json_path, _check_model, _check_recipe,
    _data, _friendly, _load_options, _progress, _quiet_libraries, _write_json, console,
)


@_friendly
def fit_windows(
    data: DataOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Recipe YAML to write: the --recipe's codes with StreamingLLM on the sliding-window layers at the fitted shares.")],
    model: ModelOpt = None,
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help="Recipe whose keys, values and cache the written recipe keeps (eviction none or streamingllm). Default: uncompressed.")] = None,
    mean_share: Annotated[float, typer.Option("--mean-share", help="Share of the sliding-window layers' windows kept, over all of them (0.3: 30% of their tokens).")] = 0.3,
    shares: Annotated[Optional[str], typer.Option("--shares", help="Candidate shares per layer, comma-separated, in (0, 1] (1: the whole window; --mean-share is always one). Default: 0.125,0.25,0.5,0.75,1.")] = None,
    samples: Annotated[int, typer.Option(help="Calibration windows (each cut is measured on every one).")] = 3,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per window; the second half is scored, so at least twice the model's largest sliding window. Default: exactly that.")] = None,
    seed: SeedOpt = 0,
    name: Annotated[Optional[str], typer.Option(help="Name of the written recipe. Default: <recipe>-fitted-windows.")] = None,
    json_out: JsonOutOpt = None,
    text_column: TextColumnOpt = "text",
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
):
    """Fit how much of its window each sliding-window layer keeps (Gemma 2/3, windowed Mistral) from each layer's measured cost."""
    from kvtool.errors import RuntimeConfigError
    from kvtool.fileio import check_output_path

    spec = _data(data, text_column)
    _check_recipe(recipe)
    _check_model(model)
    _check_json_path(json_out)
    check_output_path(out)
    try:
        candidates = None if shares is None else tuple(float(s) for s in shares.split(",") if s.strip())
    except ValueError:
        raise RuntimeConfigError(f"--shares takes comma-separated fractions like 0.125,0.25,0.5, got {shares!r}") from None
    from kvtool import api

    _quiet_libraries()
    written, fit = api.fit_windows(
        spec, out, model, recipe, mean_share=mean_share, shares=candidates, samples=samples, seq_len=seq_len, seed=seed,
        name=name, load=_load_options(dtype, device, None), progress=_progress,
    )
    report = fit.to_dict()
    table = Table("layer", "window", *[f"{s:g}" for s in fit.shares], "fitted share", "kept",
                  title=f"KL change from the uncompressed model (10^-3 nats per token) when one layer keeps another share of "
                        f"its window, every other one {fit.mean_share:g}")
    for row in report["layers"]:
        table.add_row(str(row["layer"]), str(row["window"]), *[f"{1e3 * v:+.1f}" for v in row["kl"].values()],
                      f"{row['fitted_share']:g}", str(row["kept_tokens"]))
    console.print(table)
    console.print(
        f"every layer at once (teacher-forced, {report['scored_tokens']} scored tokens, baseline perplexity "
        f"{report['baseline_ppl']:.3f}): fitted shares {report['fitted_ppl_delta_pct']:+.2f}% perplexity, KL "
        f"{1e3 * report['fitted_kl']:.1f}e-3; {fit.mean_share:g} on every layer {report['uniform_ppl_delta_pct']:+.2f}%, KL "
        f"{1e3 * report['uniform_kl']:.1f}e-3 -> the recipe keeps the "
        + ("fitted shares" if fit.fitted_wins else f"one share {fit.mean_share:g} ("
           + ("no other allocation of the candidate shares costs less" if set(fit.fitted) == {fit.mean_share}
              else "the fitted ones did not measure better") + ")")
        + f" ({report['held_share']:.1%} of the windows' tokens)"
    )
    _write_json(json_out, {**report, "recipe": written.to_dict()})
    console.print(f"wrote recipe [bold]{out}[/] ({written.name}); measure it with `kvtool eval ppl -r {out}`")


def register(app: typer.Typer) -> None:
    """Add fit-windows to the ``kvtool`` app."""
    app.command(name="fit-windows")(fit_windows)
