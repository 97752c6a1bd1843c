"""Bit-sliced, token-split packing of integer codes into bytes (the layout kernels read).

A block holds S tokens x C channels of ``b``-bit codes. ``b`` is split into *slices* of
width w in {8, 4, 2, 1}, lowest bits first (8 -> [8], 4 -> [4], 3 -> [2, 1], 2 -> [2],
1 -> [1], 5 -> [4, 1], 6 -> [4, 2], 7 -> [4, 2, 1]). A w-bit slice packs k = 8 / w codes per
byte, *token-split*: byte ``[j, c]`` of the slice (j < S / k) holds the slice's bits of
token ``j + i * S / k``, channel c, at bit ``i * w``, for i = 0 .. k-1. The slices are
stacked along the row axis:

    codes (..., S, C) uint8 in [0, 2**b)   ->   bytes (..., S * b / 8, C) uint8

so a block costs exactly ``S * C * b / 8`` bytes (3-bit codes take 3 bits), rows of one
slice are contiguous, and a block's bytes can be read as int32 words (S >= 32).

Why token-split: shifting a slice's bytes right by ``i * w`` gives, for the tokens of
sub-row i, the *raw* value ``P_t = c_t + 2**w * P_{t + S/k}`` (the bits above are not
masked). Attention can contract raw values and correct afterwards, on the small
result, instead of masking every element (`raw_slices`, `telescope`, `fold_weights`):
``q . c_t = q . P_t - 2**w * q . P_{t+S/k}`` and ``sum_t w_t c_t = sum_t (w_t - 2**w * w_{t-S/k}) P_t``.
Triton kernels mask in registers.
"""

from __future__ import annotations

import functools

import torch

WIDTHS = (8, 4, 2, 1)


def slice_widths(bits: int) -> list[int]:
    """Widths of the slices of a ``bits``-bit code, lowest bits first (3 -> [2, 1])."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    out, rest = [], bits
    for width in WIDTHS:
        while rest >= width:
            out.append(width)
            rest -= width
    return sorted(out, reverse=True)


def packed_rows(tokens: int, bits: int) -> int:
    """Byte rows a block of ``tokens`` tokens occupies: tokens * bits / 8."""
    _check_tokens(tokens)
    return tokens * bits // 8


def packed_bytes(tokens: int, channels: int, bits: int) -> int:
    """Bytes of one packed block: tokens * channels * bits / 8."""
    return packed_rows(tokens, bits) * channels


def _check_tokens(tokens: int) -> None:
    if tokens % 8:
        raise ValueError(f"a packed block needs a multiple of 8 tokens, got {tokens}")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., S, C) integer codes in [0, 2**bits) -> (..., S * bits / 8, C) uint8 (see the module docstring)."""
    tokens = codes.shape[-2]
    _check_tokens(tokens)
    codes = codes.to(torch.int32)
    rows, low = [], 0
    for width in slice_widths(bits):
        k = 8 // width
        part = (codes >> low) & ((1 << width) - 1)  # (..., S, C) this slice's bits
        part = part.reshape(*codes.shape[:-2], k, tokens // k, codes.shape[-1])  # (..., k, S/k, C)
        shifts = (torch.arange(k, device=codes.device, dtype=torch.int32) * width).view(k, 1, 1)
        rows.append((part << shifts).sum(dim=-3).to(torch.uint8))  # (..., S/k, C)
        low += width
    return torch.cat(rows, dim=-2)


@functools.lru_cache(maxsize=None)
def _shifts(width: int, device: torch.device) -> torch.Tensor:
    """(k, 1, 1) uint8: the shift of each sub-row of a ``width``-bit slice, 0, w, 2w, ..."""
    return torch.arange(0, 8, width, device=device, dtype=torch.uint8).view(8 // width, 1, 1)


def raw_slices(packed: torch.Tensor, bits: int, tokens: int) -> list[tuple[int, int, torch.Tensor]]:
    """Per slice: (width, lowest bit, raw values P (..., S, C) uint8), P_t = c_t + 2**w * P_{t+S/k} (unmasked).

    Cheap on CPU: one broadcast shift per slice, whatever k (sub-row i shifted by ``i * w``)."""
    out, row, low = [], 0, 0
    for width in slice_widths(bits):
        k = 8 // width
        part = packed[..., row : row + tokens // k, :]  # (..., S/k, C)
        if k > 1:
            part = (part.unsqueeze(-3) >> _shifts(width, packed.device)).reshape(*part.shape[:-2], tokens, part.shape[-1])  # (..., S, C)
        out.append((width, low, part))
        row += tokens // k
        low += width
    return out


def telescope(raw_scores: torch.Tensor, width: int, tokens: int) -> torch.Tensor:
    """Scores against the raw values of `raw_slices` (..., N * S) -> scores against the codes, per block of S tokens:
    token t of sub-row i < k - 1 holds ``c_t + 2**w P_{t+S/k}``, so ``x . c_t = x . P_t - 2**w x . P_{t+S/k}``."""
    if width == 8:
        return raw_scores
    k = 8 // width
    blocks = raw_scores.reshape(*raw_scores.shape[:-1], -1, k, tokens // k)  # (..., N, k, S/k)
    out = blocks.clone()
    out[..., :-1, :] -= (1 << width) * blocks[..., 1:, :]
    return out.reshape(raw_scores.shape)


def unpack_codes(packed: torch.Tensor, bits: int, tokens: int) -> torch.Tensor:
    """Inverse of `pack_codes`: (..., S * bits / 8, C) uint8 -> (..., S, C) uint8 codes."""
    codes = None
    for width, low, raw in raw_slices(packed, bits, tokens):
        part = raw & ((1 << width) - 1) if width < 8 else raw
        codes = part << low if codes is None else codes | (part << low)
    return codes


def fold_weights(weights: torch.Tensor, width: int, tokens: int) -> torch.Tensor:
    """Token weights for a contraction with raw values: ``w'_t = w_t - 2**w w_{t-S/k}`` per block (last dim).

    ``sum_t w_t c_t == sum_t w'_t P_t`` for every slice channel.
    """
    if width == 8:
        return weights
    sub = tokens // (8 // width)
    blocks = weights.reshape(*weights.shape[:-1], -1, tokens)  # (..., N, S)
    out = blocks.clone()
    out[..., sub:] -= (1 << width) * blocks[..., : tokens - sub]
    return out.reshape(weights.shape)
