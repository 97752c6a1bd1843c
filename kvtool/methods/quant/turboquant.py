"""TurboQuant (Zandieh et al., ICLR 2026): random rotation + Lloyd-Max scalar codes (+ a 1-bit QJL residual).

No calibration. One *instance* codes a vector x (d,) as

1. its norm ``||x||`` (fp16) and the unit vector ``u = x / ||x||``;
2. rotated, ``y = P u``: for d a power of two ``P = H diag(s)``, H the orthonormal Walsh-Hadamard
   matrix and s random +-1 signs from the seed (a randomized Hadamard transform); otherwise P is a
   seeded Haar-random orthogonal matrix (QR of a Gaussian matrix, the paper's construction). For
   a random rotation every coordinate of y follows the law of one coordinate of a uniform point on
   the unit sphere, density ``f(t) ~ (1 - t**2) ** ((d - 3) / 2)`` on [-1, 1] (~ N(0, 1/d));
3. each coordinate coded against the Lloyd-Max codebook of that law (`lloyd_max_codebook`,
   computed once from the density: no data);
4. keys with ``qjl: true``: the codes use one bit less and the residual ``r = y - y_hat`` gets a
   1-bit Quantized Johnson-Lindenstrauss sketch, ``sign(G r)`` with G a (d, d) Gaussian matrix
   from the seed, plus ``||r||`` (fp16). For any query q,
   ``E[sqrt(pi/2) / d * ||r|| * (G q) . sign(G r)] = q . r``: inner products are unbiased
   (the plain codes alone shrink them: ``E[q . y_hat] != q . y``).

Integer rates: one instance over the head's D channels. Fractional rates (``extra_bits: 0.5`` or ``0.25``)
are the paper's outlier split (section 4.3): the channels are split *before* the rotation into an
outlier set and the rest, and two independent instances code them, the outliers at more bits.
KV caches have a few channels that carry much of the energy (keys especially); an instance's
rotation spreads them only over its own set, so the outliers no longer inflate the error of the
others, and their extra bits go where the energy is. ``outlier_channel_fraction`` f of the D
channels (f = 1/2 or 1/4; with ``extra_bits: 0.25``, 1/4 or 1/8) are coded at ``bits + extra_bits / f``
(+1 or +2 bits), the rest at ``bits``: ``bits + extra_bits`` per channel on average (the paper's
example, 32 of 128 channels at 3 bits and 96 at 2, is ``extra_bits: 0.25``, 2.25 bits; f = 1/4 at
+2 bits is 2.5). No calibration: each stored block
picks its own outlier set, the ``f * D`` channels with the most energy ``sum_t x[t, c]**2`` over
the block's S tokens (post-RoPE key channels drift as their rotary pairs turn), stored as a D-bit
mask per block. With ``outlier_channels: calibrated`` the set is instead one per KV head, fitted by
`kvtool calibrate` (`fit_queries`) and stored in the artifact (``outlier_channels`` (H_kv, D / 8),
the mask layout): no mask per block, and one channel order for every block of a stream.

Storage per block of one (sequence, KV head) stream (S tokens; leading block dim omitted), per
instance (names with the ``outlier_`` prefix for the outlier instance, none for the other):

* ``codes``: (S * b / 8, d) uint8, bit-sliced (`packing.py`), b = code bits, d = its channels;
* ``norm``: (S,) float16, the norm of the token's channels in this instance; with ``norm_bits: 8``
  (S + 4,) uint8 instead: S codes c_t, then the block's range of log2 norms as two int16 (little-endian)
  in 1/1024 octave, hi >= the largest and lo <= the smallest (at most 16 octaves under hi); each norm
  reads as ``2 ** ((hi - c_t (hi - lo) / 255) / 1024)``: 255 steps spread over the block's own range,
  so within 0.14% of the norm for a block whose norms span a factor 2 and 1.1% for a factor 256 (a
  key's norm error moves its logit in proportion: a coarse fixed grid showed in the output KL);
* QJL: ``qjl_signs`` (S / 8, d) uint8 (1 bit per coordinate), ``residual_norm`` (S,) float16;

and with the split ``outlier_mask`` (D / 8,) uint8: bit c set when channel c is an outlier (not with calibrated
channels).
A block's channels are ordered outliers first, then the rest, each in increasing channel order.

Keys with ``channel_scale: query`` (calibrated, `fit_queries`): a per-KV-head, per-channel scale s; the codes hold
k / s and the query is multiplied by s before it is rotated, so ``(q * s) . (k / s) = q . k`` and `decode_blocks`
multiplies s back. The rotation spreads the coding error evenly over the channels of what it codes; with s the
error lands on the channels the queries read little (s_c = sqrt(rms(k_c) / rms(q_c)), see `fit_queries`).

Attention never un-rotates keys (`chunk_scores`): the query is rotated into each instance's
domain, ``q . x = sum_i ||x_i|| * (P_i q_i) . y_i``, and scores are taken against the codebook
values there (+ the QJL term, with the query sketched as ``G_i P_i q_i``): once per chunk
without the split, once per block with it (each block has its own outlier set). Values
(`chunk_values`) are summed in the rotated domains, ``sum_t p_t ||x_t,i|| y_hat_t,i``, and each
output row is rotated back once (once per block with the split) and scattered to its channels.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvtool.errors import ArtifactError, RecipeError
from kvtool.methods.base import BlockQuantizer
from kvtool.methods.lowrank.hadamard import fwht, hadamard_matrix, is_power_of_two
from kvtool.methods.quant.codebooks import lookup
from kvtool.methods.quant.packing import pack_codes, packed_rows, unpack_codes
from kvtool.methods.registry import register

_GRID = 1 << 16  # points of the density grid the Lloyd-Max iteration runs on
_LLOYD_STEPS = 300
NORM_LEVEL_UNITS = 1024  # 8-bit norms: a block's range of log2 norms is stored in 1/1024 octave (int16: 2**-32 .. 2**32)
NORM_RANGE_OCTAVES = 16  # 8-bit norms: the widest range a block's codes span (smaller norms read at its floor)
_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)  # of the 8 channels one mask byte holds, lowest channel first


@functools.lru_cache(maxsize=None)
def lloyd_max_codebook(dim: int, bits: int) -> torch.Tensor:
    """(2**bits,) float32 sorted: the MSE-optimal scalar quantizer of one coordinate of a uniform unit vector in R^dim.

    Lloyd-Max (alternate nearest-level cells and cell centroids) on the exact density
    ``(1 - t**2) ** ((dim - 3) / 2)`` sampled on a fine grid of [-1, 1]; starts from the
    Gaussian N(0, 1/dim) quantiles. Deterministic: it depends on (dim, bits) only.
    """
    t = torch.linspace(-1.0, 1.0, _GRID + 2, dtype=torch.float64)[1:-1]
    log_density = 0.5 * (dim - 3) * torch.log1p(-t.square())
    weight = torch.exp(log_density - log_density.max())
    weight = weight / weight.sum()
    levels = 2**bits
    probs = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    codebook = torch.special.ndtri(probs) / math.sqrt(dim)
    for _ in range(_LLOYD_STEPS):
        bounds = (codebook[1:] + codebook[:-1]) / 2
        cell = torch.bucketize(t, bounds)
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, weight)
        first = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, weight * t)
        updated = torch.where(mass > 0, first / mass.clamp(min=1e-300), codebook)
        if torch.allclose(updated, codebook, rtol=0, atol=1e-12):
            break
        codebook = updated
    return codebook.float()


@functools.lru_cache(maxsize=None)
def rotation_signs(dim: int, seed: int) -> torch.Tensor:
    """(dim,) float32 random +-1: the diagonal of the randomized Hadamard rotation."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (dim,), generator=generator).float() * 2 - 1


