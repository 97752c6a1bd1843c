"""Recipes: frozen, validated descriptions of how to compress a KV cache.

A recipe is YAML on disk and a tree of frozen dataclasses in memory. Every field
is validated in ``__post_init__``; unknown keys and bad values raise
``RecipeError`` naming the field path (for example ``keys.bits``).

Example (``recipes/kivi-4bit.yaml``)::

    name: kivi-4bit
    keys:   {method: uniform, bits: 4, axis: channel}
    values: {method: uniform, bits: 4, axis: token, group_size: 32}
    cache:  {block_size: 32, sink_tokens: 4, recent_tokens: 64}
    calibration: {samples: 8, seq_len: 512, seed: 0}
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtool.errors import RecipeError
from kvtool.recipe_layers import LayerOverride, parse_overrides

QUANT_METHODS = ("none", "uniform", "nuq", "palu", "fp8", "int_static", "turboquant")
CODEBOOKS = ("fisher-kmeans", "kmeans", "uniform", "nf")
METHOD_BITS = {
    "uniform": (2, 3, 4, 8), "nuq": (2, 3, 4), "palu": (2, 3, 4, 8, 16), "fp8": (8,), "int_static": (2, 3, 4, 8),
    "turboquant": (2, 3, 4),
}
FP8_FORMATS = ("e4m3", "e5m2")
# scale granularity: fp8 block (dynamic, per block), layer or head (static, calibrated);
# int_static layer, head or channel (static, calibrated; channel = per KV head and channel)
GRANULARITIES = {"fp8": ("block", "layer", "head"), "int_static": ("layer", "head", "channel")}
SCALE_FITS = ("amax", "mse")
TURBOQUANT_FRACTIONS = (0.0, 0.25, 0.5)
TURBOQUANT_NORM_BITS = (16, 8)  # a token's norm per instance: float16, or an 8-bit log code over the block's range
TURBOQUANT_OUTLIER_FRACTIONS = (0.125, 0.25, 0.5)  # of the channels, coded at bits + extra_bits / fraction
TURBOQUANT_OUTLIER_EXTRA = (1, 2)  # extra_bits / outlier_channel_fraction: the outliers' bits over the rest's
SPLIT_ROTATIONS = ("haar", "kronecker")  # turboquant's rotation of a split instance whose width is not a power of two
OUTLIER_CHANNELS = ("block", "calibrated")  # turboquant's split: each block's own channels, or calibrated per KV head
CHANNEL_SCALES = ("none", "query")  # turboquant keys: none, or fitted from the calibration queries
RANK_ALLOCATIONS = ("fisher", "gradient", "uniform")
AXES = ("channel", "token")
FLOAT_DTYPES = ("float16", "bfloat16", "float8_e4m3", "int8", "model")
EVICTION_POLICIES = (
    "none", "streamingllm", "h2o", "snapkv", "vatp", "knorm", "fastgen", "tova", "chunkkv", "cake", "pyramidinfer",
    "rocketkv",
)
OWN_LAYER_BUDGETS = ("cake", "pyramidinfer")  # policies that set their own per-layer budgets
LAYER_BUDGETS = ("uniform", "pyramid", "profile")
HEAD_BUDGETS = ("uniform", "adaptive")
POOLING_MODES = ("auto", "max", "mean")  # EvictionSpec.pooling_mode
FASTGEN_PROFILE_SOURCES = ("offline", "prompt")  # where FastGen's per-head policies come from
ATTENTION_SCORED = ("h2o", "snapkv", "vatp", "tova", "chunkkv", "rocketkv")  # scores comparable across heads (head_budgets: adaptive)
SPARSE_METHODS = ("none", "rocketkv")
UNREAD_RULES = ("drop", "estimate", "estimate_blocks")  # sparse_attention.unread
READ_BUDGETS = ("per_head", "shared")  # sparse_attention.read_budget
CHANNEL_SCORES = ("query", "query_key")  # sparse_attention.channel_score
SMALL_BLOCK_METHODS = ("turboquant", "none")  # block_size 16 allowed: codes read as bytes, not 32-token words
# policies that do not score tokens by attention while decoding: sparse attention reads only some blocks per step
DECODE_UNSCORED = ("none", "streamingllm", "knorm", "rocketkv")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _is_int(value: Any) -> bool:
    """An integer that is not a bool (YAML ``true`` is not a token count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _require(condition: bool, path: str, message: str) -> None:
    if not condition:
        raise RecipeError(f"recipe field '{path}': {message}")


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor kind (keys or values) is stored in the cache body.

    method: ``none`` keeps 16-bit floats; ``uniform`` is asymmetric integer
        quantization (KIVI) with one scale and zero point per group; ``nuq`` is
        KVQuant: a per-layer non-uniform codebook fitted offline, optional
        dense-and-sparse outliers and Q-Norm.
    bits: code width: 2, 3, 4 or 8 for ``uniform``; 2, 3 or 4 for ``nuq``; 16 for ``none``.
    axis: ``channel`` = scales per channel (keys; KIVI/KVQuant); ``token`` = scales
        per token over ``group_size`` channels (values).
    group_size: channels per scale group when ``axis == token`` (clamped to head_dim).
    pre_rope: keys only: quantize keys before RoPE (KVQuant); the cache rotates them
        back at their true positions when it reads them.
    codebook: ``nuq`` only: ``fisher-kmeans`` (k-means weighted by Fisher
        sensitivity), ``kmeans`` (unweighted), ``uniform`` (evenly spaced) or ``nf``
        (normal-float quantiles).
    outlier_fraction: ``nuq`` only: fraction of each block's elements stored sparse in
        16-bit with their positions (dense-and-sparse); keys' per-channel thresholds are
        calibrated offline at this percentile. Default 0.01 for ``nuq``, 0 otherwise.
    qnorm: ``nuq`` only: correct the codebook so dequantized values keep the mean and
        variance of the calibration distribution (Q-Norm).
    rank_fraction: ``palu`` only: fraction of the K (or V) dimensions kept as a low-rank
        latent, averaged over layers (0.7 = "Palu-30%": 30% rank reduction).
    group_heads: ``palu`` only: KV heads per decomposition group (1 = per head, 0 = all
        heads of a layer jointly); must divide the model's KV heads.
    whiten: ``palu`` only: decompose the projection whitened by the calibration inputs'
        covariance (SVD-LLM) instead of plain SVD.
    rank_allocation: ``palu`` only: ``fisher`` (ranks across layers and K/V from Fisher
        information, per element), ``gradient`` (ranks across layers and K/V from the
        reconstruction error projected on the loss gradient, per token; see
        `kvtool.methods.lowrank.rank_search`) or ``uniform`` (the same fraction everywhere).
    hadamard: ``palu`` only: Walsh-Hadamard transform of the latents before quantizing them
        (block-wise at decode time: blocks of the largest power of two dividing the rank, at most 64).
    rotate_basis: ``palu`` only, quantized latents: an r x r orthogonal rotation folded into the
        basis at calibration (a DCT (x) Walsh-Hadamard matrix, `latent_rotation`), which spreads the
        first, dominant latent coordinate flat over all r coordinates before the per-token codes,
        at no decode cost and for any rank; replaces ``hadamard``.
    For ``palu``, ``bits`` is the latent code width (16 = float latents; otherwise uniform
    per-token quantization of the latents).
    fp8_format: ``fp8`` only: ``e4m3`` (torch.float8_e4m3fn, max 448) or ``e5m2`` (max 57344).
    granularity: ``fp8``: ``block`` (dynamic: one scale per stored block, from its amax),
        ``layer`` or ``head`` (static: one calibrated scale per layer or per KV head);
        ``int_static``: ``layer``, ``head`` or ``channel`` (calibrated range per layer, per KV
        head, or per KV head and channel).
    scale_fit: static scales only: ``amax`` (the calibration data's range) or ``mse`` (the
        clipping of that range with the least squared error on the calibration sample).
    extra_bits: ``turboquant`` only: 0, 0.25 or 0.5; > 0 is the paper's outlier split: per stored
        block, the channels with the most energy (``outlier_channel_fraction`` of them) and the rest
        are coded by two independent TurboQuant instances, the outliers at ``bits + extra_bits /
        outlier_channel_fraction``: bits 2 + extra_bits 0.5 = 2.5 bits per channel on average.
    outlier_channel_fraction: ``turboquant`` with ``extra_bits`` only: the outliers one or two
        bits above the rest. extra_bits 0.5: 0.5 (half the channels at one more bit) or 0.25 (a
        quarter at two more); extra_bits 0.25: 0.25 or 0.125 (an eighth at two more). Default:
        ``extra_bits`` (one more bit).
    outlier_channels: ``turboquant`` with ``extra_bits`` only: which channels the outlier instance
        codes. ``block`` (default): each stored block picks its own (the most energy over its
        tokens) and stores them as a D-bit mask. ``calibrated``: `kvtool calibrate` picks them once
        per layer and KV head from the calibration text's mean squares (keys after RoPE, divided by
        ``channel_scale`` where there is one; values); blocks store no mask.
    split_rotation: ``turboquant`` with ``extra_bits`` only: the rotation of a split instance whose
        width is not a power of two (head_dim 64 with a quarter of outliers: 48 regular channels;
        256: 192). ``haar`` (default, the paper's): a Haar-random orthogonal matrix, read as a dense
        d x d product per query row and block by the CPU kernel. ``kronecker``: (M kron H_n) diag(s),
        random signs s, the Walsh-Hadamard transform of the width's largest power-of-two factor n
        (>= 8) and a Haar-random m x m matrix M across its odd factor m (48 = 3 x 16): every output
        still mixes every input, and the CPU kernel applies it as m fast transforms and an m x m
        product (a fraction of the dense product's work). Power-of-two widths use the randomized
        Hadamard rotation either way.
    qjl: ``turboquant`` keys only: spend one of the ``bits`` on a 1-bit QJL sketch of the
        residual (unbiased inner products with the query).
    seed: ``turboquant`` only: seed of the random rotation's signs (and of the QJL matrix).
    channel_scale: ``turboquant`` keys only: ``none`` (default) or ``query``: a per-channel scale s
        (one per KV head and channel) fitted by `kvtool calibrate` from the calibration queries and
        keys; the codes hold k / s and attention multiplies the query by s, so q . k is unchanged and
        the rotation's even spread of the coding error lands where the queries read little:
        s_c = sqrt(rms(k_c) / rms(q_c)), the minimum of the expected squared score error.
    norm_bits: ``turboquant`` only: 16 (default: each token's norm per instance in float16) or 8 (a
        log-scale code per token over the block's own range of norms, 255 steps: within 0.3% of
        the norm for a block whose norms span a factor 4; 8 bits per token and instance saved,
        less 32 per block).
    """

    method: str = "uniform"
    bits: int = 4
    axis: str = "channel"
    group_size: int = 32
    pre_rope: bool = False
    codebook: str = "fisher-kmeans"
    outlier_fraction: float | None = None
    qnorm: bool = False
    rank_fraction: float = 0.5
    group_heads: int = 1
    whiten: bool = True
    rank_allocation: str = "fisher"
    hadamard: bool = False
    rotate_basis: bool = False
    fp8_format: str = "e4m3"
    granularity: str | None = None
    scale_fit: str = "amax"
    extra_bits: float = 0.0
    outlier_channel_fraction: float | None = None
    qjl: bool = False
    seed: int = 0
    channel_scale: str = "none"
    norm_bits: int = 16
    outlier_channels: str = "block"
    split_rotation: str = "haar"
    path: str = field(default="keys", repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self.path
        _require(self.method in QUANT_METHODS, f"{p}.method", f"'{self.method}' is not one of {list(QUANT_METHODS)}")
        if self.method == "none":
            _require(self.bits == 16, f"{p}.bits", f"method 'none' stores 16-bit floats; got {self.bits} (use bits: 16)")
        else:
            allowed = METHOD_BITS[self.method]
            _require(
                _is_int(self.bits) and self.bits in allowed,
                f"{p}.bits",
                f"{self.bits} is not supported by '{self.method}'; choose one of {list(allowed)}",
            )
        _require(self.axis in AXES, f"{p}.axis", f"'{self.axis}' is not one of {list(AXES)}")
        _require(
            _is_int(self.group_size) and _is_power_of_two(self.group_size),
            f"{p}.group_size",
            f"{self.group_size} must be a positive power of two",
        )
        _require(isinstance(self.pre_rope, bool), f"{p}.pre_rope", "must be true or false")
        _require(not (self.pre_rope and p == "values"), f"{p}.pre_rope", "only keys carry RoPE; remove it from values")
        _require(self.codebook in CODEBOOKS, f"{p}.codebook", f"'{self.codebook}' is not one of {list(CODEBOOKS)}")
        _require(isinstance(self.qnorm, bool), f"{p}.qnorm", "must be true or false")
        fraction = self.outlier_fraction
        if fraction is None:
            object.__setattr__(self, "outlier_fraction", 0.01 if self.method == "nuq" else 0.0)
            fraction = self.outlier_fraction
        _require(
            isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 <= fraction <= 0.1,
            f"{p}.outlier_fraction",
            f"{fraction} must be a fraction between 0 and 0.1 (0.01 = 1% outliers)",
        )
        _require(
            isinstance(self.rank_fraction, (int, float)) and not isinstance(self.rank_fraction, bool)
            and 0 < self.rank_fraction <= 1,
            f"{p}.rank_fraction", f"{self.rank_fraction} must be a fraction in (0, 1] (0.7 keeps 70% of the dimensions)",
        )
        _require(_is_int(self.group_heads) and self.group_heads >= 0, f"{p}.group_heads", "must be an integer >= 0 (0 = all heads)")
        _require(isinstance(self.whiten, bool), f"{p}.whiten", "must be true or false")
        _require(isinstance(self.hadamard, bool), f"{p}.hadamard", "must be true or false")
        _require(isinstance(self.rotate_basis, bool), f"{p}.rotate_basis", "must be true or false")
        if self.rotate_basis:
            _require(self.method == "palu", f"{p}.rotate_basis", f"rotates a Palu basis: needs method 'palu', not '{self.method}'")
            _require(self.bits != 16, f"{p}.rotate_basis",
                     "mixes the latents for their quantized codes; 16-bit latents are not quantized: set bits below 16")
            _require(not self.hadamard, f"{p}.rotate_basis",
                     "and hadamard both mix the latents: keep one (rotate_basis mixes all of them at no decode cost)")
        _require(
            self.rank_allocation in RANK_ALLOCATIONS, f"{p}.rank_allocation",
            f"'{self.rank_allocation}' is not one of {list(RANK_ALLOCATIONS)}",
        )
        if self.method in ("nuq", "palu") and p == "keys":
            _require(self.pre_rope, f"{p}.pre_rope", f"{self.method} keys are calibrated before RoPE: set keys.pre_rope: true")
        self._check_new_methods()
        if self.method != "nuq":
            _require(fraction == 0, f"{p}.outlier_fraction", f"outliers need method 'nuq', not '{self.method}'")
            _require(not self.qnorm, f"{p}.qnorm", f"Q-Norm needs method 'nuq', not '{self.method}'")


    def _check_new_methods(self) -> None:
        """Fields of fp8, int_static and turboquant: only where they mean something, and valid there."""
        p, method = self.path, self.method
        _require(self.fp8_format in FP8_FORMATS, f"{p}.fp8_format", f"'{self.fp8_format}' is not one of {list(FP8_FORMATS)}")
        _require(method == "fp8" or self.fp8_format == "e4m3", f"{p}.fp8_format", f"needs method 'fp8', not '{method}'")
        if method in GRANULARITIES:
            allowed = GRANULARITIES[method]
            if self.granularity is None:
                object.__setattr__(self, "granularity", allowed[0])
            _require(self.granularity in allowed, f"{p}.granularity",
                     f"'{self.granularity}' is not one of {list(allowed)} for method '{method}'")
        else:
            _require(self.granularity is None, f"{p}.granularity", f"needs method 'fp8' or 'int_static', not '{method}'")
        _require(self.scale_fit in SCALE_FITS, f"{p}.scale_fit", f"'{self.scale_fit}' is not one of {list(SCALE_FITS)}")
        _require(self.scale_fit == "amax" or self.is_static, f"{p}.scale_fit",
                 "only calibrated (static) scales are fitted: use method 'int_static' or fp8 with granularity layer/head")
        _require(self.extra_bits in TURBOQUANT_FRACTIONS and not isinstance(self.extra_bits, bool), f"{p}.extra_bits",
                 f"{self.extra_bits} is not one of {list(TURBOQUANT_FRACTIONS)}")
        _require(method == "turboquant" or self.extra_bits == 0, f"{p}.extra_bits", f"needs method 'turboquant', not '{method}'")
        if self.outlier_channel_fraction is None:
            object.__setattr__(self, "outlier_channel_fraction", self.extra_bits)  # one more bit (0 without a split)
        if self.extra_bits:
            _require(self.outlier_channel_fraction in TURBOQUANT_OUTLIER_FRACTIONS
                     and not isinstance(self.outlier_channel_fraction, bool), f"{p}.outlier_channel_fraction",
                     f"{self.outlier_channel_fraction} is not one of {list(TURBOQUANT_OUTLIER_FRACTIONS)}")
            extra = self.extra_bits / self.outlier_channel_fraction
            _require(extra in TURBOQUANT_OUTLIER_EXTRA, f"{p}.outlier_channel_fraction",
                     f"extra_bits {self.extra_bits} over a fraction {self.outlier_channel_fraction} of the channels puts "
                     f"the outliers {extra:g} bits above the rest; use a fraction that makes it 1 or 2 (extra_bits 0.5: "
                     "0.5 or 0.25; extra_bits 0.25: 0.25 or 0.125)")
        else:
            _require(self.outlier_channel_fraction == 0, f"{p}.outlier_channel_fraction",
                     "the outlier split makes the extra_bits: needs method 'turboquant' with extra_bits: 0.5")
        _require(isinstance(self.qjl, bool), f"{p}.qjl", "must be true or false")
        _require(not self.qjl or method == "turboquant", f"{p}.qjl", f"needs method 'turboquant', not '{method}'")
        _require(not (self.qjl and p == "values"), f"{p}.qjl", "the QJL sketch corrects inner products with the query: keys only")
        _require(_is_int(self.seed), f"{p}.seed", "must be an integer")
        _require(self.channel_scale in CHANNEL_SCALES, f"{p}.channel_scale",
                 f"'{self.channel_scale}' is not one of {list(CHANNEL_SCALES)}")
        if self.channel_scale != "none":
            _require(method == "turboquant", f"{p}.channel_scale", f"needs method 'turboquant', not '{method}'")
            _require(p == "keys", f"{p}.channel_scale",
                     "'query' weighs key channels by the queries that read them: keys only")
        _require(self.outlier_channels in OUTLIER_CHANNELS, f"{p}.outlier_channels",
                 f"'{self.outlier_channels}' is not one of {list(OUTLIER_CHANNELS)}")
        _require(self.outlier_channels == "block" or (method == "turboquant" and self.extra_bits), f"{p}.outlier_channels",
                 "'calibrated' chooses the channels of turboquant's outlier split: needs method 'turboquant' with "
                 "extra_bits 0.25 or 0.5")
        _require(self.split_rotation in SPLIT_ROTATIONS, f"{p}.split_rotation",
                 f"'{self.split_rotation}' is not one of {list(SPLIT_ROTATIONS)}")
        _require(self.split_rotation == "haar" or (method == "turboquant" and self.extra_bits), f"{p}.split_rotation",
                 "'kronecker' rotates an instance of turboquant's outlier split: needs method 'turboquant' with "
                 "extra_bits 0.25 or 0.5")
        _require(self.norm_bits in TURBOQUANT_NORM_BITS and not isinstance(self.norm_bits, bool), f"{p}.norm_bits",
                 f"{self.norm_bits} is not one of {list(TURBOQUANT_NORM_BITS)}")
        _require(method == "turboquant" or self.norm_bits == 16, f"{p}.norm_bits", f"needs method 'turboquant', not '{method}'")
        if method == "turboquant":
            _require(not self.pre_rope, f"{p}.pre_rope", "turboquant rotates keys after RoPE: remove pre_rope")
            _require(not (self.qjl and self.bits < 2), f"{p}.bits", "QJL takes one of the bits: needs bits >= 2")

    @property
    def learns_from_data(self) -> bool:
        """True when `kvtool calibrate` fits this spec per layer (nuq codebooks, Palu bases, static scales)."""
        return (self.method in ("nuq", "palu") or self.is_static or self.channel_scale != "none"
                or self.outlier_channels != "block")

    @property
    def is_static(self) -> bool:
        """True when the method's scales come from `kvtool calibrate` (fp8 layer/head, int_static)."""
        return self.method == "int_static" or (self.method == "fp8" and self.granularity in ("layer", "head"))


@dataclass(frozen=True)
class CacheSpec:
    """Layout of the runtime cache.

    block_size: tokens per storage block; the body is quantized a block at a
        time (power of two, at least 32 so codes fill 32-bit words; 16 where every
        quantized side is turboquant, whose codes are read as bytes: the newest
        0 .. block_size - 1 tokens wait in 16 bits, so a smaller block holds less).
    sink_tokens: first tokens kept in full precision (attention sinks).
    recent_tokens: most recent tokens kept in full precision (KIVI residual).
    float_dtype: dtype of every float the cache stores (sinks, recent window,
        the open block's tokens, ``none`` bodies): ``float16``, ``bfloat16``,
        ``model`` (whatever the model computes in, e.g. float32 on CPU; makes a
        no-op cache bit-exact), ``float8_e4m3`` (the float blocks in one byte
        per value, e4m3 without a scale: saturates at +-448, keeps 3 mantissa
        bits, about 31 dB SQNR; ``none`` bodies stay float16, method ``fp8``
        stores a scaled fp8 body), or ``int8`` (the float blocks as int8 codes
        with one float16 scale per 32 channels of each token, symmetric, scale =
        the group's largest magnitude / 127: 8.5 bits per value, about 42 dB
        SQNR on Gemma-3-270M's keys and values). The body of a quantized recipe
        is encoded from what its float blocks held, so with ``float8_e4m3`` or
        ``int8`` the codes start from the one-byte values.
    float_block_size: tokens per float block (sinks, recent window, the open
        block's tokens; every token of a recipe that quantizes nothing): a power
        of two from 2 to 64. A float block is held whole once it has a token, so
        smaller blocks waste fewer 16-bit slots (a window-less quantized stream
        holds its sinks and 0 .. block_size - 1 open tokens); larger ones mean
        fewer block-table entries for float-only caches.
    """

    block_size: int = 32
    sink_tokens: int = 4
    recent_tokens: int = 64
    float_dtype: str = "float16"
    float_block_size: int = 16

    def __post_init__(self) -> None:
        _require(
            _is_int(self.block_size) and _is_power_of_two(self.block_size) and self.block_size >= 16,
            "cache.block_size",
            f"{self.block_size} must be a power of two >= 32 (16 for turboquant codes)",
        )
        _require(_is_int(self.sink_tokens) and self.sink_tokens >= 0, "cache.sink_tokens", "must be an integer >= 0")
        _require(
            _is_int(self.recent_tokens) and self.recent_tokens >= 0, "cache.recent_tokens", "must be an integer >= 0"
        )
        _require(
            self.float_dtype in FLOAT_DTYPES,
            "cache.float_dtype",
            f"'{self.float_dtype}' is not one of {list(FLOAT_DTYPES)}",
        )
        _require(
            _is_int(self.float_block_size) and _is_power_of_two(self.float_block_size)
            and 2 <= self.float_block_size <= 64,
            "cache.float_block_size",
            f"{self.float_block_size} must be a power of two from 2 to 64 (tokens per float block)",
        )


def _is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_fraction(value: Any, low_open: bool = True) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and (0 < value <= 1 if low_open else 0 <= value <= 1)


@dataclass(frozen=True)
class EvictionSpec:
    """Which tokens each (sequence, KV head) stream keeps; the rest are freed.

    policy: ``none`` keeps every token; ``streamingllm`` (sinks + recent window),
        ``h2o`` (heavy hitters by accumulated attention + window), ``snapkv`` (prompt
        tokens scored by the attention of the last ``window`` queries, pooled; then
        accumulated attention while decoding), ``vatp`` (accumulated attention x value
        L1 norm), ``knorm`` (lowest key L2 norm), ``fastgen`` (per-KV-head policies from
        a profile: special / +punctuation / +local / +frequent / full), ``tova`` (the
        attention of the current query only, at every step), ``chunkkv`` (whole chunks of
        consecutive tokens by summed SnapKV importance), ``cake`` (layer budgets from each
        layer's attention dispersion and shift, tokens by window mean + gamma x variance),
        ``pyramidinfer`` (one kept set per layer by recent attention, shrinking with depth),
        ``rocketkv`` (RocketKV's stage 1: SnapKV's pooled window score at each multi-token
        forward, summed over the GQA group; generated tokens are never evicted).
    budget: fraction of each sequence's tokens a stream keeps (of the tokens seen so
        far; ignored by ``fastgen``, whose per-head policies imply their own sizes).
    budget_tokens: absolute tokens per stream instead of ``budget`` (memory stays flat
        while decoding); null = use ``budget``.
    sliding_budget: the fraction of its window a stream of a sliding-window layer keeps
        (Gemma 2/3's local layers, Mistral's windowed ones), instead of ``budget`` there (null:
        ``budget`` on every layer, as a share of what each layer can see). A local layer never holds
        more than its window (the model's own cache keeps W - 1 tokens there), so its budget is a share
        of the window either way; this sets that share apart from the global layers'. With
        ``budget: 1.0`` the policy evicts only on the local layers: on Gemma-3-270M at 2K tokens H2O
        keeping half of each 512-token window cost +3.41% perplexity over 16 windows (the 15 local layers
        are 56% of the model's 16-bit cache); on the 8 of them where that was +1.90%, keeping 75% on the 3
        global layers alone cost +4.35%. On a
        model without sliding-window layers it changes nothing; the other layers keep what ``budget``
        (or ``budget_tokens``) and ``layer_budgets`` give them. Not with the policies that set their
        own layer budgets (cake, pyramidinfer), nor fastgen (no budget).
    interval: tokens a stream may gain past its budget before it is cut back to it: the
        policy runs once per ``interval`` decode steps, not at every step, and a stream
        holds at most budget + interval - 1 tokens (16 = one float block; 1 = evict at
        every step, as the papers describe). Prefill always evicts down to the budget.
    sink_tokens: first tokens of a sequence always kept (attention sinks; FastGen's
        special tokens include them).
    window: most recent tokens always kept (SnapKV's observation window: its queries score the
        older tokens; see ``window_share`` for small budgets).
    window_share: for the policies whose window's queries score the other tokens (snapkv, rocketkv,
        chunkkv), the largest fraction of a stream's budget the window may take (null = always
        ``window``): the window is min(window, max(1, floor(window_share x budget))), budget = the
        recipe's ``budget`` x the tokens the layer can see, or ``budget_tokens``. SnapKV's 32-token
        window was made for budgets of 1024+ tokens (3% of them); at a 64-token budget it would take
        half, filled by the filler before the question, and its queries (mostly that filler) would
        score the older tokens. 0.125: an 8-token window at a 64-token budget, as KVCache-Factory
        runs SnapKV / PyramidKV / H2O / AdaKV at budgets of 64-2048 tokens; unchanged (32) from
        budgets of 256 tokens up. Only multi-token forwards (prefill) use the smaller window: a decode step
        scores by attention summed over every query, which favours old tokens, and keeps the whole
        ``window`` (H2O's recency guard).
    pooling: the 1-D pooling kernel over token scores of snapkv, rocketkv and cake (odd; 1 = none).
    pooling_mode: how ``pooling`` pools: ``max`` (SnapKV: a token takes the best score among its
        neighbours, so the whole of a multi-token span around a peak survives, a pass key's digits),
        ``mean`` (CAKE's paper: the average, which spreads a peak over the kernel and lowers it) or
        ``auto`` (each policy's paper: mean for ``cake``, max for ``snapkv`` and ``rocketkv``).
    chunk_size, reuse_layers: ChunkKV's chunk of consecutive positions kept whole, and the
        number of adjacent layers sharing one chunk selection (1 = every layer its own;
        > 1 needs uniform layer budgets).
    head_budgets: ``uniform`` (every KV head of a layer the same budget) or ``adaptive``
        (AdaKV: the layer's budget shared among its KV heads by score, each head keeping at
        least ``head_floor`` of its uniform share); score-based policies only.
    layer_budgets: ``uniform`` (every layer the same budget), ``pyramid`` (PyramidKV:
        linear from (1+pyramid_slope) x mean at the bottom to (1-pyramid_slope) x mean at
        the top) or ``profile`` (per-layer weights fitted by `kvtool profile`); the mean
        budget is the same in all three.
    threshold, local_ratio, frequent_ratio: FastGen's attention-mass threshold T and
        the local-window and heavy-hitter ratios r_l, r_f (fractions of the length).
    profile_source: where FastGen's per-KV-head policies come from: ``offline`` (one policy
        map for every prompt, measured on calibration text by `kvtool profile`) or ``prompt``
        (the paper's mode: chosen at each sequence's prefill from that prompt's own attention,
        the last ``window`` prompt queries; no profile needed). FastGen only.
    tau1, tau2, gamma: CAKE's temperatures of a layer's preference H^(1/tau1) x V^(1/tau2)
        (H: entropy of the window's attention, V: its variance over the window queries) and
        the weight of the variance in a token's score mean + gamma x variance (paper: 1, 1, 200).
    retention_decay, distance_weight: PyramidInfer's depth schedule (layer l keeps r_l of
        what layer l-1 kept, r_l falling along a cosine from 1 at the bottom to
        retention_decay at the top; rescaled so the mean budget is ``budget``) and the weight of
        the newest window query relative to the oldest (linear in between; paper: 0.9, 1.2).
    compute_kept_only: PyramidInfer only: at the first prefill each layer computes only the prompt
        tokens the layer below kept (the paper's prefill saving: fewer rows through the deeper
        layers' projections, attention and MLP; `kvtool.runtime.prefill_shrink`). The logits at
        dropped prompt positions are then not the full model's; the last token's are.
    """

    policy: str = "none"
    budget: float = 0.5
    budget_tokens: int | None = None
    sliding_budget: float | None = None
    interval: int = 16
    sink_tokens: int = 4
    window: int = 32
    window_share: float | None = 0.125
    pooling: int = 7
    pooling_mode: str = "auto"
    chunk_size: int = 10
    reuse_layers: int = 1
    head_budgets: str = "uniform"
    head_floor: float = 0.2
    layer_budgets: str = "uniform"
    pyramid_slope: float = 0.5
    threshold: float = 0.95
    local_ratio: float = 0.3
    frequent_ratio: float = 0.3
    profile_source: str = "offline"
    tau1: float = 1.0
    tau2: float = 1.0
    gamma: float = 200.0
    retention_decay: float = 0.9
    distance_weight: float = 1.2
    compute_kept_only: bool = False

    @property
    def pools_by_mean(self) -> bool:
        """True when ``pooling`` averages token scores: ``pooling_mode: mean``, or ``auto`` for cake (its paper)."""
        return self.pooling_mode == "mean" or (self.pooling_mode == "auto" and self.policy == "cake")

    def __post_init__(self) -> None:
        p = "eviction"
        _require(self.policy in EVICTION_POLICIES, f"{p}.policy", f"'{self.policy}' is not one of {list(EVICTION_POLICIES)}")
        _require(_is_fraction(self.budget), f"{p}.budget", f"{self.budget} must be a fraction in (0, 1] (0.5 keeps half)")
        _require(
            self.budget_tokens is None or (_is_int(self.budget_tokens) and self.budget_tokens >= 1),
            f"{p}.budget_tokens", f"{self.budget_tokens} must be a token count >= 1 (or null to use eviction.budget)",
        )
        _require(self.sliding_budget is None or _is_fraction(self.sliding_budget), f"{p}.sliding_budget",
                 f"{self.sliding_budget} must be a fraction in (0, 1] of a sliding-window layer's window (or null: use eviction.budget)")
        _require(self.sliding_budget is None or self.policy not in OWN_LAYER_BUDGETS + ("fastgen", "none"), f"{p}.sliding_budget",
                 f"policy '{self.policy}' " + ("has no budget" if self.policy in ("fastgen", "none") else "sets each layer's budget itself")
                 + "; drop sliding_budget")
        _require(self.sliding_budget is None or self.reuse_layers == 1, f"{p}.sliding_budget",
                 "ChunkKV's layers share one selection with reuse_layers > 1, but sliding_budget gives the sliding and the "
                 "other layers different budgets; set reuse_layers: 1")
        _require(_is_int(self.interval) and self.interval >= 1, f"{p}.interval",
                 f"{self.interval} must be an integer >= 1 (1 = evict at every decode step; 16 = once per float block)")
        _require(_is_int(self.sink_tokens) and self.sink_tokens >= 0, f"{p}.sink_tokens", "must be an integer >= 0")
        _require(_is_int(self.window) and self.window >= 1, f"{p}.window", "must be an integer >= 1")
        _require(self.window_share is None or _is_fraction(self.window_share), f"{p}.window_share",
                 f"{self.window_share} must be a fraction in (0, 1] of a stream's budget (or null: always eviction.window)")
        _require(_is_int(self.pooling) and self.pooling >= 1 and self.pooling % 2 == 1, f"{p}.pooling",
                 f"{self.pooling} must be an odd integer >= 1 (SnapKV uses 5-7)")
        _require(self.pooling_mode in POOLING_MODES, f"{p}.pooling_mode",
                 f"'{self.pooling_mode}' is not one of {list(POOLING_MODES)}")
        _require(_is_int(self.chunk_size) and self.chunk_size >= 1, f"{p}.chunk_size",
                 f"{self.chunk_size} must be an integer >= 1 (ChunkKV uses 10)")
        _require(_is_int(self.reuse_layers) and self.reuse_layers >= 1, f"{p}.reuse_layers",
                 f"{self.reuse_layers} must be an integer >= 1 (1 = no index reuse)")
        _require(self.reuse_layers == 1 or (self.policy == "chunkkv" and self.layer_budgets == "uniform"), f"{p}.reuse_layers",
                 "index reuse across layers needs policy chunkkv with layer_budgets uniform (set reuse_layers: 1)")
        _require(self.head_budgets in HEAD_BUDGETS, f"{p}.head_budgets",
                 f"'{self.head_budgets}' is not one of {list(HEAD_BUDGETS)}")
        _require(self.head_budgets == "uniform" or self.policy in ATTENTION_SCORED, f"{p}.head_budgets",
                 f"'adaptive' shares a budget by attention score; policy '{self.policy}' has none comparable across heads "
                 f"(use one of {list(ATTENTION_SCORED)} or head_budgets: uniform)")
        _require(_is_fraction(self.head_floor, low_open=False), f"{p}.head_floor",
                 f"{self.head_floor} must be a fraction in [0, 1] (AdaKV uses 0.2)")
        _require(self.layer_budgets in LAYER_BUDGETS, f"{p}.layer_budgets",
                 f"'{self.layer_budgets}' is not one of {list(LAYER_BUDGETS)}")
        _require(_is_fraction(self.pyramid_slope, low_open=False) and self.pyramid_slope < 1, f"{p}.pyramid_slope",
                 f"{self.pyramid_slope} must be in [0, 1) (0 = uniform)")
        _require(_is_fraction(self.threshold), f"{p}.threshold", f"{self.threshold} must be a fraction in (0, 1]")
        for name in ("local_ratio", "frequent_ratio"):
            _require(_is_fraction(getattr(self, name), low_open=False), f"{p}.{name}", "must be a fraction in [0, 1]")
        _require(self.profile_source in FASTGEN_PROFILE_SOURCES, f"{p}.profile_source",
                 f"'{self.profile_source}' is not one of {list(FASTGEN_PROFILE_SOURCES)} (offline: `kvtool profile`; "
                 "prompt: chosen from each prompt's attention)")
        _require(self.profile_source == "offline" or self.policy == "fastgen", f"{p}.profile_source",
                 f"'{self.profile_source}' chooses FastGen head policies, but the policy is '{self.policy}'; "
                 "set policy: fastgen or drop profile_source")
        if self.budget_tokens is not None:
            _require(self.budget_tokens > self.sink_tokens, f"{p}.budget_tokens",
                     f"{self.budget_tokens} leaves no room beside the {self.sink_tokens} sink tokens")
        self._check_layer_policies()

    def _check_layer_policies(self) -> None:
        """CAKE's and PyramidInfer's fields: valid numbers, and layer budgets left to the policy."""
        p = "eviction"
        for name in ("tau1", "tau2"):
            value = getattr(self, name)
            _require(_is_number(value) and value > 0, f"{p}.{name}",
                     f"{value} must be a positive number (a CAKE temperature; the paper uses 1.0)")
        _require(_is_number(self.gamma) and self.gamma >= 0, f"{p}.gamma",
                 f"{self.gamma} must be a number >= 0 (CAKE's weight of the attention variance; the paper uses 200)")
        _require(_is_fraction(self.retention_decay), f"{p}.retention_decay",
                 f"{self.retention_decay} must be a fraction in (0, 1] (PyramidInfer uses 0.9; 1 = the same budget in every layer)")
        _require(_is_number(self.distance_weight) and self.distance_weight >= 1, f"{p}.distance_weight",
                 f"{self.distance_weight} must be a number >= 1 (1 = every window query alike; PyramidInfer uses 1.2)")
        _require(isinstance(self.compute_kept_only, bool), f"{p}.compute_kept_only", "must be true or false")
        _require(not self.compute_kept_only or self.policy == "pyramidinfer", f"{p}.compute_kept_only",
                 f"only PyramidInfer nests each layer's kept set in the layer below's (policy '{self.policy}' does not), "
                 "so only it can skip the dropped tokens' computation; set compute_kept_only: false")
        if self.policy in OWN_LAYER_BUDGETS:
            own = "preferences measured at prefill" if self.policy == "cake" else "retention_decay"
            _require(self.layer_budgets == "uniform", f"{p}.layer_budgets",
                     f"policy {self.policy} sets each layer's budget itself (from {own}); set layer_budgets: uniform")
        if self.policy == "cake":
            _require(self.window >= 2, f"{p}.window",
                     f"CAKE measures the variance of attention over the window's queries: {self.window} query has none; "
                     "use window >= 2 (the paper uses 32)")

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    @property
    def needs_profile(self) -> bool:
        """Offline FastGen policies and fitted layer budgets come from `kvtool profile`."""
        return self.enabled and (self.fastgen_offline or self.layer_budgets == "profile")

    @property
    def fastgen_offline(self) -> bool:
        """FastGen with one profiled policy map for every prompt."""
        return self.policy == "fastgen" and self.profile_source == "offline"

    @property
    def fastgen_per_prompt(self) -> bool:
        """FastGen choosing each (sequence, KV head)'s policy from the prompt's attention at prefill."""
        return self.policy == "fastgen" and self.profile_source == "prompt"


@dataclass(frozen=True)
class SparseAttentionSpec:
    """Which stored tokens a decode step reads (attention over a subset; nothing is freed).

    method: ``none`` reads every token; ``rocketkv`` is RocketKV's stage 2 (hybrid sparse
        attention): every ``summary_tokens`` consecutive slots of a float block keep the
        per-channel max and min of their keys beside the block; a decode step scores every
        group from them with the query's largest ``channels`` fraction of channels (head- and
        sequence-dimension reduction) and attends exactly to the best-scored groups only.
    read_fraction: fraction of a stream's tokens a decode step reads at most (0.25 reads a quarter,
        rounded down to whole summary groups).
    summary_tokens: tokens per key summary (1, 2, 4, 8 or 16); the paper uses
        ceil(sqrt(1 / read_fraction)), 2 at a quarter. Smaller is more precise and costs more
        memory: the summaries take 2 / summary_tokens of the key bytes, except 1, where the keys are
        their own summaries (no memory; the selection reads as many key bytes as 2-token max/min
        summaries at the same ``channels``).
    channels: fraction of the head dimension used for the approximate scores (1 = all; the
        paper uses summary_tokens x read_fraction).
    min_tokens: tokens a step reads at least (a short cache is read whole).
    unread: what the tokens a step does not read contribute. ``drop`` (the paper): nothing, the
        softmax is over the read tokens only. ``estimate`` (kvtool's extension, one-token summaries
        only): one softmax term stands for them, its logit from the partial logits the selection
        already computed (completed by the mean unread key), its value their values' mean, from
        per-block key and value sums the store keeps (1/16 of the float bytes), so the attention
        the unread tokens receive is not lost (`kvtool.methods.sparse.rocketkv.unread_term`).
        ``estimate_blocks`` (kvtool's extension, one-token summaries only): the same term, estimated
        per 16-slot float block: each unread token's partial logit is completed by its block's mean
        key and each block's share of the unread mass takes the block's mean value, from the same
        sums, with nothing subtracted for what the step read (`unread_blocks_term`).
    read_budget: how a step's reads are shared. ``per_head`` (the paper): each KV head's stream reads
        ``read_fraction`` of what it holds. ``shared`` (kvtool's extension, AdaKV-style): the KV heads
        of one sequence in a layer share one budget (``read_fraction`` of what they hold together),
        given to the tokens with the largest approximate attention across them, so a sharp head
        leaves reads to a broad one; ``min_tokens`` still holds per head.
    channel_score: how the ``channels`` scored are chosen. ``query`` (the paper): the largest mean |q|
        over the GQA group's rows. ``query_key`` (kvtool's extension): the largest mean |q| x the
        spread (standard deviation) of the held keys per channel, from per-block key sums and
        squared-key sums the store then keeps: a channel whose keys hardly vary says little about
        which token to read, whatever the query (Gemma 3's normed 256-dim heads).
    """

    method: str = "none"
    read_fraction: float = 0.25
    summary_tokens: int = 2
    channels: float = 0.5
    min_tokens: int = 64
    unread: str = "drop"
    channel_score: str = "query"
    read_budget: str = "per_head"

    def __post_init__(self) -> None:
        p = "sparse_attention"
        _require(self.method in SPARSE_METHODS, f"{p}.method", f"'{self.method}' is not one of {list(SPARSE_METHODS)}")
        _require(_is_fraction(self.read_fraction), f"{p}.read_fraction",
                 f"{self.read_fraction} must be a fraction in (0, 1] (0.25 reads a quarter of the tokens per step)")
        _require(self.summary_tokens in (1, 2, 4, 8, 16), f"{p}.summary_tokens",
                 f"{self.summary_tokens} must be 1, 2, 4, 8 or 16 (tokens per key summary within a float block)")
        _require(_is_fraction(self.channels), f"{p}.channels",
                 f"{self.channels} must be a fraction in (0, 1] of the head dimension (1 = every channel)")
        _require(_is_int(self.min_tokens) and self.min_tokens >= 1, f"{p}.min_tokens",
                 f"{self.min_tokens} must be an integer >= 1")
        _require(self.unread in UNREAD_RULES, f"{p}.unread", f"'{self.unread}' is not one of {list(UNREAD_RULES)}")
        _require(self.channel_score in CHANNEL_SCORES, f"{p}.channel_score",
                 f"'{self.channel_score}' is not one of {list(CHANNEL_SCORES)}")
        _require(self.read_budget in READ_BUDGETS, f"{p}.read_budget",
                 f"'{self.read_budget}' is not one of {list(READ_BUDGETS)}")
        _require(self.unread == "drop" or self.summary_tokens == 1, f"{p}.unread",
                 f"'{self.unread}' needs summary_tokens: 1 (the keys themselves: max/min summaries of {self.summary_tokens} "
                 "tokens bound the logits from above and cannot estimate the mass of what is not read); "
                 "set summary_tokens: 1 or unread: drop")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class CalibrationSpec:
    """How much calibration text to use (windows of ``seq_len`` tokens)."""

    samples: int = 8
    seq_len: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        _require(_is_int(self.samples) and self.samples >= 1, "calibration.samples", "must be an integer >= 1")
        _require(_is_int(self.seq_len) and self.seq_len >= 2, "calibration.seq_len", "must be an integer >= 2")
        _require(_is_int(self.seed), "calibration.seed", "must be an integer")


def _fit_ignores_bits(spec: QuantSpec) -> bool:
    """True when what calibration fits for ``spec`` does not depend on its bits (turboquant's channel_scale and
    calibrated outlier channels come from mean squares alone), so layers may store it at other widths
    (``layer_overrides`` of ``bits``)."""
    return spec.method == "turboquant" and (spec.channel_scale != "none" or spec.outlier_channels != "block")


@dataclass(frozen=True)
class Recipe:
    """A complete, validated compression recipe."""

    name: str = "kivi-4bit"
    description: str = ""
    keys: QuantSpec = field(default_factory=lambda: QuantSpec(axis="channel", path="keys"))
    values: QuantSpec = field(default_factory=lambda: QuantSpec(axis="token", path="values"))
    cache: CacheSpec = field(default_factory=CacheSpec)
    eviction: EvictionSpec = field(default_factory=EvictionSpec)
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)
    sparse_attention: SparseAttentionSpec = field(default_factory=SparseAttentionSpec)
    layer_overrides: tuple[LayerOverride, ...] = ()  # per-layer keys/values fields (`kvtool.recipe_layers`)

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name.strip() != "", "name", "must be a non-empty string")
        if self.layer_overrides:
            self._check_overrides()
        if self.cache.block_size < 32:  # an override's layers are checked as their own recipe (`_check_overrides`)
            word_packed = sorted({spec.method for spec in (self.keys, self.values) if spec.method not in SMALL_BLOCK_METHODS})
            _require(not word_packed, "cache.block_size",
                     f"{self.cache.block_size} needs every quantized side to be {' or '.join(SMALL_BLOCK_METHODS)} (their "
                     f"codes are read as bytes), but the recipe has {', '.join(word_packed)}, whose codes are read as "
                     "32-bit words of 32 tokens; use block_size: 32 or more")
        if self.sparse_attention.enabled:
            _require(self.sparse_attention.summary_tokens <= self.cache.float_block_size, "sparse_attention.summary_tokens",
                     f"{self.sparse_attention.summary_tokens} tokens per key summary do not fit a float block of "
                     f"{self.cache.float_block_size} (cache.float_block_size); use summary_tokens <= float_block_size")
            p = "sparse_attention.method"
            _require(not (self.quantizes or self.keys.pre_rope), p,
                     "sparse attention reads float blocks only: use keys/values method none (quantized bodies "
                     "keep no key summaries yet), or sparse_attention.method: none")
            _require(self.eviction.policy in DECODE_UNSCORED, p,
                     f"eviction policy '{self.eviction.policy}' scores tokens by the attention of every decode step, which "
                     f"a step reading only some blocks cannot give; use one of {list(DECODE_UNSCORED)}")

    def _check_overrides(self) -> None:
        """Every override resolves to a valid recipe, and nothing in the recipe is fitted per layer."""
        fitted = [
            f"{part}.method {spec.method}"
            for part, spec in (("keys", self.keys), ("values", self.values))
            if spec.learns_from_data and not _fit_ignores_bits(spec)
        ] if any(o.changes_storage for o in self.layer_overrides) else []  # eviction-only entries store nothing else
        _require(not fitted, "layer_overrides",
                 f"per-layer overrides need methods that learn nothing from calibration (uniform, fp8 with granularity "
                 f"block, turboquant, none), but the recipe has {', '.join(fitted)}, fitted per layer for one spec; "
                 "remove layer_overrides or use one of those methods")
        listed = [i for o in self.layer_overrides for i in o.layers]
        _require(len(listed) == len(set(listed)) and min(listed, default=0) >= 0, "layer_overrides",
                 "every layer index must be >= 0 and appear in one entry only")
        for n, override in enumerate(self.layer_overrides):
            for part in ("keys", "values"):
                base = getattr(self, part)
                if _fit_ignores_bits(base):  # turboquant's channel fits: one fit serves every width
                    changed = sorted(name for name, value in override.fields(part).items() if getattr(base, name) != value)
                    fitted = " and ".join(f"{name}: {getattr(base, name)}" for name, default in
                                          (("channel_scale", "none"), ("outlier_channels", "block"))
                                          if getattr(base, name) != default)
                    _require(changed in ([], ["bits"]), f"layer_overrides[{n}].{part}",
                             f"{part} with {fitted} are fitted once for every layer, so an "
                             f"override may change only their bits, not {', '.join(c for c in changed if c != 'bits')}")
            _require(not override.eviction or self.eviction.sliding_budget is not None, f"layer_overrides[{n}].eviction",
                     "sets some sliding-window layers' share of their window, but the recipe has no "
                     "eviction.sliding_budget (the share the other sliding-window layers keep); set it, with a policy that "
                     "takes it (streamingllm, h2o, snapkv, ...)")
            try:
                layer = self.for_override(override)
            except RecipeError as exc:
                raise RecipeError(str(exc).replace("recipe field '", f"recipe field 'layer_overrides[{n}].", 1)) from None
            for part in ("keys", "values") if override.changes_storage else ():
                spec = getattr(layer, part)
                if _fit_ignores_bits(getattr(self, part)):  # its bits alone differ (checked above)
                    continue
                _require(not spec.learns_from_data, f"layer_overrides[{n}].{part}.method",
                         f"'{spec.method}' (granularity {spec.granularity}) learns from calibration data; per-layer "
                         "overrides take uniform, fp8 with granularity block, turboquant or none")

    def for_override(self, override: LayerOverride) -> "Recipe":
        """The recipe an override's layers store with (whichever layers it names), no overrides left."""
        keys = dataclasses.replace(self.keys, **override.fields("keys"))
        values = dataclasses.replace(self.values, **override.fields("values"))
        eviction = dataclasses.replace(self.eviction, **override.fields("eviction"))
        return dataclasses.replace(self, keys=keys, values=values, eviction=eviction, layer_overrides=())

    def for_layer(self, index: int) -> "Recipe":
        """The recipe layer ``index`` stores with: its override applied, no overrides left (``self`` when none)."""
        if not self.layer_overrides:
            return self
        unresolved = [o.kind for o in self.layer_overrides if o.kind is not None]
        if unresolved:  # a caller skipped `resolve_layer_kinds`: applying nothing would store other bits than promised
            raise RecipeError(f"recipe '{self.name}': layer_overrides name the {' and '.join(unresolved)} layers, which "
                              "only the model can tell; resolve them first (kvtool.recipe_layers.resolve_layer_kinds)")
        for override in self.layer_overrides:
            if index in override.layers:
                return self.for_override(override)
        return dataclasses.replace(self, layer_overrides=())

    @property
    def is_noop(self) -> bool:
        """True when nothing is compressed (both tensors stored as floats)."""
        return self.keys.method == "none" and self.values.method == "none" and not self.eviction.enabled

    @property
    def quantizes(self) -> bool:
        """True when keys or values are stored in a compressed body (any method but ``none``)."""
        return self.keys.method != "none" or self.values.method != "none"

    @property
    def evicts(self) -> bool:
        """True when tokens are dropped (an eviction policy other than ``none``)."""
        return self.eviction.enabled

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-able dict (the form stored in artifact manifests)."""
        out = dataclasses.asdict(self)
        for part in ("keys", "values"):
            out[part].pop("path", None)
        out.pop("layer_overrides")
        if self.layer_overrides:  # absent when empty: recipes without overrides keep their old form
            out["layer_overrides"] = [o.to_dict() for o in self.layer_overrides]
        return out

    def with_bits(self, bits: int) -> "Recipe":
        """Same recipe at another code width for keys and values (16 = no compression), every layer (no overrides)."""

        def change(spec: QuantSpec) -> QuantSpec:
            if bits == 16:
                return dataclasses.replace(spec, method="none", bits=16, outlier_fraction=0.0, qnorm=False,
                                           granularity=None, scale_fit="amax", fp8_format="e4m3", extra_bits=0.0,
                                           outlier_channel_fraction=0.0, qjl=False, norm_bits=16,
                                           outlier_channels="block")
            return dataclasses.replace(spec, method="uniform" if spec.method == "none" else spec.method, bits=bits)

        return dataclasses.replace(self, name=f"{self.name}@{bits}bit", keys=change(self.keys), values=change(self.values),
                                   layer_overrides=())


_SECTIONS = {
    "keys": QuantSpec, "values": QuantSpec, "cache": CacheSpec, "eviction": EvictionSpec, "calibration": CalibrationSpec,
    "sparse_attention": SparseAttentionSpec,
}
_TOP_LEVEL = {"name", "description", "layer_overrides", *_SECTIONS}


def _allowed(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.name != "path"}


def _build_section(name: str, cls: type, raw: Any) -> Any:
    kwargs = dict(raw)
    if cls is QuantSpec:
        kwargs.setdefault("axis", "channel" if name == "keys" else "token")
        kwargs["path"] = name
        if kwargs.get("method") == "none":
            kwargs.setdefault("bits", 16)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - guarded by the unknown-key check
        raise RecipeError(f"recipe section '{name}': {exc}") from exc


def _check_fields(raw: dict) -> None:
    """RecipeError naming every unknown field, top level and per section, with close matches."""
    for name in _SECTIONS:
        if name in raw and not isinstance(raw[name], dict):
            raise RecipeError(f"recipe field '{name}': expected a mapping, got {type(raw[name]).__name__}")
    places = [("", _TOP_LEVEL, raw)] + [(f"{name}.", _allowed(cls), raw[name]) for name, cls in _SECTIONS.items() if name in raw]
    unknown = [(prefix, key, allowed) for prefix, allowed, fields in places for key in sorted(map(str, set(fields) - allowed))]
    if not unknown:
        return
    named = [f"'{prefix}{key}'{_close_match(key, allowed)}" for prefix, key, allowed in unknown]
    where = {prefix: allowed for prefix, _, allowed in unknown}
    hints = "; ".join(f"allowed {'top-level fields' if not prefix else 'in ' + prefix[:-1]}: {sorted(allowed)}"
                      for prefix, allowed in where.items())
    if len(named) == 1:
        raise RecipeError(f"recipe field {named[0]} is unknown; {hints}")
    raise RecipeError(f"recipe fields {', '.join(named[:-1])} and {named[-1]} are unknown; {hints}")


def _close_match(key: str, allowed: set[str]) -> str:
    import difflib

    match = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def recipe_from_dict(raw: Any) -> Recipe:
    """Validate a plain dict (from YAML or a manifest) into a `Recipe`."""
    if not isinstance(raw, dict):
        raise RecipeError(f"a recipe must be a mapping at the top level, got {type(raw).__name__}")
    _check_fields(raw)
    kwargs: dict[str, Any] = {k: raw[k] for k in ("name", "description") if k in raw}
    for name, cls in _SECTIONS.items():
        if name in raw:
            kwargs[name] = _build_section(name, cls, raw[name])
    if raw.get("layer_overrides") is not None:
        kwargs["layer_overrides"] = parse_overrides(raw["layer_overrides"])
    return Recipe(**kwargs)


def load_recipe(source: str | Path | None) -> Recipe:
    """Load a recipe from a YAML path or the name of a bundled recipe (``recipes/NAME.yaml``).

    ``None`` gives the default recipe (4-bit KIVI-style uniform quantization).
    """
    import yaml

    if source is None:
        return Recipe()
    path = Path(source)
    if not path.exists():
        bundled = bundled_recipe_dir() / f"{source}.yaml"
        if not bundled.exists():
            names = ", ".join(sorted(p.stem for p in bundled_recipe_dir().glob("*.yaml")))
            raise RecipeError(f"recipe '{source}' not found: give a YAML path or one of the bundled recipes: {names}")
        path = bundled
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise RecipeError(f"recipe file '{path}' is not valid YAML text: {exc}") from exc
    except OSError as exc:
        raise RecipeError(f"cannot read recipe file '{path}': {exc}") from exc
    try:
        return recipe_from_dict(raw)
    except RecipeError as exc:
        raise RecipeError(f"{exc} (in {path})") from None


def bundled_recipe_dir() -> Path:
    """Folder of the recipes shipped with kvtool (repository ``recipes/`` or the installed copy)."""
    here = Path(__file__).resolve().parent
    installed = here / "recipes"
    return installed if installed.exists() else here.parent / "recipes"


def dump_recipe(recipe: Recipe) -> str:
    """YAML text of a recipe (round-trips through `recipe_from_dict`)."""
    import yaml

    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)
