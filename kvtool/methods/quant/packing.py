"""Bit-plane packing of integer codes into 32-bit words.

Layout (fixed, kernels rely on it): the last dimension of a code tensor is cut
into runs of 32 consecutive codes. A run of 32 ``b``-bit codes becomes ``b``
int32 words; word ``j`` of the run holds bit ``j`` of every code, code ``i`` of
the run at bit position ``i``. So a run costs exactly ``b`` words for any
``b`` in 1..8: 3-bit codes take 3 bits each, not 4.

    codes (..., N)  with N % 32 == 0   ->   words (..., N // 32 * b)  int32

Unpacking code ``i`` of a run: ``sum_j ((word[j] >> i) & 1) << j``.
"""

from __future__ import annotations

import torch

RUN = 32  # codes per run (one bit plane = one 32-bit word)


def _bit_positions(device: torch.device) -> torch.Tensor:
    return torch.arange(RUN, device=device, dtype=torch.int64)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` into int32 bit-plane words.

    codes: (..., N) any integer dtype, N a multiple of 32. Returns (..., N // 32 * bits) int32.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    n = codes.shape[-1]
    if n % RUN:
        raise ValueError(f"the last dimension ({n}) must be a multiple of {RUN} to pack")
    runs = codes.to(torch.int64).reshape(*codes.shape[:-1], n // RUN, RUN)  # (..., G, 32)
    shifts = _bit_positions(codes.device)
    planes = []
    for j in range(bits):
        bit_j = (runs >> j) & 1  # (..., G, 32)
        planes.append((bit_j << shifts).sum(dim=-1))  # (..., G) in [0, 2**32)
    words = torch.stack(planes, dim=-1)  # (..., G, bits)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement into int32 range
    return words.to(torch.int32).reshape(*codes.shape[:-1], n // RUN * bits)


def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: (..., G * bits) int32 -> (..., G * 32) uint8 codes.

    Shifts every word by 0..31 to read one bit plane per word, then ORs the planes
    together in uint8 (the torch reference path; kernels unpack in registers).
    """
    g = words.shape[-1] // bits
    planes = words.reshape(*words.shape[:-1], g, bits, 1)  # (..., G, bits, 1) int32
    shifts = torch.arange(RUN, device=words.device, dtype=torch.int32)
    bit_values = ((planes >> shifts) & 1).to(torch.uint8)  # (..., G, bits, 32)
    codes = bit_values[..., 0, :].clone()
    for j in range(1, bits):
        codes |= bit_values[..., j, :] << j
    return codes.reshape(*words.shape[:-1], g * RUN)


def packed_words(num_codes: int, bits: int) -> int:
    """Number of int32 words that `pack_codes` produces for ``num_codes`` codes."""
    return num_codes // RUN * bits