@functools.lru_cache(maxsize=None)
def random_orthogonal(dim: int, seed: int) -> torch.Tensor:
    """(dim, dim) float32 Haar-random orthogonal matrix P (QR of a seeded Gaussian matrix, signs fixed)."""
    generator = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def kronecker_factors(dim: int) -> tuple[int, int]:
    """(m, n): ``dim = m * n``, n the largest power of two dividing it, m odd."""
    n = dim & -dim
    return dim // n, n


@functools.lru_cache(maxsize=None)
def kronecker_orthogonal(dim: int, seed: int) -> torch.Tensor:
    """(dim, dim) float32 P = (M kron H_n) diag(s) (``split_rotation: kronecker``): s random +-1 (`rotation_signs`), H_n
    the orthonormal Walsh-Hadamard matrix of the largest power-of-two factor n of ``dim``, M (m, m) Haar-random over the
    odd factor m. Viewing x as (m, n) rows of n channels, P x = M (H_n (s * x) per row): every output mixes every input,
    and a kernel applies it as m fast transforms of n and one m x m product per column."""
    m, n = kronecker_factors(dim)
    mix = random_orthogonal(m, seed).double().contiguous() if m > 1 else torch.ones(1, 1, dtype=torch.float64)
    return (torch.kron(mix, hadamard_matrix(n, dtype=torch.float64)) * rotation_signs(dim, seed).double()[None, :]).float()


