"""Rotary position embedding (RoPE): the math, forward and inverse, and `RopeSpec`.

Most families use the rotate-half layout: the rotated part of a head is split in two
halves (x1, x2) and position p turns each pair (x1[i], x2[i]) by the angle
p * inv_freq[i]; cos/sin are then cat(freqs, freqs). Cohere uses the interleaved
layout instead: pairs (x[2i], x[2i+1]) turn, and cos/sin repeat each frequency twice.
cos/sin have shape (..., T, R), where R = rotary_dim <= head_dim. With partial rotary
(R < D) only the first R dims of a head turn; the rest pass through unchanged.

Some RoPE types (yarn, longrope) multiply cos and sin by an `attention_scaling` factor,
so the "rotation" also scales by that factor; `unapply_rope` divides it out, so it is
an exact inverse for every type.

`RopeSpec` holds what one layer's RoPE is made of (frequencies, scaling, rotated dims,
layout) and computes cos/sin for any positions directly from them, exactly as the
model's rotary module does, without calling that module (so forward hooks on it, which
the runtime uses to learn each forward's position_ids, never fire for kvtool's own use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) along the last dim, halves split in the middle. Same shape."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: Tensor) -> Tensor:
    """Interleaved layout: (x[2i], x[2i+1]) -> (-x[2i+1], x[2i]) along the last dim. Same shape."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotate x by RoPE, exactly as the models do (computed in x's dtype).

    x: (B, H, T, D); cos, sin: (B, T, R) with R <= D. Returns (B, H, T, D).
    interleaved: pairs (2i, 2i+1) instead of halves (Cohere); cos/sin in the same layout.
    """
    rotary_dim = _check_dims(x, cos)
    cos = cos.unsqueeze(1).to(x.dtype)  # (B, 1, T, R)
    sin = sin.unsqueeze(1).to(x.dtype)  # (B, 1, T, R)
    differentiated = torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad)
    if not interleaved and not differentiated:  # (in-place writes into an output have no gradient)
        return _rotate_halves(x, cos, sin, rotary_dim)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]  # (B, H, T, R), (B, H, T, D-R)
    turn = rotate_pairs if interleaved else rotate_half
    rotated = x_rot * cos + turn(x_rot) * sin
    return torch.cat((rotated, x_pass), dim=-1)


@dataclass(frozen=True, eq=False)
class KeyRotation:
    """RoPE at given cos / sin (S, T, R) float32 in a layout, as a function of keys (S, g, T, D) (`apply_rope`): what a
    format's ``chunk_scores`` gets to turn pre-RoPE keys at their true positions; a host kernel that turns the keys
    itself reads cos, sin and the layout from it (`cpu_lowrank.py`)."""

    cos: Tensor
    sin: Tensor
    interleaved: bool = False

    def __call__(self, keys: Tensor) -> Tensor:
        return apply_rope(keys, self.cos, self.sin, self.interleaved)


def _rotate_halves(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    """``x cos + rotate_half(x) sin`` on the first ``rotary_dim`` channels of x (B, H, T, D), the rest passed
    through, with cos / sin (B, 1, T, R) in x's dtype: written half by half into one output, so neither the rotated
    copy nor the concatenation is made (decode reads re-rotate every held pre-RoPE key each step). The same products
    and sums as the full-width formula, each rounded once, in the same order: the same bits."""
    h = rotary_dim // 2
    x1, x2 = x[..., :h], x[..., h:rotary_dim]
    shape = (*torch.broadcast_shapes(x.shape[:-1], cos.shape[:-1]), x.shape[-1])
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    first, second = out[..., :h], out[..., h:rotary_dim]
    product = torch.mul(x2, sin[..., :h])
    torch.mul(x1, cos[..., :h], out=first).sub_(product)  # x1 cos - x2 sin
    torch.mul(x1, sin[..., h:], out=product)
    torch.mul(x2, cos[..., h:], out=second).add_(product)  # x2 cos + x1 sin
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    return out


def unapply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Exact inverse of `apply_rope`: turn post-RoPE keys back into pre-RoPE keys.

    x: (B, H, T, D); cos, sin: (B, T, R) with R <= D. Returns (B, H, T, D) in x's dtype.
    Computes x*cos - rotate(x)*sin on the rotated part, divided by cos^2 + sin^2
    (1 for plain RoPE; attention_scaling^2 for yarn/longrope). Works in float32.
    """
    rotary_dim = _check_dims(x, cos)
    x_rot = x[..., :rotary_dim].float()  # (B, H, T, R)
    x_pass = x[..., rotary_dim:]  # (B, H, T, D-R)
    cos = cos.unsqueeze(1).float()  # (B, 1, T, R)
    sin = sin.unsqueeze(1).float()  # (B, 1, T, R)
    turn = rotate_pairs if interleaved else rotate_half
    restored = (x_rot * cos - turn(x_rot) * sin) / (cos * cos + sin * sin)
    return torch.cat((restored.to(x.dtype), x_pass), dim=-1)


