"""Base class of block quantizers: the plumbing every quantization method shares.

A quantizer turns a block of keys or values into compact storage and back:

    x (B, H_kv, N, S, D)  --encode-->  {name: tensor (B, H_kv, N, ...)}  --decode-->  (B, H_kv, N, S, D)

B = batch, H_kv = KV heads (never expanded to query heads), N = blocks,
S = tokens per block (``cache.block_size``), D = head_dim. Every storage tensor
has the leading (B, H_kv, N) dimensions, so the cache can append blocks
(``cat`` on dim 2) and select sequences (index dim 0) without knowing the method.

A subclass overrides `encode`, `decode` and `block_nbytes`; methods that learn
something from calibration data also override `fit` (returns named tensors the
artifact stores, for example a codebook). Methods never import the runtime.
"""

from __future__ import annotations

import torch

from kvtool.errors import RecipeError
from kvtool.recipe import QuantSpec


class BlockQuantizer:
    """Encode/decode blocks of K or V; see the module docstring for shapes."""

    name: str = "base"

    def __init__(
        self,
        spec: QuantSpec,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype = torch.float16,
        fitted: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.spec = spec
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype  # dtype of the float tensors the model produces
        self.fitted = dict(fitted or {})

    needs_fit: bool = False  # True: `fit` must run on calibration data before the quantizer is usable

    @classmethod
    def fit(
        cls,
        spec: QuantSpec,
        head_dim: int,
        block_size: int,
        samples: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Learn one layer's parameters from calibration samples.

        samples: (N, H_kv, D) float32 token vectors of one layer (pre-RoPE keys when
        ``spec.pre_rope``), drawn at random from the calibration data; weights: same
        shape, Fisher sensitivities (squared loss gradients) or None. Returns named
        tensors the artifact stores as ``layers.{i}.{keys|values}.{name}``.
        Default: nothing to learn.
        """
        return {}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, H_kv, N, S, D) float -> storage tensors with leading (B, H_kv, N)."""
        raise NotImplementedError

    def decode(self, storage: dict[str, torch.Tensor]) -> torch.Tensor:
        """Storage -> (B, H_kv, N, S, D) in ``self.dtype``."""
        raise NotImplementedError

    def block_nbytes(self) -> int:
        """Analytic bytes one block of one (sequence, KV head) stream occupies."""
        raise NotImplementedError

    def token_group(self) -> int:
        """Channels per scale group for ``axis: token`` (group_size clamped to head_dim); must divide head_dim."""
        group = min(self.spec.group_size, self.head_dim)
        if self.spec.axis == "token" and self.head_dim % group:
            raise RecipeError(
                f"recipe field '{self.spec.path}.group_size': {self.spec.group_size} does not divide the model's "
                f"head_dim {self.head_dim}; choose a power of two that divides {self.head_dim}"
            )
        return group

    def bits_per_element(self) -> float:
        """Average stored bits per element of the body, scales and zero points included."""
        return self.block_nbytes() * 8 / (self.block_size * self.head_dim)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)), for calibration error measurements only."""
        return self.decode(self.encode(x))
