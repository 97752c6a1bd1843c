"""TurboQuant (Zandieh et al., ICLR 2026): random rotation + Lloyd-Max scalar codes (+ a 1-bit QJL residual).

No calibration. Every token vector x (D,) of one KV head is stored as

1. its norm ``||x||`` (fp16) and the unit vector ``u = x / ||x||``;
2. rotated, ``y = H (s * u)``: H the orthonormal Walsh-Hadamard matrix, s a random +-1 sign
   vector from ``seed`` (a randomized Hadamard transform). For a random rotation every
   coordinate of y follows the same known law, the coordinate of a uniform point on the
   unit sphere, density ``f(t) ~ (1 - t**2) ** ((D - 3) / 2)`` on [-1, 1] (~ N(0, 1/D));
3. each coordinate coded against the Lloyd-Max codebook of that law (`lloyd_max_codebook`,
   computed once from the density: no data). ``extra_bits: 0.5`` codes the first half of
   the rotated coordinates at ``bits + 1`` (fractional rates by mixing two codebooks; the
   coordinates are exchangeable after the rotation, so which half does not matter);
4. keys with ``qjl: true``: the codes use ``bits - 1`` bits and the residual
   ``r = y - y_hat`` gets a 1-bit Quantized Johnson-Lindenstrauss sketch, ``sign(G r)`` with
   G a (D, D) Gaussian matrix from ``seed``, plus ``||r||`` (fp16). For any query q,
   ``E[sqrt(pi/2) / D * ||r|| * (G q) . sign(G r)] = q . r``: inner products are unbiased
   (the plain codes alone shrink them: ``E[q . y_hat] != q . y``).

Storage per block of one (sequence, KV head) stream (S tokens; leading block dim omitted):

* ``codes``: (S * b / 8, D) uint8, bit-sliced (`packing.py`), b = code bits; with
  ``extra_bits`` ``codes_hi`` (S * (b + 1) / 8, D / 2) and ``codes`` (S * b / 8, D / 2);
* ``norm``: (S,) float16;
* QJL: ``qjl_signs`` (S / 8, D) uint8 (1 bit per coordinate), ``residual_norm`` (S,) float16.

Attention never un-rotates keys (`chunk_scores`): the query is rotated once, ``q . x =
||x|| * (H (s * q)) . y``, and scores are taken against the codebook values in the rotated
domain (+ the QJL term, with the query sketched once as ``G H (s * q)``). Values
(`chunk_values`) are summed in the rotated domain, ``sum_t p_t ||x_t|| y_hat_t``, and the one
output row per query is rotated back.
"""

from __future__ import annotations

import functools
import math

import torch

from kvtool.errors import RecipeError
from kvtool.methods.base import BlockQuantizer
from kvtool.methods.lowrank.hadamard import fwht, is_power_of_two
from kvtool.methods.quant.packing import pack_codes, packed_rows, unpack_codes
from kvtool.methods.registry import register

_GRID = 1 << 16  # points of the density grid the Lloyd-Max iteration runs on
_LLOYD_STEPS = 300


@functools.lru_cache(maxsize=None)
def lloyd_max_codebook(dim: int, bits: int) -> torch.Tensor:
    """(2**bits,) float32 sorted: the MSE-optimal scalar quantizer of one coordinate of a uniform unit vector in R^dim.

    Lloyd-Max (alternate nearest-level cells and cell centroids) on the exact density
    ``(1 - t**2) ** ((dim - 3) / 2)`` sampled on a fine grid of [-1, 1]; starts from the
    Gaussian N(0, 1/dim) quantiles. Deterministic: it depends on (dim, bits) only.
    """
    t = torch.linspace(-1.0, 1.0, _GRID + 2, dtype=torch.float64)[1:-1]
    log_density = 0.5 * (dim - 3) * torch.log1p(-t.square())
    weight = torch.exp(log_density - log_density.max())
    weight = weight / weight.sum()
    levels = 2**bits
    probs = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    codebook = torch.special.ndtri(probs) / math.sqrt(dim)
    for _ in range(_LLOYD_STEPS):
        bounds = (codebook[1:] + codebook[:-1]) / 2
        cell = torch.bucketize(t, bounds)
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, weight)
        first = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, weight * t)
        updated = torch.where(mass > 0, first / mass.clamp(min=1e-300), codebook)
        if torch.allclose(updated, codebook, rtol=0, atol=1e-12):
            break
        codebook = updated
    return codebook.float()