def _check_dims(x: Tensor, cos: Tensor) -> int:
    """Return the rotary dim R of cos (B, T, R); it must be even and at most x's head dim."""
    rotary_dim = cos.shape[-1]
    if rotary_dim > x.shape[-1] or rotary_dim % 2:
        raise ValueError(f"rotary dim {rotary_dim} must be even and <= head dim {x.shape[-1]}")
    return rotary_dim


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """One layer's RoPE: cos/sin for any positions, computed from its frequencies (no module call).

    inv_freq: (R/2,) float32, the frequencies (for longrope: the short ones).
    attention_scaling: multiplies cos and sin (yarn, longrope; 1.0 for plain RoPE).
    rotary_dim: R, the leading dims of a head that turn (R < head_dim: partial rotary, e.g. Phi-3).
    interleaved: pairs (2i, 2i+1) turn instead of halves (i, i + R/2) (Cohere).
    long_inv_freq, long_after: longrope (Phi-3): a forward whose largest position + 1
        exceeds `long_after` (original_max_position_embeddings) uses `long_inv_freq`.
    grow_inv_freq, grow_after: dynamic NTK: a forward whose largest position + 1 = L exceeds
        `grow_after` uses grow_inv_freq(L). (transformers keeps the largest grown frequencies
        until a short forward resets them; with positions that only grow, as in generation,
        the two agree.)
    rope_type: the config's rope_type, for messages.

    Frequencies depend on the largest position of a forward only for longrope and dynamic
    types: pass the positions of the whole forward the model saw, as with the model's module.
    """

    inv_freq: Tensor
    attention_scaling: float = 1.0
    rotary_dim: int = 0
    interleaved: bool = False
    long_inv_freq: Tensor | None = None
    long_after: int | None = None
    grow_inv_freq: Callable[[int], Tensor] | None = None
    grow_after: int | None = None
    rope_type: str = "default"

    def __post_init__(self) -> None:
        if self.inv_freq.dim() != 1 or self.inv_freq.numel() == 0:
            raise ValueError(f"inv_freq must be a non-empty (R/2,) tensor, got shape {tuple(self.inv_freq.shape)}")
        if self.rotary_dim != 2 * self.inv_freq.numel():
            raise ValueError(f"rotary_dim {self.rotary_dim} must be 2 * len(inv_freq) = {2 * self.inv_freq.numel()}")
        if (self.long_inv_freq is None) != (self.long_after is None):
            raise ValueError("long_inv_freq and long_after go together (longrope)")
        if (self.grow_inv_freq is None) != (self.grow_after is None):
            raise ValueError("grow_inv_freq and grow_after go together (dynamic RoPE)")

    def frequencies(self, positions: Tensor) -> Tensor:
        """The (R/2,) float32 frequencies a forward over `positions` (any shape, long) uses."""
        if positions.numel() == 0:
            return self.inv_freq.float()
        length = int(positions.max()) + 1
        if self.long_after is not None and length > self.long_after:
            return self.long_inv_freq.float()
        if self.grow_after is not None and length > self.grow_after:
            return self.grow_inv_freq(length).float()
        return self.inv_freq.float()

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin (..., T, R) float32 for positions (..., T) long, in this layer's layout.

        Bit-identical to the model's rotary module in float32 (same operations in the same order).
        """
        inv_freq = self.frequencies(positions).to(positions.device)  # (R/2,)
        freqs = positions[..., None].float() * inv_freq  # (..., T, R/2)
        if self.interleaved:
            emb = torch.repeat_interleave(freqs, 2, dim=-1)  # (..., T, R): f0 f0 f1 f1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # (..., T, R): f0 f1 ... f0 f1 ...
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def apply(self, x: Tensor, positions: Tensor) -> Tensor:
        """RoPE of x (B, H, T, D) at positions (B, T); returns (B, H, T, D) in x's dtype."""
        cos, sin = self.cos_sin(positions)
        return apply_rope(x, cos, sin, self.interleaved)

    def unapply(self, x: Tensor, positions: Tensor) -> Tensor:
        """Exact inverse of `apply`: post-RoPE (B, H, T, D) at positions (B, T) back to pre-RoPE."""
        cos, sin = self.cos_sin(positions)
        return unapply_rope(x, cos, sin, self.interleaved)

    def same_as(self, other: "RopeSpec") -> bool:
        """True when both give the same cos/sin for every position (same frequencies, scaling and layout)."""
        return (
            (self.attention_scaling, self.rotary_dim, self.interleaved, self.long_after, self.grow_after, self.rope_type)
            == (other.attention_scaling, other.rotary_dim, other.interleaved, other.long_after, other.grow_after, other.rope_type)
            and torch.equal(self.inv_freq.cpu(), other.inv_freq.cpu())
            and (self.long_inv_freq is None or torch.equal(self.long_inv_freq.cpu(), other.long_inv_freq.cpu()))
        )
