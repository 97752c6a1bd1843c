"""PNG heatmap of a profile's FastGen policy map (layer x KV head), for `kvtool profile/inspect --plot`.

matplotlib comes from the ``plots`` extra; `kvtool.plotting.require_matplotlib` fails early with the
install command, before any long run.
"""

from __future__ import annotations

from pathlib import Path

from kvtool.attention_profile import PolicyMap
from kvtool.fileio import atomic_write
from kvtool.methods.evict.fastgen import FASTGEN_POLICIES, PUNCTUATION
from kvtool.plotting import require_matplotlib

# one colour per policy, cheap (cool) to expensive (warm); the terminal map uses the same hues
POLICY_COLOURS = ("#8e44ad", "#f1c40f", "#27ae60", "#2e86c1", "#c0392b")


def write_policy_heatmap(policies: PolicyMap, path: str | Path, title: str = "FastGen policy per KV head") -> Path:
    """Write a layer x KV-head heatmap of the chosen policies (cell text = policy name) as PNG."""
    plt = require_matplotlib()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    grid = policies.policy.cpu().numpy()  # (L, H)
    layers, heads = grid.shape
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * heads, 1.2 + 0.35 * layers))
    ax.imshow(grid, cmap=ListedColormap(POLICY_COLOURS), vmin=-0.5, vmax=len(FASTGEN_POLICIES) - 0.5, aspect="auto")
    for layer in range(layers):
        for head in range(heads):
            ink = "black" if grid[layer, head] == PUNCTUATION else "white"  # readable on yellow
            ax.text(head, layer, FASTGEN_POLICIES[grid[layer, head]], ha="center", va="center", fontsize=7, color=ink)
    ax.set_xticks(range(heads), [str(h) for h in range(heads)])
    ax.set_yticks(range(layers), [str(layer) for layer in range(layers)])
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    expected = policies.expected_cache_fraction
    ax.set_title(title if expected is None else f"{title}\nexpected cache fraction {expected:.2f}", fontsize=9)
    legend = [Patch(color=c, label=name) for c, name in zip(POLICY_COLOURS, FASTGEN_POLICIES)]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=7, frameon=False)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    plt.close(fig)
    return Path(path)
