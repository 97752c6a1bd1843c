"""Non-uniform quantization with dense-and-sparse outliers (KVQuant, Hooper et al. 2024).

Every element is normalised into [-1, 1] and encoded as the index of the nearest level
of a per-layer codebook (`codebooks.py`) fitted offline on calibration data:

* ``axis: channel`` (keys): per (head, channel) offline ranges ``channel_lo`` /
  ``channel_hi`` (the f/2 and 1 - f/2 calibration quantiles; f = outlier fraction),
  ``x_n = (x - mid) / half``; nothing per block besides codes and outliers;
* ``axis: token`` (values): per token and group of ``g = min(group_size, D)``
  channels, the dense elements' range is stored as fp16 ``scale`` (= half range) and
  ``zero`` (= midpoint), ``x_n = (x - zero) / scale``.

Dense-and-sparse (`outliers.py`): per block of one (sequence, head) stream the
``k = ceil(f * S * D)`` elements with the largest outlier score are kept exactly in fp16.
Token axis: the z-score within the token group, chosen before the group's range so the
range is tight. Channel axis (fixed ranges): the absolute error each element would have if kept dense,
``|x_n - level(clamp(x_n))| * half`` (clamped into its channel's range, rounded to the
codebook), so the fixed budget removes the most error. Ranking by ``|x_n|`` instead
spent it on elements of narrow channels (small absolute error) and left the largest
elements of wide channels clamped and shrunk to the codebook's outer level (issue 11).

Storage per block of one (sequence, KV head) stream:

* ``codes``: (S * bits / 8, D) uint8, bit-sliced and token-split (`packing.py`);
* ``scale``, ``zero``: float16 (S, D / g), token axis only;
* ``outlier_index``: int16 (k,) flat index minus 32768; ``outlier_value``: float16 (k,)
  (both absent when k == 0).

Fitted tensors per layer: ``codebook`` (2**bits,) float32 sorted, and for the channel
axis ``channel_lo``, ``channel_hi`` (H_kv, D) float32.
"""

from __future__ import annotations

import torch

from kvtool.errors import ArtifactError, DataError, RecipeError
from kvtool.methods.base import BlockQuantizer
from kvtool.methods.quant.codebooks import fit_codebook, lookup, nearest_codes
from kvtool.methods.quant.outliers import (
    MAX_BLOCK_ELEMENTS,
    dense_range,
    encode_index,
    outlier_count,
    scatter_outliers,
    token_zscore,
    top_outliers,
)
from kvtool.methods.quant.packing import pack_codes, packed_bytes, packed_rows, unpack_codes
from kvtool.methods.registry import register

_FP16_MAX = 65504.0
_EPS = 1e-6


