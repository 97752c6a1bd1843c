"""Per-layer bit mixes for `kvtool plan`: lower the bits of the layers that mind it least first.

Two candidates of one uniform (KIVI-style) family that differ only in their code widths
(kivi-4bit and kivi-2bit: same axes, groups, block and float window) bound a range of bytes;
a mix stores some layers at the low width and the rest at the high one (``layer_overrides``),
so its bytes lie strictly between theirs. Which layers to lower comes from a measurement:

1. the layers are split into ``groups`` contiguous groups (`layer_groups`); for each group the
   plan measures the perplexity delta of the high recipe with only that group at the low width
   (its *sensitivity*: the delta it adds over the high recipe, per layer lowered);
2. greedily, the least sensitive groups are lowered first: mix k lowers the k least sensitive
   groups (k = 1 .. groups - 1), each measured like any other candidate (mix 1 is the probe of
   its group, measured once).

Families: each set of uniform candidates equal up to their widths, mixed between adjacent widths
(kivi-2bit, kivi-4bit and int8 give 4/2 and 8/4 mixes). Costs ``2 x groups - 2`` perplexity
measurements per pair of widths.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvtool.recipe import Recipe
from kvtool.recipe_layers import LayerOverride


def _family_key(recipe: Recipe) -> Recipe:
    """The recipe with name, description and code widths blanked: equal keys = one family."""
    blank = lambda spec: dataclasses.replace(spec, bits=8)  # noqa: E731
    return dataclasses.replace(recipe, name="-", description="", keys=blank(recipe.keys), values=blank(recipe.values))


def mixable(recipe: Recipe) -> bool:
    """Uniform keys and values, nothing evicted, no sparse reads, no overrides of its own."""
    return (recipe.keys.method == recipe.values.method == "uniform" and not recipe.evicts
            and not recipe.sparse_attention.enabled and not recipe.layer_overrides)


def mix_pairs(recipes: list[Recipe]) -> list[tuple[Recipe, Recipe]]:
    """(high, low) recipes of adjacent widths within each family of mixable candidates (wider first)."""
    families: dict[Recipe, list[Recipe]] = {}
    for recipe in recipes:
        if mixable(recipe):
            families.setdefault(_family_key(recipe), []).append(recipe)
    pairs = []
    for members in families.values():
        widths = sorted({(r.keys.bits, r.values.bits): r for r in members}.items(), reverse=True)
        pairs += [(high, low) for (_, high), (_, low) in zip(widths, widths[1:])]
    return pairs


def layer_groups(num_layers: int, groups: int) -> list[tuple[int, ...]]:
    """``groups`` contiguous groups of layers of near-equal size (fewer when the model has fewer layers)."""
    return [tuple(int(i) for i in part) for part in np.array_split(np.arange(num_layers), min(groups, num_layers))]


def lowered(high: Recipe, low: Recipe, layers: list[int], name: str | None = None) -> Recipe:
    """``high`` with ``layers`` stored at ``low``'s widths, named ``name`` or ``{high}+{n}x{low bits}bit``."""
    layers = tuple(sorted(layers))
    override = LayerOverride(layers, keys=(("bits", low.keys.bits),), values=(("bits", low.values.bits),))
    bits = low.keys.bits if low.keys.bits == low.values.bits else f"K{low.keys.bits}V{low.values.bits}"
    return dataclasses.replace(
        high, name=name or f"{high.name}+{len(layers)}x{bits}bit", layer_overrides=(override,),
        description=f"{high.name} with layers {list(layers)} at the widths of {low.name} (the least sensitive to it on "
                    "the search windows, chosen by kvtool plan)",
    )


def greedy_mixes(high: Recipe, low: Recipe, groups: list[tuple[int, ...]], added: list[float]) -> list[Recipe]:
    """Mixes lowering 1 .. len(groups) - 1 groups, least ``added`` delta per layer first (ties: lower layers first)."""
    order = sorted(range(len(groups)), key=lambda g: (added[g] / len(groups[g]), g))
    return [lowered(high, low, [i for g in order[:k] for i in groups[g]]) for k in range(1, len(groups))]
