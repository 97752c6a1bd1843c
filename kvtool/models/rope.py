"""Rotary position embedding (RoPE) in the rotate-half layout, forward and inverse.

Every supported family (llama, mistral, qwen2, qwen3, phi3, gemma) uses the same layout:
the rotated part of a head is split in two halves (x1, x2) and position p turns each
pair (x1[i], x2[i]) by the angle p * inv_freq[i]. `cos`/`sin` come from
`ModelAdapter.rope_cos_sin` (the model's own rotary module), shape (B, T, R), where
R = rotary_dim <= head_dim. With partial rotary (R < D) only the first R dims of a head
turn; the rest pass through unchanged.

Some RoPE types (yarn, longrope) multiply cos and sin by an `attention_scaling` factor,
so the "rotation" also scales by that factor; `unapply_rope` divides it out, so it is
an exact inverse for every type.
"""

import torch
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) along the last dim, halves split in the middle. Same shape."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x by RoPE, exactly as the models do (computed in x's dtype).

    x: (B, H, T, D); cos, sin: (B, T, R) with R <= D. Returns (B, H, T, D).
    """
    rotary_dim = _check_dims(x, cos)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]  # (B, H, T, R), (B, H, T, D-R)
    cos = cos.unsqueeze(1).to(x.dtype)  # (B, 1, T, R)
    sin = sin.unsqueeze(1).to(x.dtype)  # (B, 1, T, R)
    rotated = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((rotated, x_pass), dim=-1)


def unapply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Exact inverse of `apply_rope`: turn post-RoPE keys back into pre-RoPE keys.

    x: (B, H, T, D); cos, sin: (B, T, R) with R <= D. Returns (B, H, T, D) in x's dtype.
    Computes x*cos - rotate_half(x)*sin on the rotated part, divided by cos^2 + sin^2
    (1 for plain RoPE; attention_scaling^2 for yarn/longrope). Works in float32.
    """
    rotary_dim = _check_dims(x, cos)
    x_rot = x[..., :rotary_dim].float()  # (B, H, T, R)
    x_pass = x[..., rotary_dim:]  # (B, H, T, D-R)
    cos = cos.unsqueeze(1).float()  # (B, 1, T, R)
    sin = sin.unsqueeze(1).float()  # (B, 1, T, R)
    restored = (x_rot * cos - rotate_half(x_rot) * sin) / (cos * cos + sin * sin)
    return torch.cat((restored.to(x.dtype), x_pass), dim=-1)


def _check_dims(x: Tensor, cos: Tensor) -> int:
    """Return the rotary dim R of cos (B, T, R); it must be even and at most x's head dim."""
    rotary_dim = cos.shape[-1]
    if rotary_dim > x.shape[-1] or rotary_dim % 2:
        raise ValueError(f"rotary dim {rotary_dim} must be even and <= head dim {x.shape[-1]}")
    return rotary_dim