@functools.lru_cache(maxsize=None)
def qjl_matrix(dim: int, seed: int) -> torch.Tensor:
    """(dim, dim) float32 standard Gaussian: the QJL projection G (rows = sketch coordinates)."""
    generator = torch.Generator().manual_seed(seed + 0x9E3779B9)
    return torch.randn(dim, dim, generator=generator)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """y = H (s * x) along the last dim (orthonormal)."""
    return fwht(x * signs)


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x = s * H y: the inverse of `rotate` (H is symmetric and its own inverse)."""
    return fwht(y) * signs


def encode_norms8(norm: torch.Tensor) -> torch.Tensor:
    """norm (N, S) float32 >= 0 -> (N, S + 4) uint8: the codes c = round((hi - level) * 255 / (hi - lo)) (0 where
    hi = lo), then hi and lo as int16 bytes (little-endian); level = NORM_LEVEL_UNITS * log2(norm), clamped to
    -32767 .. 32767 (norms under 2**-32 read as 2**-32: nothing a cache holds), hi = ceil(max level), lo = floor(min
    level) but at most NORM_RANGE_OCTAVES under hi."""
    level = (torch.log2(norm.double()) * NORM_LEVEL_UNITS).clamp(-32767, 32767)  # (N, S); a zero norm -> -32767
    hi = level.amax(dim=-1, keepdim=True).ceil()  # (N, 1)
    lo = torch.maximum(level.amin(dim=-1, keepdim=True).floor(), hi - NORM_RANGE_OCTAVES * NORM_LEVEL_UNITS)
    span = (hi - lo).clamp(min=1)
    codes = ((hi - level) * (255 / span)).round().clamp(0, 255)
    bounds = torch.cat([hi, lo], dim=-1).to(torch.int16)  # (N, 2)
    return torch.cat([codes.to(torch.uint8), bounds.view(torch.uint8).reshape(-1, 4)], dim=-1)


def decode_norms8(stored: torch.Tensor) -> torch.Tensor:
    """(..., S + 4) uint8 from `encode_norms8` -> (..., S) float32 norms, 2 ** ((hi - c (hi - lo) / 255) / 1024)."""
    bounds = stored[..., -4:].contiguous().view(torch.int16).float()  # (..., 2)
    hi, lo = bounds[..., :1], bounds[..., 1:]
    level = hi - stored[..., :-4].float() * ((hi - lo) / 255)
    return torch.exp2(level * (1.0 / NORM_LEVEL_UNITS))


def outlier_mask(x: torch.Tensor, count: int) -> torch.Tensor:
    """x (N, S, D) -> (N, D) bool: per block, the ``count`` channels with the most energy sum_t x[t, c]**2."""
    energy = x.square().sum(dim=1)  # (N, D)
    top = energy.topk(count, dim=-1).indices  # (N, count)
    return torch.zeros_like(energy, dtype=torch.bool).scatter_(-1, top, True)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """(N, D) bool -> (N, D / 8) uint8, channel 8j + i at bit i of byte j."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int32, device=mask.device)
    return (mask.reshape(*mask.shape[:-1], -1, 8).to(torch.int32) * weights).sum(dim=-1).to(torch.uint8)


