"""What `kvtool calibrate` fits and measures for a recipe's quantizers.

1. Fit (methods with ``needs_fit``, e.g. KVQuant's nuq): a bounded random sample of
   token vectors per layer, with Fisher sensitivities (squared loss gradients) when
   the codebook is Fisher-weighted, goes to `BlockQuantizer.fit`. Static scales (fp8
   per layer / head, int_static; ``fit_source == "ranges"``) instead see every token's
   range through `RangeStats` and go to `BlockQuantizer.fit_ranges`. TurboQuant keys with
   ``channel_scale: query`` or ``outlier_channels: calibrated`` (``fit_source == "queries"``) see
   per-channel mean squares of the keys, the queries and the values (`capture.QueryKeyMoments`) and
   go to `BlockQuantizer.fit_queries`.
2. Measure: every layer's key and value quantizers run, exactly as the runtime runs
   them (keys before RoPE when ``keys.pre_rope``), over the calibration K/V in blocks
   of ``block_size`` tokens; the SQNR (dB) per KV head is recorded.
"""

from __future__ import annotations

import math

import torch

from kvtool.methods.registry import quantizer_class
from kvtool.recipe import Recipe


def build_quantizers(recipe: Recipe, head_dim: int, dtype: torch.dtype = torch.float16, fitted=None):
    """(key quantizer, value quantizer) for a recipe at a model's head_dim; raises RecipeError if they cannot be built.

    fitted: one layer's tensors as ``{"keys.codebook": ..., "values.codebook": ...}`` (artifact naming).
    """
    fitted = fitted or {}
    block = recipe.cache.block_size
    parts = []
    for part, spec in (("keys", recipe.keys), ("values", recipe.values)):
        own = {k[len(part) + 1 :]: v for k, v in fitted.items() if k.startswith(f"{part}.")}
        parts.append(quantizer_class(spec.method)(spec, head_dim, block, dtype, own))
    return tuple(parts)


def needs_fit(recipe: Recipe) -> bool:
    """True if a quantizer of the recipe learns parameters from calibration data."""
    return any(quantizer_class(spec.method).requires_fit(spec) for spec in (recipe.keys, recipe.values))


def fits_ranges(recipe: Recipe) -> bool:
    """True if a quantizer of the recipe is fitted from `RangeStats` (static fp8 / int scales)."""
    return any(
        quantizer_class(spec.method).fit_source == "ranges" and quantizer_class(spec.method).requires_fit(spec)
        for spec in (recipe.keys, recipe.values)
    )


def fits_reservoir(recipe: Recipe) -> bool:
    """True if a quantizer of the recipe is fitted from a `SampleReservoir` (nuq codebooks, Palu bases)."""
    return any(
        quantizer_class(spec.method).fit_source == "reservoir" and quantizer_class(spec.method).requires_fit(spec)
        for spec in (recipe.keys, recipe.values)
    )


def fits_queries(recipe: Recipe) -> bool:
    """True if a quantizer of the recipe is fitted from query and key moments (TurboQuant's channel scales)."""
    return any(
        quantizer_class(spec.method).fit_source == "queries" and quantizer_class(spec.method).requires_fit(spec)
        for spec in (recipe.keys, recipe.values)
    )


PARTS = ("keys_pre_rope", "keys", "values")


def range_parts(recipe: Recipe) -> tuple[str, ...]:
    """The `RangeStats` parts a recipe's range-fitted quantizers read."""
    out = []
    for part, spec in (("keys", recipe.keys), ("values", recipe.values)):
        cls = quantizer_class(spec.method)
        if cls.fit_source == "ranges" and cls.requires_fit(spec):
            out.append("values" if part == "values" else ("keys_pre_rope" if spec.pre_rope else "keys"))
    return tuple(out)


