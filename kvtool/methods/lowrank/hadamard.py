"""Orthonormal Walsh-Hadamard transform (Sylvester order), pure torch.

``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``, scaled by ``1/sqrt(n)`` so that
``H`` is orthonormal and symmetric, hence its own inverse: ``fwht(fwht(x)) == x``.
Palu applies it to the low-rank latents before quantizing them: it spreads one
outlier coordinate over all coordinates, which shrinks the max/rms ratio a per-token
min/max scale has to cover.
"""

from __future__ import annotations

import math

import torch


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """(n, n) orthonormal Sylvester Hadamard matrix; n a power of two. Symmetric: H == H.T == H^-1."""
    if not is_power_of_two(n):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / math.sqrt(n)).to(dtype)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Fast orthonormal Walsh-Hadamard transform along the last dim: x (..., n) -> (..., n), n a power of two.

    Equals ``x @ hadamard_matrix(n)`` in O(n log n) per vector; self-inverse. Float input; same dtype out.
    """
    n = x.shape[-1]
    if not is_power_of_two(n):
        raise ValueError(f"fwht needs the last dimension to be a power of two, got {n}")
    shape = x.shape
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.reshape(-1, n // (2 * h), 2, h)  # butterflies between elements h apart
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, n)
        h *= 2
    return (y * (1.0 / math.sqrt(n))).reshape(shape)


def block_fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """Block-diagonal Walsh-Hadamard transform: `fwht` on each run of ``block`` coordinates.

    x: (..., L) with L a multiple of ``block`` (a power of two). Orthonormal and self-inverse.
    """
    if block <= 1:
        return x
    shape = x.shape
    return fwht(x.reshape(*shape[:-1], shape[-1] // block, block)).reshape(shape)
