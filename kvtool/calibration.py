"""What `kvtool calibrate` measures and fits for a recipe's quantizers.

For every layer the recipe's key and value quantizers are run, exactly as the
runtime will run them, over the calibration K/V in blocks of ``block_size``
tokens; the signal-to-quantization-noise ratio (SQNR, dB) per KV head is
recorded. Methods that learn parameters (`BlockQuantizer.fit`) fit them here.
"""

from __future__ import annotations

import math

import torch

from kvtool.methods.registry import quantizer_class
from kvtool.recipe import Recipe


def build_quantizers(recipe: Recipe, head_dim: int, dtype: torch.dtype = torch.float16, fitted=None):
    """(key quantizer, value quantizer) for a recipe at a model's head_dim; raises RecipeError if they cannot be built."""
    fitted = fitted or {}
    block = recipe.cache.block_size
    keys = quantizer_class(recipe.keys.method)(recipe.keys, head_dim, block, dtype, fitted.get("keys"))
    values = quantizer_class(recipe.values.method)(recipe.values, head_dim, block, dtype, fitted.get("values"))
    return keys, values


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    """(B, H, T, D) -> (B, H, N, S, D) full blocks (the tail shorter than a block is left out)."""
    b, h, t, d = x.shape
    n = t // block
    return None if n == 0 else x[:, :, : n * block].reshape(b, h, n, block, d)


class QuantErrorStats:
    """Observer: per layer and KV head, signal and error energy of the recipe's quantizers."""

    def __init__(self, recipe: Recipe, head_dim: int) -> None:
        self.recipe = recipe
        self.quantizers = build_quantizers(recipe, head_dim)
        self.energy: dict[tuple[int, str], torch.Tensor] = {}

    def observe(self, layer, keys_pre_rope, keys, values) -> None:
        for part, x, quantizer in (("keys", keys, self.quantizers[0]), ("values", values, self.quantizers[1])):
            blocks = _blocks(x, self.recipe.cache.block_size)
            if blocks is None:
                continue
            error = (quantizer.roundtrip(blocks).float() - blocks).square().sum(dim=(0, 2, 3, 4))  # (H,)
            signal = blocks.square().sum(dim=(0, 2, 3, 4))
            pair = torch.stack([signal, error])  # (2, H)
            key = (layer, part)
            self.energy[key] = self.energy[key] + pair if key in self.energy else pair

    def sqnr_db(self) -> dict[str, torch.Tensor]:
        """``quality.layers.{i}.{keys,values}.sqnr_db`` -> (H_kv,) float32."""
        out = {}
        for (layer, part), (signal, error) in sorted(self.energy.items()):
            out[f"quality.layers.{layer}.{part}.sqnr_db"] = 10 * torch.log10(signal / error.clamp(min=1e-30))
        return out

    def summary(self) -> dict[str, float]:
        """Mean SQNR (dB) over layers for keys and values, from total energies."""
        out = {}
        for part in ("keys", "values"):
            pairs = [e for (_, p), e in self.energy.items() if p == part]
            if pairs:
                total = torch.stack(pairs).sum(dim=(0, 2))
                out[f"{part}_sqnr_db"] = float(10 * math.log10(total[0] / max(float(total[1]), 1e-30)))
        return out