@functools.lru_cache(maxsize=None)
def rotation_signs(dim: int, seed: int) -> torch.Tensor:
    """(dim,) float32 random +-1: the diagonal of the randomized Hadamard rotation."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (dim,), generator=generator).float() * 2 - 1


@functools.lru_cache(maxsize=None)
def qjl_matrix(dim: int, seed: int) -> torch.Tensor:
    """(dim, dim) float32 standard Gaussian: the QJL projection G (rows = sketch coordinates)."""
    generator = torch.Generator().manual_seed(seed + 0x9E3779B9)
    return torch.randn(dim, dim, generator=generator)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """y = H (s * x) along the last dim (orthonormal)."""
    return fwht(x * signs)


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x = s * H y: the inverse of `rotate` (H is symmetric and its own inverse)."""
    return fwht(y) * signs


@register("turboquant")
class TurboQuantizer(BlockQuantizer):
    """Randomized Hadamard rotation, Lloyd-Max codes of the rotated unit vector, its norm, optional QJL residual."""

    def __init__(self, spec, head_dim, block_size, dtype=torch.float16, fitted=None) -> None:
        super().__init__(spec, head_dim, block_size, dtype, fitted)
        if not is_power_of_two(head_dim):
            raise RecipeError(
                f"recipe field '{spec.path}.method': turboquant's Walsh-Hadamard rotation needs a power-of-two "
                f"head_dim, the model has {head_dim}; use another method for this model"
            )
        self.qjl = spec.qjl
        self.code_bits = spec.bits - (1 if self.qjl else 0)  # QJL takes one of the bits
        self.split = head_dim // 2 if spec.extra_bits else 0  # coordinates [0, split) at code_bits + 1
        self.signs = rotation_signs(head_dim, spec.seed)
        self.codebook = lloyd_max_codebook(head_dim, self.code_bits)
        self.codebook_hi = lloyd_max_codebook(head_dim, self.code_bits + 1) if self.split else None
        self.sketch = qjl_matrix(head_dim, spec.seed) if self.qjl else None
        self._device_cache: dict[torch.device, dict[str, torch.Tensor]] = {}

    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self._device_cache:
            tensors = {"signs": self.signs, "codebook": self.codebook}
            if self.codebook_hi is not None:
                tensors["codebook_hi"] = self.codebook_hi
            if self.sketch is not None:
                tensors["sketch"] = self.sketch
            self._device_cache[device] = {k: v.to(device) for k, v in tensors.items()}
        return self._device_cache[device]

    def block_spec(self):
        s, d, b = self.block_size, self.head_dim, self.code_bits
        spec = {"norm": ((s,), torch.float16)}
        if self.split:
            spec["codes_hi"] = ((packed_rows(s, b + 1), self.split), torch.uint8)
            spec["codes"] = ((packed_rows(s, b), d - self.split), torch.uint8)
        else:
            spec["codes"] = ((packed_rows(s, b), d), torch.uint8)
        if self.qjl:
            spec["qjl_signs"] = ((packed_rows(s, 1), d), torch.uint8)
            spec["residual_norm"] = ((s,), torch.float16)
        return spec

    # --- encode / decode ------------------------------------------------------------------------
    def _quantize(self, y: torch.Tensor, on: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Rotated unit vectors y (N, S, D) -> packed codes and the reconstruction y_hat (N, S, D)."""
        out, parts = {}, []
        pieces = [("codes_hi", y[..., : self.split], on.get("codebook_hi"), self.code_bits + 1)] if self.split else []
        pieces.append(("codes", y[..., self.split :], on["codebook"], self.code_bits))
        for name, part, codebook, bits in pieces:
            codes = torch.bucketize(part.contiguous(), (codebook[1:] + codebook[:-1]) / 2)  # nearest level
            out[name] = pack_codes(codes, bits)
            parts.append(codebook[codes])
        return out, torch.cat(parts, dim=-1)

    def _reconstruct(self, blocks: dict[str, torch.Tensor], on: dict) -> torch.Tensor:
        """Packed codes (N, ...) -> y_hat (N, S, D) float32 in the rotated domain (codes only)."""
        parts = []
        if self.split:
            parts.append(on["codebook_hi"][unpack_codes(blocks["codes_hi"], self.code_bits + 1, self.block_size).long()])
        parts.append(on["codebook"][unpack_codes(blocks["codes"], self.code_bits, self.block_size).long()])
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def _qjl_scale(self) -> float:
        return math.sqrt(math.pi / 2) / self.head_dim

    def _signs_pm1(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed QJL bits (..., S/8, D) -> (..., S, D) float32 in {-1, +1}."""
        return unpack_codes(packed, 1, self.block_size).float() * 2 - 1

    def encode_blocks(self, x: torch.Tensor, group: torch.Tensor) -> dict[str, torch.Tensor]:
        on = self._on(x.device)
        x = x[:, 0].float()  # (N, S, D)
        norm = x.norm(dim=-1)  # (N, S)
        norm16 = norm.clamp(max=65504.0).to(torch.float16)
        y = rotate(x / norm.clamp(min=1e-30)[..., None], on["signs"])  # unit vectors, rotated
        out, y_hat = self._quantize(y, on)
        out["norm"] = norm16
        if self.qjl:
            residual = y - y_hat  # (N, S, D)
            projected = residual @ on["sketch"].T  # (N, S, D): G r per token
            out["qjl_signs"] = pack_codes((projected >= 0).to(torch.uint8), 1)
            out["residual_norm"] = residual.norm(dim=-1).to(torch.float16)
        return out

    def _rotated_estimate(self, blocks: dict[str, torch.Tensor], on: dict) -> torch.Tensor:
        """The stored unit vectors in the rotated domain (N, S, D): y_hat (+ the QJL residual estimate)."""
        y = self._reconstruct(blocks, on)
        if self.qjl:
            signs = self._signs_pm1(blocks["qjl_signs"])  # (N, S, D)
            r_hat = (signs @ on["sketch"]) * (self._qjl_scale() * blocks["residual_norm"].float())[..., None]  # G^T sign(Gr)
            y = y + r_hat
        return y

    def decode_blocks(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        on = self._on(blocks["norm"].device)
        y = self._rotated_estimate(blocks, on)
        x = unrotate(y, on["signs"]) * blocks["norm"].float()[..., None]
        limit = torch.finfo(self.dtype).max
        return x.clamp(-limit, limit).to(self.dtype)[:, None]

    # --- attention in the rotated domain --------------------------------------------------------
    def _flat(self, blocks):
        """{(Sc, nb, ...)} -> {(Sc*nb, ...)} and (Sc, nb)."""
        sc, nb = blocks["norm"].shape[:2]
        return {name: t.reshape(sc * nb, *t.shape[2:]) for name, t in blocks.items()}, sc, nb

    def chunk_scores(self, query, blocks, group, keys_to_attention=None):
        if keys_to_attention is not None:  # keys stored before RoPE are refused by the recipe; kept for safety
            return super().chunk_scores(query, blocks, group, keys_to_attention)
        on = self._on(query.device)
        flat, sc, nb = self._flat(blocks)
        t = nb * self.block_size
        q_rot = rotate(query[:, 0], on["signs"])  # (Sc, R, D): the query goes to the keys' domain, once
        y_hat = self._reconstruct(flat, on).reshape(sc, t, self.head_dim)  # (Sc, T, D) codebook values
        scores = torch.matmul(q_rot, y_hat.transpose(-1, -2))  # (Sc, R, T)
        if self.qjl:
            signs = self._signs_pm1(flat["qjl_signs"]).reshape(sc, t, self.head_dim)  # (Sc, T, D)
            q_sketch = q_rot @ on["sketch"].T  # (Sc, R, D): G q
            gamma = flat["residual_norm"].float().reshape(sc, 1, t) * self._qjl_scale()
            scores = scores + torch.matmul(q_sketch, signs.transpose(-1, -2)) * gamma
        return (scores * flat["norm"].float().reshape(sc, 1, t))[:, None]  # (Sc, 1, R, T)

    def chunk_values(self, probs, blocks, group):
        on = self._on(probs.device)
        flat, sc, nb = self._flat(blocks)
        t = nb * self.block_size
        y = self._rotated_estimate(flat, on).reshape(sc, t, self.head_dim)  # (Sc, T, D)
        weights = probs[:, 0] * flat["norm"].float().reshape(sc, 1, t)  # (Sc, R, T): p_t ||x_t||
        out_rot = torch.matmul(weights, y)  # (Sc, R, D) in the rotated domain
        return unrotate(out_rot, on["signs"])[:, None]  # one rotation back per output row
