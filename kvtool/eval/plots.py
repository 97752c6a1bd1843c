"""PNG figures of the eval commands: the retrieval heatmap (depth x length, `kvtool eval retrieval --plot`) and the
forest plot of pooled perplexity deltas (`kvtool eval pool --plot`).

matplotlib comes from the ``plots`` extra (`kvtool.plotting.require_matplotlib` says how to
install it when missing).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from kvtool.fileio import atomic_write
from kvtool.plotting import check_plot_path, require_matplotlib


def _accuracy_matrix(report: dict, key: str) -> list[list[float]]:
    """rows = depths, columns = lengths, as in report['grid']."""
    cells = {(row["depth"], row["n"]): row[key] for row in report["grid"]}
    return [[cells[(d, n)] for n in report["lengths"]] for d in report["depths"]]


def _heatmap(ax, matrix: list[list[float]], report: dict, title: str):
    image = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(report["lengths"])), [str(n) for n in report["lengths"]])
    ax.set_yticks(range(len(report["depths"])), [f"{d:g}" for d in report["depths"]])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("depth of the fact")
    ax.set_title(title)
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    return image


def plot_retrieval(report: dict, path: str | Path) -> Path:
    """Heatmap PNG of retrieval accuracy (depth x length): compressed, and the baseline beside it if measured."""
    check_plot_path(path)
    plt = require_matplotlib()
    panels = [("accuracy", f"{report['recipe']}: accuracy {report['accuracy']:.2f}")]
    if report.get("baseline_accuracy") is not None:
        panels.append(("baseline_accuracy", f"{report.get('baseline', 'baseline')}: accuracy {report['baseline_accuracy']:.2f}"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 1, 3.5), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        image = _heatmap(ax, _accuracy_matrix(report, key), report, title)
    fig.colorbar(image, ax=axes[0].tolist(), label="exact-match accuracy")
    fig.suptitle(f"{report['task']} retrieval, {report['seeds']} seeds per cell")
    if report.get("note"):  # e.g. the baseline is at chance: the figure says nothing about compression
        fig.text(0.5, -0.02, "\n".join(textwrap.wrap("NOTE: " + report["note"], 110)), ha="center", va="top",
                 color="darkred", fontsize=8)
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    finally:
        plt.close(fig)


def plot_pooled(pooled: list[dict], path: str | Path, target_pct: float | None = None) -> Path:
    """Forest plot PNG: per recipe, each set's delta with its 95% interval, then the pooled delta (bold), and the
    target as a dashed line where one is given."""
    check_plot_path(path)
    plt = require_matplotlib()
    rows = []  # (label, delta, low, high, pooled?)
    for row in pooled:
        rows += [(f"{each['data']}, {each['windows']} windows", each["delta_pct"], *each["delta_ci95_pct"], False)
                 for each in row["set_deltas"]]
        rows.append((f"{row['recipe']}: {row['sets']} sets", row["delta_pct"], *row["delta_ci95_pct"], True))
    fig, ax = plt.subplots(figsize=(7.5, 0.35 * len(rows) + 1.2))
    for y, (label, delta, low, high, whole) in enumerate(reversed(rows)):
        ax.errorbar(delta, y, xerr=[[delta - low], [high - delta]], fmt="D" if whole else "o",
                    color="black" if whole else "tab:blue", markersize=7 if whole else 4, capsize=3,
                    linewidth=2 if whole else 1)
    ax.set_yticks(range(len(rows)), [label for label, *_ in reversed(rows)], fontsize=8)
    ax.axvline(0.0, color="grey", linewidth=0.8)
    if target_pct is not None:
        ax.axvline(target_pct, color="darkred", linestyle="--", linewidth=1, label=f"target {target_pct:+g}%")
        ax.legend(loc="best", fontsize=8)
    ax.set_xlabel("perplexity delta vs the 16-bit cache (%), paired 95% interval")
    ax.set_title("Perplexity delta per set of windows and pooled")
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    finally:
        plt.close(fig)
