"""What the decode kernel needs to know about one side (keys or values) of the body blocks.

A body element is read in steps, each chosen by one field (constants for the kernel):

1. **codes** of one block: float data (``bits == 16``, method none), one fp8 byte per element
   (``fp8``: e4m3 / e5m2 bit patterns, method fp8) or ``bits``-bit integer codes, bit-sliced
   and token-split (`kvtool.methods.quant.packing`: uniform, int_static, nuq);
2. **lookup**: ``levels > 0`` (nuq): the code indexes a per-layer codebook of ``levels`` floats;
3. **scale** (``scales``): ``x = value * scale (+ zero)`` with the scale and zero from

   * ``"channel"``: the block, fp16 (D,) each (uniform keys);
   * ``"token"``: the block, fp16 (BS, ceil(D / group)) each (uniform and nuq values, Palu latents,
     whose last group may be partial);
   * ``"block"``: the block, one float32 scale and no zero (fp8 dynamic);
   * ``"static"``: calibrated tables beside the store, rows 1 or H_kv (per layer or per KV
     head), columns 1 or D (per channel): fp8 static (no zero), int_static, nuq channel axis;
   * ``"norm"``: the block, one fp16 per token and no zero (TurboQuant's per-token norm);
   * ``"norm8"``: the same norm as an 8-bit log code per token, (BS + 4,) uint8 per block: BS codes c
     then the block's log2 range hi, lo as int16 in 1/1024 octave, read as
     ``2 ** ((hi - c (hi - lo) / 255) / 1024)`` (TurboQuant's ``norm_bits: 8``);
   * ``"none"``: float data;

4. **outliers** (``outliers > 0``, nuq): that many (int16 flat index, fp16 value) pairs per
   block replace the dense value at their positions;
5. **domain**: ``rank > 0`` (Palu): steps 1-3 read a low-rank latent of ``rank`` coordinates per
   token (the block is (BS, rank), not (BS, D)), reconstructed in registers as
   ``latent @ recon[head] + recon_bias[head]`` (`body_lowrank.py`); ``rotated`` (TurboQuant): the
   vector read is ``P x`` for an orthogonal ``P`` (``rotation`` (D, D)), so the kernel scores it
   against the rotated query and sums values in the rotated domain (`body_rotated.py`); ``split > 0``
   (TurboQuant's outlier split): steps 1-3 read two instances per block, ``split`` outlier
   channels at ``split_bits`` and the rest at ``bits``, each rebuilt in head space through the
   block's channel mask (or, with ``static_mask``, its KV head's calibrated one) and the instance's
   rotation (`body_split.py`);
6. **QJL residual** (``qjl``, TurboQuant keys only): each instance of a block also holds a 1-bit
   sketch of its residual, ``qjl_signs`` (cap, BS / 8, d) uint8 packed as 1-bit codes and
   ``residual_norm`` (cap, BS) fp16; a token's score gains
   ``||x_i|| * sqrt(pi/2) / d * ||r|| * (G_i P_i q_i) . sign`` per instance (`body_qjl.py`).

The tensors that are not in the store (static tables, codebooks, reconstruction, rotation and
QJL sketch matrices) come from the quantizer's `kernel_tensors`. Kept free of Triton imports so the methods can describe themselves on
CPU-only installs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.methods.quant.packing import slice_widths

SCALE_MODES = ("none", "channel", "token", "block", "static", "norm", "norm8")
NORM_MODES = ("norm", "norm8")  # TurboQuant's per-token norm: float16, or 8-bit log codes over the block's range
FP8_LAYOUTS = {"e4m3": (3, 7), "e5m2": (2, 15)}  # mantissa bits, exponent bias
FLOAT16, BFLOAT16, FLOAT8_E4M3, INT8_SCALED = 0, 1, 2, 3  # how the CPU kernel reads a float pool (``float_kind``)


@dataclass(frozen=True)
class BodyFormat:
    bits: int  # 16: float data (method none, any float dtype); 8 with ``fp8``; else integer codes of this many bits
    per_channel: bool  # integer codes: scales (D,) per block ("channel"), else (BS, ceil(D / group)) ("token")
    group: int  # channels per scale group (per-token scales)
    fp8: str = ""  # "e4m3" / "e5m2": codes are fp8 bit patterns, one byte per element
    scales: str = ""  # one of SCALE_MODES; "" = from bits / per_channel (none, channel or token)
    zero: bool = True  # an additive zero point beside the scale
    levels: int = 0  # > 0: codes index a codebook of this many levels (nuq)
    outliers: int = 0  # sparse outliers per block (nuq dense-and-sparse)
    rank: int = 0  # > 0: the block holds latents of this many coordinates per token, reconstructed to D (Palu)
    rotated: bool = False  # the vector read is P x, P the side's ``rotation`` (TurboQuant)
    split: int = 0  # > 0: outlier channels per block of a second instance (TurboQuant's outlier split)
    split_bits: int = 0  # code bits of that outlier instance
    qjl: bool = False  # keys: each instance also holds a 1-bit QJL sketch of its residual (TurboQuant ``qjl: true``)
    query_scale: bool = False  # keys: the codes hold k / s; the query is first multiplied by s, the side's
    # ``channel_scale`` (H_kv, D) row of its KV head (TurboQuant ``channel_scale: query``; the CPU kernel reads it)
    static_mask: bool = False  # split: the outlier channels are one mask per KV head, ``outlier_mask`` (H_kv, D / 8)
    # uint8 from the quantizer's `kernel_tensors`, read at the stream's head (TurboQuant ``outlier_channels: calibrated``)

    def __post_init__(self) -> None:
        if not self.scales:
            mode = "none" if self.bits == 16 else ("channel" if self.per_channel else "token")
            object.__setattr__(self, "scales", mode)
        if self.scales not in SCALE_MODES:
            raise ValueError(f"BodyFormat.scales: '{self.scales}' is not one of {SCALE_MODES}")
        if self.fp8 and (self.fp8 not in FP8_LAYOUTS or self.bits != 8):
            raise ValueError(f"BodyFormat.fp8: '{self.fp8}' needs bits 8 and one of {list(FP8_LAYOUTS)}")
        if self.static_mask and not self.split:
            raise ValueError("BodyFormat.static_mask: calibrated outlier channels are the split's: needs split > 0")
        if self.qjl and not (self.scales in NORM_MODES and (self.rotated or self.split)):
            raise ValueError("BodyFormat.qjl: the QJL residual is TurboQuant's: needs scales 'norm' or 'norm8' and rotated "
                             "or split")

    @property
    def uniform(self) -> bool:
        """Plain uniform (KIVI) codes: integer codes with an fp16 scale and zero per channel or per token group, and
        nothing else (no fp8, codebook, outliers, latents, rotation, split or QJL residual)."""
        return (
            self.bits < 16 and not self.fp8 and self.levels == 0 and self.outliers == 0 and self.rank == 0
            and not self.rotated and self.split == 0 and not self.qjl and self.zero and self.scales in ("channel", "token")
        )

    def widths(self, bits: int | None = None) -> tuple[int, int, int]:
        """Slice widths of the packed codes (of ``bits``, default the format's), lowest bits first, padded with 0
        (float data and fp8 -> none)."""
        bits = self.bits if bits is None else bits
        w = [] if bits == 16 or self.fp8 or bits == 0 else slice_widths(bits)
        return tuple(w + [0] * (3 - len(w)))

    def fp8_layout(self) -> tuple[int, int]:
        """(mantissa bits, exponent bias) of the fp8 codes; (0, 0) when the codes are not fp8."""
        return FP8_LAYOUTS.get(self.fp8, (0, 0))

    def scale_mode(self) -> int:
        """``scales`` as the kernel's constant: its index in SCALE_MODES."""
        return SCALE_MODES.index(self.scales)