class RangeStats:
    """Observer: per layer and KV head, every channel's min / max over all tokens, and a random sample of rows.

    Parts: ``keys`` (after RoPE), ``keys_pre_rope`` and ``values``; the first ``skip_first``
    positions of every window (the cache's float sinks) are left out. The sample keeps at
    most ``max_tokens`` rows per layer and part (uniform: random tags, smallest kept). Every
    layer draws its tags from its own Generator(seed), as `SampleReservoir` does, so a layer's
    sample does not depend on the order layers are observed in (whole model per batch in
    memory, one layer over all batches in `kvtool.layer_by_layer`).
    """

    def __init__(self, max_tokens: int = 4096, seed: int = 0, skip_first: int = 0, parts: tuple[str, ...] = PARTS) -> None:
        self.max_tokens, self.skip_first = max_tokens, skip_first
        self.parts = tuple(parts)  # the parts kept (the others are not reduced at all)
        self.seed = seed
        self.generators: dict[int, torch.Generator] = {}
        self.lo: dict[tuple[int, str], torch.Tensor] = {}
        self.hi: dict[tuple[int, str], torch.Tensor] = {}
        self.rows: dict[tuple[int, str], torch.Tensor] = {}  # (n, H, D) float32 on CPU
        self.tags: dict[int, torch.Tensor] = {}

    def observe(self, layer, keys_pre_rope, keys, values) -> None:
        given = dict(zip(PARTS, (keys_pre_rope, keys, values)))
        parts = [given[name][:, :, self.skip_first :].float() for name in self.parts]  # (B, H, T', D)
        if not parts or parts[0].shape[2] == 0:
            return
        rows = [x.permute(0, 2, 1, 3).reshape(-1, *x.shape[1:2], x.shape[-1]).cpu() for x in parts]  # (B*T', H, D)
        generator = self.generators.setdefault(layer, torch.Generator().manual_seed(self.seed))
        new_tags = torch.rand(rows[0].shape[0], generator=generator)
        tags = torch.cat([self.tags.get(layer, torch.empty(0)), new_tags])
        keep = tags.topk(min(self.max_tokens, tags.numel()), largest=False).indices
        self.tags[layer] = tags[keep]
        for part, x, r in zip(self.parts, parts, rows):
            key = (layer, part)
            lo, hi = x.amin(dim=(0, 2)).cpu(), x.amax(dim=(0, 2)).cpu()  # (H, D)
            self.lo[key] = torch.minimum(self.lo[key], lo) if key in self.lo else lo
            self.hi[key] = torch.maximum(self.hi[key], hi) if key in self.hi else hi
            self.rows[key] = torch.cat([self.rows[key], r])[keep] if key in self.rows else r[keep]

    def ranges(self, layer: int, part: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lo (H, D), hi (H, D), sample (n, H, D)) of a layer and part."""
        key = (layer, part)
        if key not in self.lo:
            raise KeyError(f"no calibration tokens past the sinks for layer {layer}; use longer calibration windows")
        return self.lo[key], self.hi[key], self.rows[key]


def needs_fisher(recipe: Recipe) -> bool:
    """True if fitting weights samples by Fisher sensitivity (nuq codebooks, Palu rank search)."""
    return any(
        (spec.method == "nuq" and spec.codebook == "fisher-kmeans")
        or (spec.method == "palu" and spec.rank_allocation in ("fisher", "gradient"))
        for spec in (recipe.keys, recipe.values)
    )


def needs_gradients(recipe: Recipe) -> bool:
    """True if fitting reads the signed loss gradients of the samples (Palu's ``gradient`` rank search)."""
    return any(spec.method == "palu" and spec.rank_allocation == "gradient" for spec in (recipe.keys, recipe.values))


def uses_palu(recipe: Recipe) -> bool:
    return "palu" in (recipe.keys.method, recipe.values.method)


def fit_palu_layers(recipe: Recipe, adapter, reservoir, moments) -> list[dict[str, torch.Tensor]]:
    """Palu: per-layer K/V samples, projection weights and input second moments -> bases with searched ranks."""
    from kvtool.methods.lowrank.palu import fit_palu

    layers = [palu_entry(recipe, adapter, layer, reservoir, moments.moment) for layer in range(adapter.geometry.num_layers)]
    return fit_palu(recipe, layers)


def palu_entry(recipe: Recipe, adapter, layer: int, reservoir, moment, reservoir_layer: int | None = None) -> dict:
    """One layer's input to `fit_palu`: per palu part, samples, Fisher weights, gradients, projection weight, bias, input moment.

    moment: layer -> E[x x^T] of the projection input; reservoir_layer: the reservoir's index of
    the layer's samples (default ``layer``).
    """
    weights = dict(zip(("keys", "values"), adapter.kv_projection_weights(layer)))
    biases = dict(zip(("keys", "values"), adapter.kv_projection_biases(layer)))
    source = layer if reservoir_layer is None else reservoir_layer
    entry = {}
    for part, spec in (("keys", recipe.keys), ("values", recipe.values)):
        if spec.method != "palu":
            continue
        reservoir_part = "keys_pre_rope" if part == "keys" else "values"
        samples, fisher = reservoir.samples(source, reservoir_part)
        linear = part == "values" or adapter.keys_linear_in_input
        entry[part] = {
            "samples": samples,
            "weights": fisher,
            "gradients": reservoir.gradients(source, reservoir_part),
            "weight": weights[part].detach().float().cpu() if linear else None,
            "bias": None if biases[part] is None or not linear else biases[part].detach().float().cpu(),
            "input_second_moment": moment(layer) if linear else None,
        }
    return entry


def fit_layers(
    recipe: Recipe, head_dim: int, num_layers: int, reservoir=None, ranges: RangeStats | None = None, queries=None,
) -> list[dict[str, torch.Tensor]]:
    """Fit every layer's quantizers from a `SampleReservoir`, `RangeStats` and / or `QueryKeyMoments` (``queries``);
    per layer ``{"keys.x": t, ...}``."""
    out = []
    for layer in range(num_layers):
        fitted: dict[str, torch.Tensor] = {}
        for part, spec in (("keys", recipe.keys), ("values", recipe.values)):
            cls = quantizer_class(spec.method)
            if not cls.requires_fit(spec) or spec.method == "palu":  # palu ranks are searched across layers: fit_palu_layers
                continue
            if cls.fit_source == "ranges":
                if ranges is None:
                    raise ValueError(f"method '{spec.method}' is fitted from RangeStats; pass ranges=")
                source = "values" if part == "values" else ("keys_pre_rope" if spec.pre_rope else "keys")
                tensors = cls.fit_ranges(spec, head_dim, recipe.cache.block_size, *ranges.ranges(layer, source))
                fitted.update({f"{part}.{name}": t for name, t in tensors.items()})
                continue
            if cls.fit_source == "queries":
                if queries is None:
                    raise ValueError(f"method '{spec.method}' is fitted from QueryKeyMoments; pass queries=")
                values = queries.value_moments(layer) if part == "values" else None
                tensors = cls.fit_queries(spec, head_dim, *queries.moments(layer), value_square_mean=values)
                fitted.update({f"{part}.{name}": t for name, t in tensors.items()})
                continue
            source = "values" if part == "values" else ("keys_pre_rope" if spec.pre_rope else "keys")
            samples, weights = reservoir.samples(layer, source)
            tensors = cls.fit(spec, head_dim, recipe.cache.block_size, samples, weights)
            fitted.update({f"{part}.{name}": t for name, t in tensors.items()})
        out.append(fitted)
    return out


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    """(B, H, T, D) -> (B, H, N, S, D) full blocks (the tail shorter than a block is left out)."""
    b, h, t, d = x.shape
    n = t // block
    return None if n == 0 else x[:, :, : n * block].reshape(b, h, n, block, d)


class QuantErrorStats:
    """Observer: per layer and KV head, signal and error energy of the recipe's quantizers."""

    def __init__(self, recipe: Recipe, head_dim: int, fitted: list[dict] | None = None) -> None:
        self.recipe, self.head_dim, self.fitted = recipe, head_dim, fitted
        self.quantizers: dict[int, tuple] = {}
        self.energy: dict[tuple[int, str], torch.Tensor] = {}

    def _quantizers(self, layer: int) -> tuple:
        if layer not in self.quantizers:
            fitted = self.fitted[layer] if self.fitted else None
            self.quantizers[layer] = build_quantizers(self.recipe.for_layer(layer), self.head_dim, fitted=fitted)
        return self.quantizers[layer]

    def observe(self, layer, keys_pre_rope, keys, values) -> None:
        key_q, value_q = self._quantizers(layer)
        stored_keys = keys_pre_rope if self.recipe.keys.pre_rope else keys
        sinks = self.recipe.cache.sink_tokens  # kept in float by the cache: not part of the quantized body
        for part, x, quantizer in (("keys", stored_keys, key_q), ("values", values, value_q)):
            blocks = _blocks(x[:, :, sinks:], self.recipe.cache.block_size)
            if blocks is None:
                continue
            error = (quantizer.roundtrip(blocks).float() - blocks).square().sum(dim=(0, 2, 3, 4))  # (H,)
            signal = blocks.square().sum(dim=(0, 2, 3, 4))
            pair = torch.stack([signal, error])  # (2, H)
            key = (layer, part)
            self.energy[key] = self.energy[key] + pair if key in self.energy else pair

    def sqnr_db(self) -> dict[str, torch.Tensor]:
        """``quality.layers.{i}.{keys,values}.sqnr_db`` -> (H_kv,) float32."""
        out = {}
        for (layer, part), (signal, error) in sorted(self.energy.items()):
            out[f"quality.layers.{layer}.{part}.sqnr_db"] = 10 * torch.log10(signal / error.clamp(min=1e-30))
        return out

    def summary(self) -> dict[str, float]:
        """Mean SQNR (dB) over layers for keys and values, from total energies."""
        out = {}
        for part in ("keys", "values"):
            pairs = [e for (_, p), e in self.energy.items() if p == part]
            if pairs:
                total = torch.stack(pairs).sum(dim=(0, 2))
                out[f"{part}_sqnr_db"] = float(10 * math.log10(total[0] / max(float(total[1]), 1e-30)))
        return out