def _token_normalise(x: torch.Tensor, group: int, k: int):
    """Per-token-group normalisation of x (..., S, D) float32 with k outliers per block.

    Returns (x_n flat (..., S*D) unclamped, outlier index (..., k) or None,
    outlier mask like x_n or None, scale fp16 (..., S, D/g), zero fp16 (same)).
    """
    *lead, s, d = x.shape
    grouped = x.reshape(*lead, s, d // group, group)
    index = mask = None
    outlier = torch.zeros_like(grouped, dtype=torch.bool)
    if k:
        index, mask = top_outliers(token_zscore(grouped).reshape(*lead, s * d), k)
        outlier = mask.reshape(grouped.shape)
    lo, hi = dense_range(grouped, outlier)
    zero = ((lo + hi) / 2).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
    scale = ((hi - lo) / 2).clamp(min=_EPS, max=_FP16_MAX).to(torch.float16)
    # Normalise against the fp16-rounded scale and zero the decoder will see.
    xn = (grouped - zero.float()[..., None]) / scale.float()[..., None]
    return xn.reshape(*lead, s * d), index, mask, scale, zero


def _channel_quantiles(samples: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(fraction/2, 1 - fraction/2) quantiles over dim 0 of (N, H, D), linear interpolation (min/max for 0)."""
    ordered = samples.sort(dim=0).values
    last = ordered.shape[0] - 1

    def quantile(q: float) -> torch.Tensor:
        pos = q * last
        i0 = int(pos)
        i1 = min(i0 + 1, last)
        return ordered[i0] + (ordered[i1] - ordered[i0]) * (pos - i0)

    return quantile(fraction / 2), quantile(1 - fraction / 2)


@register("nuq")
class NuqQuantizer(BlockQuantizer):
    """KVQuant: ``bits``-bit codes into a fitted per-layer codebook, plus fp16 sparse outliers."""

    needs_fit = True

    def __init__(self, spec, head_dim, block_size, dtype=torch.float16, fitted=None) -> None:
        super().__init__(spec, head_dim, block_size, dtype, fitted)
        self.group = self.token_group()
        numel = block_size * head_dim
        if numel > MAX_BLOCK_ELEMENTS:
            raise RecipeError(
                f"recipe field 'cache.block_size': {block_size} tokens x head_dim {head_dim} = {numel} elements per "
                f"block; nuq's int16 outlier positions address at most {MAX_BLOCK_ELEMENTS}: use block_size <= "
                f"{MAX_BLOCK_ELEMENTS // head_dim}"
            )
        self.k = outlier_count(spec.outlier_fraction, numel)
        required = ["codebook"] + (["channel_lo", "channel_hi"] if spec.axis == "channel" else [])
        missing = [name for name in required if name not in self.fitted]
        if missing:
            raise ArtifactError(
                f"the nuq method needs calibrated tensors ({', '.join(missing)}) for '{spec.path}' but none were "
                f"given: run kvtool calibrate with this recipe and use the artifact it writes"
            )
        codebook = self.fitted["codebook"].detach().float().flatten().cpu()
        if codebook.numel() != 2**spec.bits:
            raise ArtifactError(
                f"nuq codebook for '{spec.path}' has {codebook.numel()} levels, the recipe's {spec.bits} bits need "
                f"{2**spec.bits}: the artifact was calibrated for another recipe; run kvtool calibrate again"
            )
        self.codebook = codebook.sort().values
        if spec.axis == "channel":
            lo = self.fitted["channel_lo"].detach().float().cpu()
            hi = self.fitted["channel_hi"].detach().float().cpu()
            if lo.dim() != 2 or lo.shape != hi.shape or lo.shape[-1] != head_dim:
                raise ArtifactError(
                    f"nuq channel ranges for '{spec.path}' have shapes {tuple(lo.shape)} / {tuple(hi.shape)}, "
                    f"expected (H_kv, {head_dim}): the artifact is for another model; run kvtool calibrate again"
                )
            self.mid = (lo + hi) / 2
            self.half = ((hi - lo) / 2).clamp(min=_EPS)
        self._device_cache: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(codebook, mid (H, D), half (H, D)) on ``device`` (mid/half only for the channel axis)."""
        if device not in self._device_cache:
            tensors = [self.codebook.to(device)]
            if self.spec.axis == "channel":
                tensors += [self.mid.to(device), self.half.to(device)]
            self._device_cache[device] = tuple(tensors)
        return self._device_cache[device]

    def check_kv_heads(self, num_kv_heads: int) -> None:
        if self.spec.axis == "channel" and self.mid.shape[0] != num_kv_heads:
            raise ArtifactError(
                f"nuq channel ranges for '{self.spec.path}' cover {self.mid.shape[0]} KV heads, the model has "
                f"{num_kv_heads}: the artifact is for another model; run kvtool calibrate again"
            )

    def _channel_ranges(self, group: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block (N, 1, D) mid and half of its KV head's calibrated channel ranges."""
        _, mid, half = self._tensors(device)
        group = group.to(device)
        return mid[group][:, None, :], half[group][:, None, :]

    def kernel_format(self):
        from kvtool.runtime.kernels.body_format import BodyFormat

        scales = "static" if self.spec.axis == "channel" else "token"
        return BodyFormat(bits=self.spec.bits, per_channel=False, group=self.group, scales=scales,
                          levels=2**self.spec.bits, outliers=self.k)

    def kernel_constants(self) -> dict[str, torch.Tensor]:
        constants = {"codebook": self.codebook}  # (2**bits,)
        if self.spec.axis == "channel":
            constants.update(static_scale=self.half, static_zero=self.mid)  # (H_kv, D): x = level * half + mid
        return constants

    def block_spec(self):
        s, d = self.block_size, self.head_dim
        spec = {"codes": ((packed_rows(s, self.spec.bits), d), torch.uint8)}
        if self.spec.axis == "token":
            spec["scale"] = spec["zero"] = ((s, d // self.group), torch.float16)
        if self.k:
            spec["outlier_index"] = ((self.k,), torch.int16)
            spec["outlier_value"] = ((self.k,), torch.float16)
        return spec

    def encode_blocks(self, x: torch.Tensor, group: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x[:, 0].float()  # (N, S, D)
        n, s, d = x.shape
        storage: dict[str, torch.Tensor] = {}
        if self.spec.axis == "channel":
            mid, half = self._channel_ranges(group, x.device)
            xn = (x - mid) / half  # (N, S, D)
            index = mask = None
            if self.k:
                codebook = self._tensors(x.device)[0]
                dense = codebook[nearest_codes(xn.clamp(-1.0, 1.0), codebook)]  # (N, S, D) each element's dense decode
                error = ((xn - dense).abs() * half).reshape(n, s * d)  # (N, S*D) absolute error if kept dense
                index, mask = top_outliers(error, self.k)
            xn = xn.reshape(n, s * d)
        else:
            xn, index, mask, storage["scale"], storage["zero"] = _token_normalise(x, self.group, self.k)
        xn = xn.clamp(-1.0, 1.0)
        if mask is not None:
            xn = xn.masked_fill(mask, 0.0)  # any code: overwritten by the sparse value on decode
        codes = nearest_codes(xn, self._tensors(x.device)[0]).reshape(n, s, d)
        storage = {"codes": pack_codes(codes, self.spec.bits), **storage}
        if index is not None:
            values = x.reshape(n, s * d).gather(-1, index)
            storage["outlier_index"] = encode_index(index)
            storage["outlier_value"] = values.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
        return storage

    def decode_blocks(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        codes = unpack_codes(blocks["codes"], self.spec.bits, self.block_size)  # (N, S, D)
        n, s, d = codes.shape
        codebook = self._tensors(codes.device)[0]
        xn = lookup(codebook, codes)  # (N, S, D)
        if self.spec.axis == "channel":
            mid, half = self._channel_ranges(group, codes.device)
            x = xn * half + mid
        else:
            grouped = xn.view(n, s, d // self.group, self.group)
            x = grouped * blocks["scale"].float()[..., None] + blocks["zero"].float()[..., None]
        flat = x.reshape(n, s * d)
        if "outlier_index" in blocks:
            scatter_outliers(flat, blocks["outlier_index"], blocks["outlier_value"])
        limit = torch.finfo(self.dtype).max
        return flat.view(n, 1, s, d).clamp(-limit, limit).to(self.dtype)

    def block_nbytes(self) -> int:
        s, d = self.block_size, self.head_dim
        nbytes = packed_bytes(s, d, self.spec.bits)
        if self.spec.axis == "token":
            nbytes += 2 * 2 * s * (d // self.group)  # fp16 scale + fp16 zero per token group
        return nbytes + self.k * (2 + 2)  # int16 position + fp16 value per outlier

    @classmethod
    def fit(cls, spec, head_dim, block_size, samples, weights=None) -> dict[str, torch.Tensor]:
        """Codebook (and channel ranges) of one layer from calibration samples (N, H, D) and Fisher weights."""
        samples = samples.detach().float().cpu()
        weights = None if weights is None else weights.detach().float().cpu()
        if samples.dim() != 3 or samples.shape[0] == 0 or samples.shape[-1] != head_dim:
            raise DataError(
                f"nuq calibration for '{spec.path}' needs samples (N>0, H_kv, {head_dim}); got {tuple(samples.shape)}"
            )
        if weights is not None and weights.shape != samples.shape:
            raise DataError(f"Fisher weights {tuple(weights.shape)} do not match samples {tuple(samples.shape)}")
        fraction = spec.outlier_fraction
        out: dict[str, torch.Tensor] = {}
        if spec.axis == "channel":
            lo, hi = _channel_quantiles(samples, fraction)
            mid, half = (lo + hi) / 2, ((hi - lo) / 2).clamp(min=_EPS)
            xn = (samples - mid) / half
            dense = xn.abs() <= 1.0  # beyond the calibrated thresholds: the sparse part
            out = {"channel_lo": lo.contiguous(), "channel_hi": hi.contiguous()}
        else:
            group = min(spec.group_size, head_dim)
            if head_dim % group:
                raise RecipeError(
                    f"recipe field '{spec.path}.group_size': {spec.group_size} does not divide the model's head_dim "
                    f"{head_dim}; choose a power of two that divides {head_dim}"
                )
            total, h, d = samples.shape
            s = min(block_size, total)  # pseudo-blocks of block_size tokens (fewer if that is all there is)
            nb = total // s

            def as_blocks(t: torch.Tensor) -> torch.Tensor:  # (N, H, D) -> (1, H, nb, s, D)
                return t[: nb * s].reshape(nb, s, h, d).permute(2, 0, 1, 3).unsqueeze(0)

            blocks = as_blocks(samples)
            xn, _, mask, _, _ = _token_normalise(blocks, group, outlier_count(fraction, s * d))
            dense = torch.ones_like(xn, dtype=torch.bool) if mask is None else ~mask
            weights = None if weights is None else as_blocks(weights).reshape(xn.shape)
        values = xn[dense].clamp(-1.0, 1.0)
        used = None if weights is None else weights[dense]
        out["codebook"] = fit_codebook(spec.codebook, spec.bits, values, used, spec.qnorm)
        return out