def unpack_mask(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_mask`: (..., D / 8) uint8 -> (..., D) bool."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & 1).bool().reshape(*packed.shape[:-1], -1)


def channel_slot(mask: torch.Tensor) -> torch.Tensor:
    """(..., D) bool outlier mask -> (..., D) int64: where channel c sits in the block's order (outliers, then the rest,
    each ascending): its rank among the outliers, or the outlier count plus its rank among the rest."""
    m = mask.to(torch.int64)
    outliers_below = m.cumsum(dim=-1) - m  # (..., D) outlier channels before c
    channel = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask, outliers_below, m.sum(dim=-1, keepdim=True) + channel - outliers_below)


def channel_order(mask: torch.Tensor) -> torch.Tensor:
    """(..., D) bool outlier mask -> (..., D) int64: the outlier channels, then the rest, each ascending (the inverse
    permutation of `channel_slot`; a cumulative count and a scatter, not a sort: this runs per block at every step)."""
    slot = channel_slot(mask)
    channel = torch.arange(mask.shape[-1], device=mask.device).expand_as(slot)
    return torch.empty_like(slot).scatter_(-1, slot, channel)


@dataclass(frozen=True)
class Instance:
    """One TurboQuant instance: ``dim`` channels coded at ``bits`` (QJL bit included), storage names ``prefix + name``."""

    prefix: str
    dim: int
    bits: int
    seed: int
    qjl: bool
    kronecker: bool = False  # ``split_rotation: kronecker``: a width that is not a power of two rotates by `kronecker_orthogonal`

    @property
    def code_bits(self) -> int:
        return self.bits - (1 if self.qjl else 0)  # QJL takes one of the bits

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its fixed tensors (CPU): the rotation (signs or matrix), the codebook, the QJL matrix."""
        out = {"codebook": lloyd_max_codebook(self.dim, self.code_bits)}
        if is_power_of_two(self.dim):
            out["signs"] = rotation_signs(self.dim, self.seed)
        elif self.kronecker:
            out["matrix"] = kronecker_orthogonal(self.dim, self.seed)
        else:
            out["matrix"] = random_orthogonal(self.dim, self.seed)
        if self.qjl:
            out["sketch"] = qjl_matrix(self.dim, self.seed)
        return out


def rotate_with(x: torch.Tensor, on: dict) -> torch.Tensor:
    """x (..., d) -> P x with an instance's rotation."""
    return rotate(x, on["signs"]) if "signs" in on else x @ on["matrix"].T


def unrotate_with(y: torch.Tensor, on: dict) -> torch.Tensor:
    """y (..., d) -> P^T y, the inverse of `rotate_with`."""
    return unrotate(y, on["signs"]) if "signs" in on else y @ on["matrix"]


def _rotation_matrix(dim: int, on: dict) -> torch.Tensor:
    """(dim, dim) P of an instance's fixed tensors: ``rotate_with(x, on) == x @ P.T`` (H diag(s), or the matrix)."""
    return hadamard_matrix(dim) * on["signs"][None, :] if "signs" in on else on["matrix"]


@register("turboquant")
class TurboQuantizer(BlockQuantizer):
    """Randomized Hadamard rotation, Lloyd-Max codes of the rotated unit vector, its norm, optional QJL residual.

    With ``extra_bits`` two instances over an outlier / regular channel split chosen per block.
    """

    fit_source = "queries"  # only ``channel_scale: query`` learns anything (`fit_queries`)

    def __init__(self, spec, head_dim, block_size, dtype=torch.float16, fitted=None) -> None:
        super().__init__(spec, head_dim, block_size, dtype, fitted)
        if not is_power_of_two(head_dim) or head_dim < 8:
            raise RecipeError(
                f"recipe field '{spec.path}.method': turboquant's Walsh-Hadamard rotation needs a power-of-two "
                f"head_dim (>= 8), the model has {head_dim}; use another method for this model"
            )
        self.qjl = spec.qjl
        self.norm_bits = spec.norm_bits  # 16: float16 per token; 8: log codes over the block's range (`encode_norms8`)
        self.outliers = round(head_dim * spec.outlier_channel_fraction) if spec.extra_bits else 0  # per block
        if self.outliers:
            outlier_bits = spec.bits + round(spec.extra_bits / spec.outlier_channel_fraction)
            kronecker = spec.split_rotation == "kronecker"
            self.instances = (Instance("outlier_", self.outliers, outlier_bits, spec.seed + 1, spec.qjl, kronecker),
                              Instance("", head_dim - self.outliers, spec.bits, spec.seed, spec.qjl, kronecker))
            for inst in self.instances:
                if kronecker and not is_power_of_two(inst.dim) and kronecker_factors(inst.dim)[1] < 8:
                    raise RecipeError(
                        f"recipe field '{spec.path}.split_rotation': 'kronecker' needs each split instance's width to "
                        f"have a power-of-two factor of at least 8; head_dim {head_dim} with outlier_channel_fraction "
                        f"{spec.outlier_channel_fraction} gives {inst.dim} = {kronecker_factors(inst.dim)[0]} x "
                        f"{kronecker_factors(inst.dim)[1]}; use split_rotation: haar or another fraction"
                    )
        else:
            self.instances = (Instance("", head_dim, spec.bits, spec.seed, spec.qjl),)
        self._device_cache: dict[torch.device, list[dict[str, torch.Tensor]]] = {}
        # (H_kv, D) float32 or None: keys stored divided by it, queries multiplied (``channel_scale: query``)
        self.channel_scale = self.fitted["channel_scale"].float() if "channel_scale" in self.fitted else None
        if spec.channel_scale != "none" and self.channel_scale is None:
            raise RecipeError(
                f"recipe field '{spec.path}.channel_scale': '{spec.channel_scale}' is fitted on calibration data and "
                "this runtime has no fitted scales; run kvtool calibrate with this recipe and load its artifact"
            )
        self._scale_on: dict[torch.device, torch.Tensor] = {}
        # (H_kv, D / 8) uint8 or None: the split's outlier channels per KV head (``outlier_channels: calibrated``)
        self.static_mask = self.fitted["outlier_channels"].to(torch.uint8) if "outlier_channels" in self.fitted else None
        if spec.outlier_channels == "calibrated" and self.static_mask is None:
            raise RecipeError(
                f"recipe field '{spec.path}.outlier_channels': 'calibrated' channels are chosen on calibration data and "
                "this runtime has none; run kvtool calibrate with this recipe and load its artifact"
            )
        self._mask_on: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def requires_fit(cls, spec) -> bool:
        return spec.channel_scale != "none" or spec.outlier_channels == "calibrated"

    @classmethod
    def fit_queries(cls, spec, head_dim, key_square_mean, query_square_mean, value_square_mean=None) -> dict[str, torch.Tensor]:
        """``channel_scale: query`` (`fit_channel_scale`) and / or ``outlier_channels: calibrated``: per KV head, the
        ``outlier_channel_fraction`` of the channels with the largest mean square of what the codes hold (keys after
        RoPE divided by the scale, or values), packed as `pack_mask` (H_kv, D / 8) uint8 ``outlier_channels``."""
        out = {}
        square_mean = value_square_mean if spec.path == "values" else key_square_mean
        if spec.channel_scale != "none":
            out.update(cls.fit_channel_scale(key_square_mean, query_square_mean))
            square_mean = key_square_mean / out["channel_scale"].square()  # (H, D) the mean square of k / s
        if spec.outlier_channels == "calibrated":
            if square_mean is None:
                raise ValueError(f"{spec.path}: calibrated outlier channels need the values' mean squares")
            count = round(head_dim * spec.outlier_channel_fraction)
            top = square_mean.float().topk(count, dim=-1).indices  # (H, count)
            mask = torch.zeros(square_mean.shape, dtype=torch.bool).scatter_(-1, top, True)
            out["outlier_channels"] = pack_mask(mask)
        return out

    @staticmethod
    def fit_channel_scale(key_square_mean, query_square_mean) -> dict[str, torch.Tensor]:
        """``channel_scale: query``: s_c = sqrt(rms(k_c) / rms(q_c)) per KV head, normalized to RMS 1.

        The rotation spreads a block's coding error evenly over the channels of what it codes, k / s, so the
        error of a score q . k is about ||q * s||^2 ||k / s||^2 (times a constant); by Cauchy-Schwarz that is
        smallest at s_c^2 = rms(k_c) / rms(q_c), where it falls from ||q||^2 ||k||^2 to (sum_c rms(q_c) rms(k_c))^2.
        Channels the queries barely read are coded coarser. The ratio is clipped to 1/64 .. 64 of the RMS (channels
        that are silent in the calibration text) so no stored value or query moves far from its float16 range.
        """
        k_rms = key_square_mean.double().clamp(min=0).sqrt()  # (H, D)
        q_rms = query_square_mean.double().clamp(min=0).sqrt()
        floor = 1e-12 + 1e-6 * torch.maximum(k_rms.amax(dim=-1, keepdim=True), q_rms.amax(dim=-1, keepdim=True))
        scale = ((k_rms + floor) / (q_rms + floor)).sqrt()
        scale = scale / scale.square().mean(dim=-1, keepdim=True).sqrt()
        scale = scale.clamp(1 / 64, 64)
        scale = scale / scale.square().mean(dim=-1, keepdim=True).sqrt()
        return {"channel_scale": scale.float()}

    def check_kv_heads(self, num_kv_heads: int) -> None:
        if self.static_mask is not None:
            shape = tuple(self.static_mask.shape)
            counts = unpack_mask(self.static_mask).sum(dim=-1).tolist() if len(shape) == 2 else []
            if shape != (num_kv_heads, self.head_dim // 8) or set(counts) != {self.outliers}:
                raise ArtifactError(
                    f"turboquant outlier channels for '{self.spec.path}' have shape {shape} with {counts} channels set; "
                    f"the model needs ({num_kv_heads}, {self.head_dim // 8}) with {self.outliers} per KV head: the "
                    "artifact is for another model or recipe; run kvtool calibrate again"
                )
        if self.channel_scale is not None and tuple(self.channel_scale.shape) != (num_kv_heads, self.head_dim):
            raise ArtifactError(
                f"turboquant channel scales for '{self.spec.path}' have shape {tuple(self.channel_scale.shape)}, the "
                f"model needs ({num_kv_heads}, {self.head_dim}): the artifact is for another model; run kvtool "
                "calibrate again"
            )

    def _scale(self, group: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """(N, D) float32 channel scale of each block's KV head (``group`` (N,)), or None without scales."""
        if self.channel_scale is None:
            return None
        if device not in self._scale_on:
            self._scale_on[device] = self.channel_scale.to(device)
        return self._scale_on[device][group.to(device)]

    def _on(self, device: torch.device) -> list[dict[str, torch.Tensor]]:
        """Each instance's fixed tensors on ``device``, plus ``rotation`` P (d, d) as a matrix: attention rotates a few
        query or output rows per block, where one small matrix product beats the transform's log2(d) passes."""
        if device not in self._device_cache:
            on = []
            for inst in self.instances:
                tensors = inst.tensors()
                on.append({**{k: v.to(device) for k, v in tensors.items()},
                           "rotation": _rotation_matrix(inst.dim, tensors).to(device)})
            self._device_cache[device] = on
        return self._device_cache[device]

    @property
    def per_block_order(self) -> bool:
        """True when every block has its own channel order (the split with masks stored per block): attention
        rotates the query into each block's order and each block's value sum back; else one order per stream."""
        return bool(self.outliers) and self.static_mask is None

    def _static_masks(self, group: torch.Tensor, device: torch.device) -> torch.Tensor:
        """(N, D) bool calibrated outlier channels of each block's (or stream's) KV head, ``group`` (N,)."""
        if device not in self._mask_on:
            self._mask_on[device] = unpack_mask(self.static_mask.to(device))  # (H_kv, D)
        return self._mask_on[device][group.to(device)]

    def block_masks(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        """(N, D) bool outlier channels of N blocks: their stored masks, or the calibrated ones of their KV heads."""
        if self.static_mask is not None:
            return self._static_masks(group, blocks["norm"].device)
        return unpack_mask(blocks["outlier_mask"])

    def channel_bits(self, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(D,) int64 code + QJL bits of every channel of a block with outlier ``mask`` (D,) bool (None: no split)."""
        bits = torch.full((self.head_dim,), self.instances[-1].bits, dtype=torch.long)
        if self.outliers:
            bits[mask.cpu()] = self.instances[0].bits
        return bits

    def block_spec(self):
        s = self.block_size
        stored_mask = self.outliers and self.static_mask is None  # calibrated channels live beside the store
        spec = {"outlier_mask": ((self.head_dim // 8,), torch.uint8)} if stored_mask else {}
        for inst in self.instances:
            p = inst.prefix
            spec[p + "codes"] = ((packed_rows(s, inst.code_bits), inst.dim), torch.uint8)
            spec[p + "norm"] = ((s,), torch.float16) if self.norm_bits == 16 else ((s + 4,), torch.uint8)
            if inst.qjl:
                spec[p + "qjl_signs"] = ((packed_rows(s, 1), inst.dim), torch.uint8)
                spec[p + "residual_norm"] = ((s,), torch.float16)
        return spec

    # --- the Triton decode kernel ----------------------------------------------------------------
    def kernel_format(self):
        """Codebook lookups times the per-token norm: one instance read in the rotated domain (`body_rotated.py`), or
        the outlier split's two rebuilt in head space (`body_split.py`); keys with ``qjl`` add each instance's QJL
        term to the scores (`body_qjl.py`)."""
        from kvtool.runtime.kernels.body_format import BodyFormat

        rest = self.instances[-1]
        split = dict(split=self.outliers, split_bits=self.instances[0].code_bits) if self.outliers else dict(rotated=True)
        norm = "norm" if self.norm_bits == 16 else "norm8"
        return BodyFormat(bits=rest.code_bits, per_channel=False, group=self.head_dim, scales=norm, zero=False,
                          levels=2**rest.code_bits, qjl=self.qjl, query_scale=self.channel_scale is not None,
                          static_mask=self.static_mask is not None, **split)

    def kernel_tensors(self, device) -> dict[str, torch.Tensor]:
        """`kernel_constants` in float32, plus the calibrated outlier channels ``outlier_mask`` (H_kv, D / 8) uint8 as
        they are (a block's stored mask has the same layout: the kernels read the stream's head's row instead)."""
        tensors = super().kernel_tensors(device)
        if self.static_mask is None:
            return tensors
        cache = self.__dict__.setdefault("_static_mask_tensors", {})
        key = str(device)
        if key not in cache:
            cache[key] = {**tensors, "outlier_mask": self.static_mask.to(device).contiguous()}
        return cache[key]

    def kernel_constants(self) -> dict[str, torch.Tensor]:
        """``codebook`` (2**b,) of the (rest) instance; ``rotation`` P (D, D), ``rotate(x) = x @ P^T``, and with QJL
        ``qjl_sketch`` G (D, D); or with the split ``split_tables``: the outlier codebook, then P_o and P_r flattened
        (with QJL, then G_o P_o and G_r P_r flattened: the kernel sketches the head-space query per block)."""
        tables = [inst.tensors() for inst in self.instances]
        rotations = [_rotation_matrix(inst.dim, t) for inst, t in zip(self.instances, tables)]
        scale = {} if self.channel_scale is None else {"channel_scale": self.channel_scale}  # (H_kv, D)
        if not self.outliers:
            out = {"codebook": tables[0]["codebook"], "rotation": rotations[0], **scale}
            return {**out, "qjl_sketch": tables[0]["sketch"]} if self.qjl else out
        parts = [tables[0]["codebook"], rotations[0].flatten(), rotations[1].flatten()]
        if self.qjl:
            parts += [(t["sketch"] @ p).flatten() for t, p in zip(tables, rotations)]  # G_i P_i
        return {"codebook": tables[1]["codebook"], "split_tables": torch.cat(parts), **scale}

    # --- one instance ---------------------------------------------------------------------------
    def _encode_instance(self, inst: Instance, x: torch.Tensor, on: dict) -> dict[str, torch.Tensor]:
        """x (N, S, d) float32, the instance's channels -> its storage tensors."""
        p, out = inst.prefix, {}
        norm = x.norm(dim=-1)  # (N, S)
        if self.norm_bits == 16:
            out[p + "norm"] = norm.clamp(max=65504.0).to(torch.float16)
        else:
            out[p + "norm"] = encode_norms8(norm.reshape(-1, norm.shape[-1])).reshape(*norm.shape[:-1], -1)
        y = rotate_with(x / norm.clamp(min=1e-30)[..., None], on)  # (N, S, d) unit vectors, rotated
        codebook = on["codebook"]
        codes = torch.bucketize(y.contiguous(), (codebook[1:] + codebook[:-1]) / 2)  # nearest level
        out[p + "codes"] = pack_codes(codes, inst.code_bits)
        if inst.qjl:
            residual = y - codebook[codes]  # (N, S, d)
            projected = residual @ on["sketch"].T  # (N, S, d): G r per token
            out[p + "qjl_signs"] = pack_codes((projected >= 0).to(torch.uint8), 1)
            out[p + "residual_norm"] = residual.norm(dim=-1).to(torch.float16)
        return out

    def _norms(self, inst: Instance, blocks: dict[str, torch.Tensor]) -> torch.Tensor:
        """(..., S) float32: the stored norm of every token of the blocks, for one instance."""
        stored = blocks[inst.prefix + "norm"]
        return stored.float() if self.norm_bits == 16 else decode_norms8(stored)

    def _reconstruct(self, inst: Instance, blocks: dict[str, torch.Tensor], on: dict) -> torch.Tensor:
        """Packed codes (N, ...) -> y_hat (N, S, d) float32 in the instance's rotated domain (codes only)."""
        return lookup(on["codebook"], unpack_codes(blocks[inst.prefix + "codes"], inst.code_bits, self.block_size))

    def _qjl_signs(self, inst: Instance, blocks: dict[str, torch.Tensor]) -> torch.Tensor:
        """Packed QJL bits (N, S/8, d) -> (N, S, d) float32 in {-1, +1}."""
        return unpack_codes(blocks[inst.prefix + "qjl_signs"], 1, self.block_size).float() * 2 - 1

    def _qjl_gamma(self, inst: Instance, blocks: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N, S) float32: sqrt(pi/2) / d * ||r||, the scale of the QJL estimate."""
        return blocks[inst.prefix + "residual_norm"].float() * (math.sqrt(math.pi / 2) / inst.dim)

    def _rotated_estimate(self, inst: Instance, blocks: dict[str, torch.Tensor], on: dict) -> torch.Tensor:
        """The stored unit vectors in the instance's rotated domain (N, S, d): y_hat (+ the QJL residual estimate)."""
        y = self._reconstruct(inst, blocks, on)
        if inst.qjl:
            y = y + (self._qjl_signs(inst, blocks) @ on["sketch"]) * self._qjl_gamma(inst, blocks)[..., None]  # G^T sign(Gr)
        return y

    # --- encode / decode ------------------------------------------------------------------------
    def encode_blocks(self, x: torch.Tensor, group: torch.Tensor) -> dict[str, torch.Tensor]:
        on = self._on(x.device)
        x = x[:, 0].float()  # (N, S, D)
        scale = self._scale(group, x.device)
        if scale is not None:
            x = x / scale[:, None, :]  # what the codes hold: k / s (the query carries s)
        out = {}
        if self.outliers:
            if self.static_mask is not None:
                mask = self._static_masks(group, x.device)  # (N, D) the blocks' KV heads' calibrated channels
            else:
                mask = outlier_mask(x, self.outliers)  # (N, D)
                out["outlier_mask"] = pack_mask(mask)
            x = x.gather(-1, channel_order(mask)[:, None, :].expand_as(x))  # (N, S, D) outliers first
        start = 0
        for inst, tensors in zip(self.instances, on):
            out.update(self._encode_instance(inst, x[..., start : start + inst.dim], tensors))
            start += inst.dim
        return out

    def decode_blocks(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        on = self._on(blocks["norm"].device)
        parts = [unrotate_with(self._rotated_estimate(inst, blocks, t), t) * self._norms(inst, blocks)[..., None]
                 for inst, t in zip(self.instances, on)]
        x = torch.cat(parts, dim=-1)  # (N, S, D) in the block's channel order
        if self.outliers:
            x = x.gather(-1, channel_slot(self.block_masks(blocks, group))[:, None, :].expand_as(x))  # head channels
        scale = self._scale(group, x.device)
        if scale is not None:
            x = x * scale[:, None, :]
        limit = torch.finfo(self.dtype).max
        return x.clamp(-limit, limit).to(self.dtype)[:, None]

    # --- attention in the rotated domains -------------------------------------------------------
    def _flat(self, blocks):
        """{(Sc, nb, ...)} -> {(Sc*nb, ...)} and (Sc, nb)."""
        sc, nb = blocks["norm"].shape[:2]
        return {name: t.reshape(sc * nb, *t.shape[2:]) for name, t in blocks.items()}, sc, nb

    def _block_order(self, flat, sc: int, nb: int, rows: int, group, inverse: bool = False) -> torch.Tensor:
        """(Sc, nb, R, D) int64: each block's channel order (``inverse``: each channel's slot in it), repeated over the R
        query rows; (Sc, 1, R, D) with calibrated channels (one order per stream, ``group`` (Sc,) its KV head)."""
        if self.static_mask is not None:
            mask, nb = self._static_masks(group, flat["norm"].device), 1  # (Sc, D)
        else:
            mask = unpack_mask(flat["outlier_mask"])  # (Sc*nb, D)
        order = channel_slot(mask) if inverse else channel_order(mask)
        return order.reshape(sc, nb, 1, self.head_dim).expand(sc, nb, rows, self.head_dim)

    def chunk_scores(self, query, blocks, group, keys_to_attention=None):
        if keys_to_attention is not None:  # keys stored before RoPE are refused by the recipe; kept for safety
            return super().chunk_scores(query, blocks, group, keys_to_attention)
        on = self._on(query.device)
        flat, sc, nb = self._flat(blocks)
        s, rows = self.block_size, query.shape[2]
        q = query[:, 0][:, None]  # (Sc, 1, R, D): one channel order for every block
        scale = self._scale(group, query.device)
        if scale is not None:
            q = q * scale[:, None, None, :]  # (q * s) . (k / s) = q . k
        if self.outliers:  # (Sc, nb, R, D): the query in each block's channel order ((Sc, 1, R, D): calibrated)
            order = self._block_order(flat, sc, nb, rows, group)
            q = q.expand(sc, order.shape[1], rows, self.head_dim).gather(-1, order)
        scores, start = 0.0, 0
        for inst, t in zip(self.instances, on):
            q_rot = q[..., start : start + inst.dim] @ t["rotation"].T  # (Sc, 1|nb, R, d): the query in the keys' domain
            y_hat = self._reconstruct(inst, flat, t).reshape(sc, nb, s, inst.dim)  # (Sc, nb, S, d) codebook values
            part = torch.matmul(q_rot, y_hat.transpose(-1, -2))  # (Sc, nb, R, S)
            if inst.qjl:
                signs = self._qjl_signs(inst, flat).reshape(sc, nb, s, inst.dim)  # (Sc, nb, S, d)
                q_sketch = q_rot @ t["sketch"].T  # (Sc, 1|nb, R, d): G q
                part = part + torch.matmul(q_sketch, signs.transpose(-1, -2)) * self._qjl_gamma(inst, flat).reshape(sc, nb, 1, s)
            scores = scores + part * self._norms(inst, flat).reshape(sc, nb, 1, s)
            start += inst.dim
        return scores.transpose(1, 2).reshape(sc, rows, nb * s)[:, None]  # (Sc, 1, R, T)

    def chunk_values(self, probs, blocks, group):
        on = self._on(probs.device)
        flat, sc, nb = self._flat(blocks)
        s, rows = self.block_size, probs.shape[2]
        p = probs[:, 0].reshape(sc, rows, nb, s).transpose(1, 2)  # (Sc, nb, R, S)
        parts = []
        for inst, t in zip(self.instances, on):
            y = self._rotated_estimate(inst, flat, t).reshape(sc, nb, s, inst.dim)  # (Sc, nb, S, d)
            weights = p * self._norms(inst, flat).reshape(sc, nb, 1, s)  # (Sc, nb, R, S): p_t ||x_t||
            out_rot = torch.matmul(weights, y)  # (Sc, nb, R, d) in the rotated domain
            if not self.per_block_order:
                out_rot = out_rot.sum(dim=1, keepdim=True)  # one channel order: sum the blocks, rotate back once
            parts.append(out_rot @ t["rotation"])  # P^T y per row: back to the instance's channels
        out = torch.cat(parts, dim=-1)  # (Sc, 1|nb, R, D) in each block's channel order
        if self.outliers:  # back to head channels: channel c reads its slot in the block's order
            out = out.gather(-1, self._block_order(flat, sc, nb, rows, group, inverse=True))
        out = out.sum(dim=1)[:, None]  # (Sc, 1, R, D)
        scale = self._scale(group, probs.device)
        return out if scale is None else out * scale[:, None, None, :]
