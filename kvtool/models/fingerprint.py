"""What a model fingerprint identifies, and how two fingerprints are compared.

A fingerprint (`ModelAdapter.fingerprint`) names a *checkpoint*, not one float encoding
of it: the same weights stored as float32, float16 or bfloat16 are the same model, a
different checkpoint is not. No exact hash can do that (float32 -> float16 -> bfloat16
rounds some weights differently than float32 -> bfloat16), so the weights are identified
by a sketch that is compared with a tolerance:

* ``kv_weights_sketch``: per K/V projection weight W (out, in), in layer order K then V,
  ``[rms(W), s_1 .. s_16]`` with ``s_j = a_j^T W b_j / sqrt(out * in)`` for fixed
  pseudo-random sign vectors a_j (out,) and b_j (in,). E[(s_j - s'_j)^2] is the mean
  square difference of W and W', so the sketch measures the RMS difference of two weights
  without storing them (Johnson-Lindenstrauss).
* Two weights are the same when their RMS difference is below `SAME_WEIGHTS_RMS` (2^-7,
  twice bfloat16's unit roundoff) of their RMS: rounding to any 16-bit float moves a
  weight by at most 2^-8 of its value (about 0.2% RMS); independently trained or
  fine-tuned checkpoints differ by far more. A change smaller than bfloat16 rounding
  (e.g. one edited element of a large matrix) is not a different checkpoint here.
* ``kv_weights_sha256`` (SHA-256 of the weights rounded to bfloat16) stays in the
  fingerprint for display and for artifacts written before the sketch existed: those are
  compared exactly, as they were when written.
"""

from __future__ import annotations

import json
import math
from typing import Iterable

import torch
from torch import Tensor

SKETCH_PROJECTIONS = 16
SAME_WEIGHTS_RMS = 2.0**-7  # relative RMS difference still counted as "the same weights"
WEIGHT_KEYS = ("kv_weights_sha256", "kv_weights_sketch")
_MISSING = object()  # marks a field absent from one fingerprint
_MASK32 = 0xFFFFFFFF


def kv_weights_sketch(weights: Iterable[Tensor]) -> list[list[float]]:
    """``[rms, s_1 .. s_16]`` per weight (see the module docstring), JSON-able, 8 significant digits."""
    return [[float(f"{value:.8g}") for value in _sketch(w)] for w in weights]


def _sketch(weight: Tensor) -> list[float]:
    w = weight.detach().to(device="cpu", dtype=torch.float64).reshape(weight.shape[0], -1)  # (out, in)
    n = w.numel()
    rows, cols = _signs(w.shape[0], salt=1), _signs(w.shape[1], salt=2)  # (out, K), (in, K)
    projections = (rows * (w @ cols)).sum(dim=0) / math.sqrt(n)  # (K,)
    rms = w.square().mean().sqrt()
    return [float(rms), *projections.tolist()]


def _signs(n: int, salt: int) -> Tensor:
    """(n, K) float64 of +-1 from a 32-bit integer hash (murmur3's finalizer) of (index, projection, salt)."""
    x = torch.arange(n, dtype=torch.int64)[:, None] * SKETCH_PROJECTIONS + torch.arange(SKETCH_PROJECTIONS)
    x = (x + salt * 0x9E3779B9) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    x = x ^ (x >> 16)
    return 1.0 - 2.0 * (x & 1).to(torch.float64)


def weights_difference(expected: list, actual: list) -> tuple[float, int]:
    """(largest relative RMS difference over the weights, index of that weight) of two sketches."""
    worst, where = 0.0, 0
    for index, (want, have) in enumerate(zip(expected, actual)):
        scale = max(abs(want[0]), abs(have[0]), 1e-30)
        squares = [(a - b) ** 2 for a, b in zip(want[1:], have[1:])]
        difference = max(math.sqrt(sum(squares) / len(squares)), abs(want[0] - have[0])) / scale
        if difference > worst:
            worst, where = difference, index
    return worst, where


def compare_fingerprints(expected: dict, actual: dict) -> list[str]:
    """Lines naming each field where `expected` (the artifact) and `actual` (the model) differ; [] if equal.

    Geometry fields must be equal; the K/V weights must be the same up to float rounding
    (sketch), or, for an artifact without a sketch, have the same bfloat16 hash.
    """
    lines = []
    for key in sorted((set(expected) | set(actual)) - set(WEIGHT_KEYS)):
        want, have = expected.get(key, _MISSING), actual.get(key, _MISSING)
        if want is _MISSING or have is _MISSING or _json_copy(want) != _json_copy(have):
            lines.append(f"{key}: artifact has {_show(want)}, model has {_show(have)}")
    return lines + _weights_mismatch(expected, actual)


def _weights_mismatch(expected: dict, actual: dict) -> list[str]:
    want, have = expected.get("kv_weights_sketch"), actual.get("kv_weights_sketch")
    if want is not None and have is not None:
        if len(want) != len(have):
            return [f"kv_weights: artifact has {len(want)} K/V projection weights, model has {len(have)}"]
        worst, where = weights_difference(want, have)
        if worst <= SAME_WEIGHTS_RMS:
            return []
        layer, part = divmod(where, 2)
        return [f"kv_weights: the K/V projection weights differ (layer {layer} {('keys', 'values')[part]}: "
                f"{100 * worst:.1f}% RMS difference; the same checkpoint in another float dtype differs by "
                f"< {100 * SAME_WEIGHTS_RMS:.1f}%)"]
    want_hash, have_hash = expected.get("kv_weights_sha256", _MISSING), actual.get("kv_weights_sha256", _MISSING)
    if want_hash is not _MISSING and want_hash == have_hash:
        return []
    line = f"kv_weights_sha256: artifact has {_show(want_hash)}, model has {_show(have_hash)}"
    if want is None and have is not None and want_hash is not _MISSING:
        line += (" (the artifact was written by an older kvtool that hashed the bfloat16-rounded K/V weights "
                 "exactly, so a copy of the same checkpoint in another float dtype hashes differently: use the "
                 "checkpoint file it was made with, or calibrate and export again with this kvtool)")
    return [line]


def _json_copy(value):
    """A JSON round-trip copy (tuples become lists, keys become strings)."""
    return json.loads(json.dumps(value, default=str))


def _show(value) -> str:
    """A value for a mismatch message; long strings (hashes) are cut to 16 characters."""
    if value is _MISSING:
        return "(missing)"
    if isinstance(value, str) and len(value) > 16:
        return value[:16] + "..."
    return str(value)
