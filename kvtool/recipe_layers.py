"""Per-layer overrides of a recipe: some layers store keys or values at another code width or method,
or keep another share of their window.

A recipe's optional ``layer_overrides`` section lists entries; each names layers and the
``keys`` / ``values`` fields that differ there (``method``, ``bits``, ``group_size``), and/or the
``eviction.sliding_budget`` of sliding-window layers::

    layer_overrides:
      - {layers: "0-3", keys: {bits: 2}, values: {bits: 2}}   # layers 0, 1, 2 and 3
      - {layers: [10, 12], values: {method: none}}            # float values in layers 10 and 12
      - {layers: [3, 9], eviction: {sliding_budget: 1.0}}     # these sliding layers keep their whole window

An ``eviction`` entry needs a recipe whose ``eviction.sliding_budget`` is set (the share every other
sliding-window layer keeps) and may name sliding-window layers only (checked against the model when
a runtime is built): `kvtool fit-windows` writes such entries from each layer's measured cost.

``layers`` may also name a kind of attention layer, resolved against the model when a runtime
is built (`resolve_layer_kinds`): ``sliding`` (the layers with a sliding window, e.g. 15 of
Gemma-3-270M's 18) or ``full`` (the others). A recipe written this way fits every size of a
family (Gemma 3's 1B has 26 layers in the same 5:1 pattern), where indices fit one depth::

    layer_overrides:
      - {layers: sliding, keys: {bits: 2}}   # keys one bit lower where a layer holds only its window

On a model without such layers the entry changes nothing. An index may not also be named by a kind.

Layers not listed use the recipe's own ``keys`` / ``values``. `Recipe.for_layer(i)` resolves
layer i; the runtime builds each layer's store from it and `kvtool plan` predicts each layer's
bytes from it (its per-layer bit mixes are written this way). Only methods that learn nothing
from calibration can be mixed (uniform, fp8 with per-block scales, TurboQuant, none): the
others are fitted per layer for one spec, so a recipe that fits anything refuses overrides. The
exception is TurboQuant keys with ``channel_scale: query``: their scale comes from query and key
moments alone, whatever the width, so an override may change their ``bits`` (nothing else).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from kvtool.errors import RecipeError

if TYPE_CHECKING:  # recipe.py imports this module
    from kvtool.recipe import Recipe

OVERRIDABLE = ("method", "bits", "group_size")  # QuantSpec fields an override may change
EVICTION_OVERRIDABLE = ("sliding_budget",)  # EvictionSpec fields an override may change
ENTRY_FIELDS = ("layers", "keys", "values", "eviction")


def _fail(path: str, message: str) -> None:
    raise RecipeError(f"recipe field '{path}': {message}")


LAYER_KINDS = ("sliding", "full")  # layers: <kind> -> the sliding-window layers, or the full-attention ones


@dataclass(frozen=True)
class LayerOverride:
    """Layers (sorted indices) whose keys / values / eviction fields differ: ``(("bits", 2), ...)`` per part.

    kind: ``sliding`` or ``full`` instead of indices (``layers`` is then empty until
    `resolve_layer_kinds` turns the entry into the model's indices)."""

    layers: tuple[int, ...]
    keys: tuple[tuple[str, Any], ...] = ()
    values: tuple[tuple[str, Any], ...] = ()
    kind: str | None = None
    eviction: tuple[tuple[str, Any], ...] = ()

    @property
    def changes_storage(self) -> bool:
        """True when the entry changes how keys or values are stored (not only what its layers keep)."""
        return bool(self.keys or self.values)

    def fields(self, part: str) -> dict[str, Any]:
        return dict(getattr(self, part))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": self.kind if self.kind is not None else list(self.layers)}
        for part in ("keys", "values", "eviction"):
            if getattr(self, part):
                out[part] = self.fields(part)
        return out


def parse_layers(raw: Any, path: str) -> tuple[int, ...]:
    """Sorted distinct layer indices from an int, ``"a-b"`` (inclusive), or a list of either."""
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        _fail(path, "lists no layer; give indices like [0, 1] or a range like \"0-5\"")
    out: list[int] = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            if item < 0:
                _fail(path, f"{item} is not a layer index (indices start at 0)")
            out.append(item)
            continue
        parts = item.split("-") if isinstance(item, str) else []
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            _fail(path, f"{item!r} is not a layer index, a range like \"0-5\" or a kind of layer ({' or '.join(LAYER_KINDS)}, "
                        "alone)")
        lo, hi = int(parts[0]), int(parts[1])
        if lo > hi:
            _fail(path, f"range {item!r} runs backwards; write \"{hi}-{lo}\"")
        out.extend(range(lo, hi + 1))
    if len(set(out)) != len(out):
        twice = sorted({i for i in out if out.count(i) > 1})
        _fail(path, f"layers {twice} are listed twice")
    return tuple(sorted(out))


def parse_overrides(raw: Any) -> tuple[LayerOverride, ...]:
    """The ``layer_overrides`` section (a list of mappings) -> LayerOverrides; no layer in two entries."""
    if not isinstance(raw, list):
        _fail("layer_overrides", f"expected a list of {{layers, keys, values, eviction}} entries, got {type(raw).__name__}")
    out, seen = [], {}
    for n, entry in enumerate(raw):
        path = f"layer_overrides[{n}]"
        if not isinstance(entry, dict):
            _fail(path, f"expected a mapping with {list(ENTRY_FIELDS)}, got {type(entry).__name__}")
        unknown = sorted(map(str, set(entry) - set(ENTRY_FIELDS)))
        if unknown:
            raise RecipeError(f"recipe field '{path}.{unknown[0]}' is unknown; an entry has {list(ENTRY_FIELDS)}")
        if "layers" not in entry:
            raise RecipeError(f"recipe field '{path}.layers' is missing: name the layers the entry changes")
        kind = entry["layers"] if entry["layers"] in LAYER_KINDS else None  # resolved against the model later
        layers = () if kind is not None else parse_layers(entry["layers"], f"{path}.layers")
        for key in [kind] if kind is not None else layers:
            if key in seen:
                what = f"the {kind} layers are" if kind is not None else f"layer {key} is"
                _fail(f"{path}.layers", f"{what} already overridden by layer_overrides[{seen[key]}]")
            seen[key] = n
        parts = {part: _parse_fields(entry.get(part, {}), f"{path}.{part}") for part in ("keys", "values")}
        parts["eviction"] = _parse_fields(entry.get("eviction", {}), f"{path}.eviction", EVICTION_OVERRIDABLE)
        if parts["eviction"] and kind == "full":
            _fail(f"{path}.eviction", "sets a share of the window on the full-attention layers, which have none; name "
                                      "sliding-window layers (or layers: sliding)")
        if not any(parts.values()):
            _fail(path, "changes nothing: give keys: {...}, values: {...} and/or eviction: {sliding_budget: ...}")
        out.append(LayerOverride(layers, **parts, kind=kind))
    return tuple(out)


def _parse_fields(raw: Any, path: str, allowed: tuple[str, ...] = OVERRIDABLE) -> tuple[tuple[str, Any], ...]:
    if not isinstance(raw, dict):
        _fail(path, f"expected a mapping of {list(allowed)}, got {type(raw).__name__}")
    for name in raw:
        if name not in allowed:
            _fail(f"{path}.{name}", f"cannot be set per layer; an override may set {list(allowed)}")
    fields = dict(raw)
    if fields.get("method") == "none":
        fields.setdefault("bits", 16)
    return tuple((name, fields[name]) for name in allowed if name in fields)


def check_sliding_overrides(recipe: "Recipe", sliding_windows: Sequence[int | None]) -> None:
    """RecipeError when an ``eviction`` entry names a layer without a sliding window (resolved recipe)."""
    for n, override in enumerate(recipe.layer_overrides):
        if not override.eviction:
            continue
        full = [i for i in override.layers if i < len(sliding_windows) and not sliding_windows[i]]
        if full:
            sliding = [i for i, w in enumerate(sliding_windows) if w]
            raise RecipeError(
                f"recipe '{recipe.name}': layer_overrides[{n}] sets eviction.sliding_budget on layers {full}, which have "
                f"no sliding window in this model (its sliding-window layers: {sliding or 'none'}); name sliding-window "
                "layers only, or set eviction.budget for the others"
            )


def check_layer_count(recipe, num_layers: int) -> None:
    """RecipeError when an override names a layer the model does not have."""
    beyond = sorted(i for o in recipe.layer_overrides for i in o.layers if i >= num_layers)
    if beyond:
        raise RecipeError(
            f"recipe '{recipe.name}': layer_overrides name layers {beyond}, but the model has {num_layers} layers "
            f"(0-{num_layers - 1}); remove them or use the recipe with a deeper model"
        )


def resolve_layer_kinds(recipe: "Recipe", sliding_windows: Sequence[int | None]) -> "Recipe":
    """The recipe with every ``layers: sliding`` / ``full`` entry turned into the model's layer indices.

    sliding_windows: per layer, the window length or None (full attention), as the adapter's geometry gives
    them. Entries that name no layer of this model are dropped. The recipe itself when it names no kind.
    """
    if not any(o.kind is not None for o in recipe.layer_overrides):
        return recipe
    kinds = {"sliding": tuple(i for i, w in enumerate(sliding_windows) if w),
             "full": tuple(i for i, w in enumerate(sliding_windows) if not w)}
    listed = {i: n for n, o in enumerate(recipe.layer_overrides) if o.kind is None for i in o.layers}
    out = []
    for n, override in enumerate(recipe.layer_overrides):
        if override.kind is None:
            out.append(override)
            continue
        layers = kinds[override.kind]
        both = sorted(i for i in layers if i in listed)
        if both:
            raise RecipeError(
                f"recipe '{recipe.name}': layer_overrides[{n}] changes the {override.kind} layers, but layers {both} "
                f"among them are also listed by index (layer_overrides[{listed[both[0]]}]); give each layer one entry"
            )
        if layers:
            out.append(dataclasses.replace(override, layers=layers, kind=None))
    return dataclasses.replace(recipe, layer_overrides=tuple(out))
