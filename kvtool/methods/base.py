"""Base class of block quantizers: the plumbing every quantization method shares.

A quantizer turns blocks of keys or values into compact storage and back. The runtime's
paged store holds *blocks* in a pool; one block is S = ``cache.block_size`` tokens of one
storage group of g KV heads (g = ``heads_per_block``: 1 for every method but Palu with
``group_heads`` != 1, whose latent spans a group of heads):

    x (N, g, S, D)  --encode_blocks(x, group)-->  {name: (N, *block_spec[name].shape)}
                    --decode_blocks(blocks, group)-->  (N, g, S, D)

N = blocks (from any streams), ``group`` (N,) int64 = the storage group of each block
(0 .. H_kv/g - 1), for methods with per-head parameters (KVQuant channel ranges, Palu
bases). `block_spec` gives every storage tensor's per-block shape and dtype, so the
pool can allocate them. The layout of each method is documented in its module; the
Triton kernels of `kvtool.runtime.kernels` read it as is.

Attention reads blocks through `chunk_scores` (keys) and `chunk_values` (values): the
torch reference for one chunk of nb blocks per stream. The default decodes the chunk
(a bounded temporary) and contracts it; methods override them with algebra that avoids
dequantizing (uniform: scales folded into the query or the probabilities). A forward of many
query rows (prefill) reads each chunk once as floats instead (`chunk_floats`).

`encode` / `decode` on (B, H_kv, N, S, D) tensors remain for calibration and tests.
A subclass overrides `block_spec`, `encode_blocks`, `decode_blocks`; methods that learn
from calibration data also override `fit`. Methods never import the runtime.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvtool.errors import RecipeError, RuntimeConfigError
from kvtool.recipe import QuantSpec

BlockSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


class BlockQuantizer:
    """Encode/decode blocks of K or V; see the module docstring for shapes."""

    name: str = "base"
    needs_fit: bool = False  # True: `fit` must run on calibration data before the quantizer is usable
    # "reservoir": `fit` gets a random sample of token rows (keys before RoPE) with Fisher weights;
    # "ranges": `fit_ranges` gets every calibration token's per-channel min/max and a sample (keys as stored)
    # "queries": `fit_queries` gets per-channel mean squares of the keys (after RoPE) and of the queries that read them
    fit_source: str = "reservoir"
    heads_per_block: int = 1  # g: KV heads one stored block spans

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

    @classmethod
    def requires_fit(cls, spec: QuantSpec) -> bool:
        """True when this spec cannot be used without calibration (default: ``needs_fit``)."""
        return cls.needs_fit

    @classmethod
    def fit_ranges(
        cls, spec: QuantSpec, head_dim: int, block_size: int, lo: torch.Tensor, hi: torch.Tensor, samples: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Methods with ``fit_source == "ranges"``: one layer's parameters from calibration ranges.

        lo, hi: (H_kv, D) float32 min / max over every calibration token past the sinks; samples:
        (N, H_kv, D) float32 a random sample of those tokens (keys after RoPE unless ``spec.pre_rope``).
        """
        raise NotImplementedError(f"method '{cls.name}' is not fitted from calibration ranges")

    @classmethod
    def fit_queries(
        cls, spec: QuantSpec, head_dim: int, key_square_mean: torch.Tensor, query_square_mean: torch.Tensor,
        value_square_mean: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Methods with ``fit_source == "queries"``: one layer's parameters from (H_kv, D) float32 per-channel mean
        squares of the keys after RoPE and of the queries (each KV head's query heads pooled), and of the values for
        a values spec, sinks left out."""
        raise NotImplementedError(f"method '{cls.name}' is not fitted from query statistics")

    # --- the block API (what the paged store uses) -------------------------------------------
    def block_spec(self) -> BlockSpec:
        """Per-block shape (without the leading block dim) and dtype of every storage tensor."""
        raise NotImplementedError

    def encode_blocks(self, x: torch.Tensor, group: torch.Tensor) -> dict[str, torch.Tensor]:
        """(N, g, S, D) float -> storage tensors with a leading N (see `block_spec`)."""
        raise NotImplementedError

    def decode_blocks(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        """Storage with a leading N -> (N, g, S, D) in ``self.dtype``."""
        raise NotImplementedError

    def chunk_scores(
        self,
        query: torch.Tensor,  # (Sc, g, R, D) float32, R query rows per KV head
        blocks: dict[str, torch.Tensor],  # {name: (Sc, nb, ...)}
        group: torch.Tensor,  # (Sc,) int64
        keys_to_attention: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q . k for every token of the chunk: (Sc, g, R, nb * S) float32.

        ``keys_to_attention`` maps decoded keys (Sc, g, nb*S, D) float32 into the domain the
        query is in (RoPE at the tokens' true positions when keys are stored before RoPE).
        """
        keys = self._decode_chunk(blocks, group)  # (Sc, g, T, D)
        if keys_to_attention is not None:
            keys = keys_to_attention(keys)
        return torch.matmul(query, keys.transpose(-1, -2))

    def chunk_values(self, probs: torch.Tensor, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        """sum_t p_t v_t: probs (Sc, g, R, nb * S) float32 -> (Sc, g, R, D) float32."""
        return torch.matmul(probs, self._decode_chunk(blocks, group))

    def chunk_floats(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        """The chunk decoded once for a forward of many query rows (prefill, `prefill_attention.py`):
        {name: (Sc, nb, ...)} -> (Sc, g, nb * S, D) float32 (a bounded temporary). Methods whose
        `chunk_scores` / `chunk_values` read values other than `decode_blocks`' override it."""
        return self._decode_chunk(blocks, group)

    def _decode_chunk(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        """{name: (Sc, nb, ...)} -> (Sc, g, nb * S, D) float32 (a bounded temporary)."""
        sc, nb = next(iter(blocks.values())).shape[:2]
        flat = {name: t.reshape(sc * nb, *t.shape[2:]) for name, t in blocks.items()}
        x = self.decode_blocks(flat, group.repeat_interleave(nb))  # (Sc*nb, g, S, D)
        g, s, d = x.shape[1:]
        return x.float().reshape(sc, nb, g, s, d).transpose(1, 2).reshape(sc, g, nb * s, d)

    def check_kv_heads(self, num_kv_heads: int) -> None:
        """Raise ArtifactError when fitted per-head parameters do not cover the model's KV heads."""

    # --- (B, H, N, S, D) wrappers for calibration and tests ------------------------------------
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, H_kv, N, S, D) float -> {name: (B, H_kv / g, N, ...)}."""
        b, h, n, s, d = x.shape
        self.check_kv_heads(h)
        g = self.heads_per_block
        grouped = x.reshape(b, h // g, g, n, s, d).permute(0, 1, 3, 2, 4, 5).reshape(-1, g, s, d)  # (B*G*N, g, S, D)
        group = torch.arange(h // g, device=x.device).repeat_interleave(n).repeat(b)
        out = self.encode_blocks(grouped, group)
        return {name: t.reshape(b, h // g, n, *t.shape[1:]) for name, t in out.items()}

    def decode(self, storage: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of `encode`: {name: (B, G, N, ...)} -> (B, H_kv, N, S, D)."""
        b, groups, n = next(iter(storage.values())).shape[:3]
        flat = {name: t.reshape(b * groups * n, *t.shape[3:]) for name, t in storage.items()}
        device = next(iter(storage.values())).device
        group = torch.arange(groups, device=device).repeat_interleave(n).repeat(b)
        x = self.decode_blocks(flat, group)  # (B*G*N, g, S, D)
        g, s, d = x.shape[1:]
        return x.reshape(b, groups, n, g, s, d).permute(0, 1, 3, 2, 4, 5).reshape(b, groups * g, n, s, d)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)), for calibration error measurements only."""
        return self.decode(self.encode(x))

    # --- sizes -----------------------------------------------------------------------------------
    def stored_block_nbytes(self) -> int:
        """Bytes of one stored block (all ``heads_per_block`` heads), from `block_spec`."""
        total = 0
        for shape, dtype in self.block_spec().values():
            count = 1
            for n in shape:
                count *= n
            total += count * torch.empty((), dtype=dtype).element_size()
        return total

    def block_nbytes(self) -> int | float:
        """Bytes one block of one (sequence, KV head) stream occupies (a group block's bytes / g)."""
        per_head, rest = divmod(self.stored_block_nbytes(), self.heads_per_block)
        return per_head if rest == 0 else self.stored_block_nbytes() / self.heads_per_block

    def bits_per_element(self) -> float:
        """Average stored bits per element of the body, scales and zero points included."""
        return self.block_nbytes() * 8 / (self.block_size * self.head_dim)

    def kernel_format(self):
        """How the Triton decode kernel reads this format's blocks (`BodyFormat`); formats it cannot read raise."""
        raise RuntimeConfigError(f"the Triton decode kernel cannot read '{self.spec.method}' blocks")

    def kernel_encode_format(self):
        """The `BodyFormat` the Triton encode kernel (`kernels/encode_blocks.py`) writes exactly as this
        quantizer's ``encode_blocks`` does, or None (default): blocks are encoded by ``encode_blocks``."""
        return None

    def kernel_constants(self) -> dict[str, torch.Tensor]:
        """Fitted tensors the kernel reads beside the store (`BodyFormat`: static tables, codebook); default none."""
        return {}

    def kernel_tensors(self, device) -> dict[str, torch.Tensor]:
        """`kernel_constants` as contiguous float32 on ``device``, copied once per device."""
        cache = self.__dict__.setdefault("_kernel_tensors", {})
        key = str(device)
        if key not in cache:
            cache[key] = {name: t.detach().to(device=device, dtype=torch.float32).contiguous()
                          for name, t in self.kernel_constants().items()}
        return cache[key]

    def token_group(self) -> int:
        """Channels per scale group for ``axis: token`` (group_size clamped to head_dim); must divide head_dim."""
        group = min(self.spec.group_size, self.head_dim)
        if self.spec.axis == "token" and self.head_dim % group:
            raise RecipeError(
                f"recipe field '{self.spec.path}.group_size': {self.spec.group_size} does not divide the model's "
                f"head_dim {self.head_dim}; choose a power of two that divides {self.head_dim}"
            )
        return group
