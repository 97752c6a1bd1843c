"""Palu (Chang et al. 2024): low-rank latents of K/V per group of heads, optionally quantized.

The KV heads of a layer form G groups of g heads (``group_heads``; 0 = all). For a group,
the cache stores the latent ``h = (K_g - b_g) @ U_r`` (r numbers per token), where ``U_r``
(g*D, r) is the first r columns of the group's orthonormal basis (`decompose.py`: the
left singular vectors of the whitened projection, so ``h`` is exactly Palu's ``X A``), and
reconstructs ``K_g ~ h @ U_r^T + b_g``. Ranks are searched across layers and K/V by
`fit_palu` (`rank_search.py`).

Encode, blocks x (N, g, S, D) of group G_i -> (N, S, g*D) -> minus bias -> latent (N, S, r).

Storage per block of one (sequence, head group) stream (leading block dim omitted):

* ``bits == 16``: ``latent`` float16 (S, r);
* otherwise: with ``rotate_basis`` the fitted basis already carries an r x r rotation
  (`latent_rotation`, folded in at calibration: nothing extra at decode); with ``hadamard``
  the latent goes through a block-diagonal Walsh-Hadamard transform (blocks of the largest
  power of two dividing r, at most 64; `fit_palu` rounds Hadamard ranks down to multiples of 8
  so the blocks mix); L = r; then uniform asymmetric per-token quantization, one fp16
  ``scale`` and ``zero`` per token and group of q = min(group_size, L) coordinates
  (a last partial group is allowed): ``codes`` uint8 (S * bits / 8, L), bit-sliced and
  token-split (`packing.py`); ``scale``, ``zero`` float16 (S, ceil(L/q)).

A stored block spans the g KV heads of its group (``heads_per_block``); attention folds the
value up-projection into the attention output (`chunk_values`). Attention reads the stored
coordinates with the Hadamard transform folded into the up-projection (H U^T, as the Triton
kernel's ``recon``), one product per chunk for a layer of one group; on the host the key
logits are compiled (`cpu_lowrank.latent_logits`: keys reconstructed, turned by RoPE and
dotted sixteen tokens at a time) and the codes dequantized in one pass (`_host_latents`), both
shared out over torch's own OpenMP threads when a chunk is large enough.

``block_nbytes`` is per block of one (sequence, KV head) stream, i.e. a group block's bytes / g:
``S*r*2 / g`` at 16 bits, ``(S*L*bits/8 + 4*S*ceil(L/q)) / g`` quantized (an int when exact,
else the exact float), so ``bits_per_element`` is relative to the S*D elements of a head:
rank r = g*D/2 at 16 bits gives 8 bits per element.

Fitted tensors per layer and part: ``basis`` (G, g*D, r) float32 orthonormal columns,
``bias`` (G, g*D) float32 (zeros if the projection has none); `fit_palu` also reports
``relative_error`` (scalar float32, reconstruction error on the calibration samples).
"""

from __future__ import annotations

import math

import torch

from kvtool.errors import ArtifactError, DataError, RecipeError, RuntimeConfigError
from kvtool.methods.base import BlockQuantizer
from kvtool.methods.lowrank.decompose import group_bases, group_count, reconstruction_error, to_groups
from kvtool.methods.lowrank.hadamard import block_fwht, hadamard_matrix
from kvtool.methods.lowrank.rank_search import allocate_ranks, error_curve, gradient_curve
from kvtool.methods.quant.packing import pack_codes, packed_bytes, packed_rows, unpack_codes
from kvtool.methods.registry import register
from kvtool.recipe import Recipe

_FP16_MAX = 65504.0


@register("palu")
class PaluQuantizer(BlockQuantizer):
    """Low-rank latents per head group (fp16, or uniform per-token codes, optionally after a Hadamard transform)."""

    needs_fit = True

    def __init__(self, spec, head_dim, block_size, dtype=torch.float16, fitted=None) -> None:
        super().__init__(spec, head_dim, block_size, dtype, fitted)
        if "basis" not in self.fitted:
            raise ArtifactError(
                f"the palu method needs calibrated tensors (basis, bias) for '{spec.path}' but none were given: "
                f"run kvtool calibrate with this recipe and use the artifact it writes"
            )
        basis = self.fitted["basis"].detach().float().cpu()
        if basis.dim() != 3 or basis.shape[1] % head_dim or not 1 <= basis.shape[2] <= basis.shape[1]:
            raise ArtifactError(
                f"palu basis for '{spec.path}' has shape {tuple(basis.shape)}, expected (G, g*{head_dim}, r) with "
                f"1 <= r <= g*{head_dim}: the artifact is for another model; run kvtool calibrate again"
            )
        self.groups, self.width, self.rank = basis.shape
        self.heads_per_group = self.width // head_dim
        self.heads_per_block = self.heads_per_group  # a stored block holds the latent of one head group
        bias = self.fitted.get("bias")
        bias = torch.zeros(self.groups, self.width) if bias is None else bias.detach().float().cpu()
        if bias.shape != (self.groups, self.width):
            raise ArtifactError(
                f"palu bias for '{spec.path}' has shape {tuple(bias.shape)}, expected {(self.groups, self.width)}: "
                f"the artifact is for another model; run kvtool calibrate again"
            )
        self.basis, self.bias = basis, bias
        self.has_bias = bool(bias.abs().amax() > 0)  # projections without a bias (most models): nothing to add
        self.length = self.rank  # L coordinates coded per token
        self.hadamard_block = min(self.rank & -self.rank, 64) if spec.hadamard else 1  # power of two dividing r
        self.qgroup = min(spec.group_size, self.length)
        self.qgroups = math.ceil(self.length / self.qgroup)
        self.levels = 2**spec.bits - 1
        self._device_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def fit(cls, spec, head_dim, block_size, samples, weights=None) -> dict[str, torch.Tensor]:
        raise NotImplementedError(
            "palu ranks are searched jointly across layers and K/V: use "
            "kvtool.methods.lowrank.palu.fit_palu(recipe, layers) (kvtool.calibration.fit_palu_layers), not fit()"
        )

    # ----- geometry ------------------------------------------------------------------------

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(basis (G, gD, r), bias (G, gD), up-projection of the stored coordinates per head (G, g, r, D): U^T, or
        H U^T with the Hadamard transform folded in, as the Triton kernel's ``recon``) float32 on ``device``."""
        if device not in self._device_cache:
            recon = self._recon().view(self.groups, self.rank, self.heads_per_group, self.head_dim)  # (G, r, g, D)
            up = recon.transpose(1, 2).float().contiguous().to(device)
            self._device_cache[device] = (self.basis.to(device), self.bias.to(device), up)
        return self._device_cache[device]

    def _recon(self) -> torch.Tensor:
        """(G, r, gD) float64: the stored coordinates' up-projection, H @ U^T with a Hadamard transform (H symmetric:
        (U H)^T = H U^T), else U^T."""
        up = self.basis.double().transpose(1, 2)  # (G, r, gD)
        if self.spec.bits != 16 and self.spec.hadamard:
            up = block_fwht(up.transpose(1, 2), self.hadamard_block).transpose(1, 2)
        return up

    def _reconstruct(self, coded: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        """Stored coordinates (N, T, r) float32 (`_coded_latent`) of group ``group`` (N,) -> (N, g, T, D) float32:
        h U^T + b head by head, the Hadamard transform folded into the product; one up-projection for every token
        when the layer has one group (not copied per block)."""
        _, bias, up = self._tensors(coded.device)
        group = group.to(coded.device)
        out = torch.matmul(coded[:, None], up[0] if self.groups == 1 else up[group])  # (N, g, T, D)
        if self.has_bias:
            out = out + bias[group].view(-1, self.heads_per_group, 1, self.head_dim)
        return out

    def check_kv_heads(self, num_kv_heads: int) -> None:
        if num_kv_heads != self.groups * self.heads_per_group:
            raise ArtifactError(
                f"palu basis for '{self.spec.path}' covers {self.groups} x {self.heads_per_group} KV heads of "
                f"head_dim {self.head_dim}; the model has {num_kv_heads} KV heads: the artifact is for another model"
            )

    def _padded(self, v: torch.Tensor) -> torch.Tensor:
        """(..., L) -> (..., qgroups, q): a last partial group is filled with copies of its last coordinate."""
        extra = self.qgroups * self.qgroup - self.length
        if extra:
            v = torch.cat([v, v[..., -1:].expand(*v.shape[:-1], extra)], dim=-1)
        return v.reshape(*v.shape[:-1], self.qgroups, self.qgroup)

    # ----- encode / decode -----------------------------------------------------------------

    def block_spec(self):
        s = self.block_size
        if self.spec.bits == 16:
            return {"latent": ((s, self.rank), torch.float16)}
        return {
            "codes": ((packed_rows(s, self.spec.bits), self.length), torch.uint8),
            "scale": ((s, self.qgroups), torch.float16),
            "zero": ((s, self.qgroups), torch.float16),
        }

    def encode_blocks(self, x: torch.Tensor, group: torch.Tensor) -> dict[str, torch.Tensor]:
        n, g, s, d = x.shape
        basis, bias, _ = self._tensors(x.device)
        group = group.to(x.device)
        flat = x.float().permute(0, 2, 1, 3).reshape(n, s, g * d) - bias[group][:, None, :]  # (N, S, gD)
        # one (S, gD) @ (gD, r) product per block, so a block's latent does not depend on the others
        latent = torch.bmm(flat, basis[group])  # (N, S, r)
        if self.spec.bits == 16:
            return {"latent": latent.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)}
        if self.spec.hadamard:
            latent = block_fwht(latent, self.hadamard_block)
        grouped = self._padded(latent)  # (N, S, qgroups, q)
        lo = grouped.amin(dim=-1).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
        hi = grouped.amax(dim=-1).clamp(-_FP16_MAX, _FP16_MAX)
        scale = ((hi - lo.float()) / self.levels).clamp(min=1e-6, max=_FP16_MAX).to(torch.float16)
        # codes against the fp16-rounded scale and zero the decoder will see
        codes = torch.round((grouped - lo.float()[..., None]) / scale.float()[..., None]).clamp_(0, self.levels)
        codes = codes.reshape(n, s, -1)[..., : self.length]  # (N, S, L)
        return {"codes": pack_codes(codes, self.spec.bits), "scale": scale, "zero": lo}

    def decode_latent(self, blocks: dict[str, torch.Tensor]) -> torch.Tensor:
        """Storage {name: (N, ...)} -> latents (N, S, r) float32 (Hadamard undone)."""
        coded = self._coded_latent(blocks)
        return block_fwht(coded, self.hadamard_block) if self.spec.bits != 16 and self.spec.hadamard else coded

    def _coded_latent(self, blocks: dict[str, torch.Tensor]) -> torch.Tensor:
        """Storage {name: (N, ...)} -> the stored coordinates (N, S, L) float32: codes x scale + zero (a Hadamard
        transform not undone), or the float16 latents."""
        if self.spec.bits == 16:
            return blocks["latent"].float()
        if blocks["codes"].device.type == "cpu" and _numba_available():  # one compiled pass, the same bits
            return _host_latents(blocks, self.spec.bits, self.qgroup)  # (N, S, L)
        codes = unpack_codes(blocks["codes"], self.spec.bits, self.block_size)  # (N, S, L)
        grouped = self._padded(codes.float())  # (N, S, qgroups, q)
        values = grouped * blocks["scale"].float()[..., None] + blocks["zero"].float()[..., None]
        return values.reshape(*codes.shape[:2], -1)[..., : self.length]

    def decode_blocks(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        heads = self._reconstruct(self._coded_latent(blocks), group)  # (N, g, S, D)
        limit = torch.finfo(self.dtype).max
        return heads.clamp(-limit, limit).to(self.dtype)

    def _chunk_latent(self, blocks: dict[str, torch.Tensor]) -> torch.Tensor:
        """{name: (Sc, nb, ...)} -> stored coordinates (Sc, nb * S, r) float32 (`_coded_latent`)."""
        sc, nb = next(iter(blocks.values())).shape[:2]
        flat = {name: t.reshape(sc * nb, *t.shape[2:]) for name, t in blocks.items()}
        return self._coded_latent(flat).reshape(sc, nb * self.block_size, self.rank)

    def _decode_chunk(self, blocks: dict[str, torch.Tensor], group: torch.Tensor) -> torch.Tensor:
        """{name: (Sc, nb, ...)} -> (Sc, g, nb * S, D) float32: one product per chunk, not rounded to the format's dtype
        (an intermediate that attention reads at once, as the Triton kernel's registers hold it)."""
        return self._reconstruct(self._chunk_latent(blocks), group)

    def chunk_scores(self, query, blocks, group, keys_to_attention=None):
        """q . k of the chunk's tokens (Sc, g, R, T) float32; on the host by `cpu_lowrank.latent_logits` (one pass, the
        keys reconstructed and turned sixteen tokens at a time) where Numba is installed, else the keys reconstructed
        whole (the base's)."""
        tokens = next(iter(blocks.values())).shape[1] * self.block_size
        if not self._host_logits_cover(query, tokens, keys_to_attention):
            return super().chunk_scores(query, blocks, group, keys_to_attention)
        from kvtool.runtime.kernels.cpu_lowrank import latent_logits

        coded = self._chunk_latent(blocks).contiguous()  # (Sc, T, r)
        _, bias, up = self._tensors(coded.device)
        sc, g, r, d = query.shape
        out = torch.empty(sc, g, r, tokens)
        rope = keys_to_attention
        none = torch.zeros(1, 1, 2)  # (keys stored after RoPE: no cos / sin read)
        cos, sin = (rope.cos.float().contiguous(), rope.sin.float().contiguous()) if rope is not None else (none, none)
        latent_logits(
            coded.numpy(), group.to(torch.int64).contiguous().numpy(), up.numpy(), bias.view(-1, g, d).numpy(),
            self.has_bias, cos.numpy(), sin.numpy(), 0 if rope is None else cos.shape[-1],
            False if rope is None else rope.interleaved, query.float().contiguous().numpy(), out.numpy(),
        )
        return out

    def _host_logits_cover(self, query: torch.Tensor, tokens: int, keys_to_attention) -> bool:
        """`chunk_scores` runs the host kernel: CPU tensors, Numba, keys stored after RoPE or turned by a `KeyRotation`
        (whose cos / sin the kernel reads), and a chunk the kernel's tiles cover."""
        from kvtool.models.rope import KeyRotation

        if query.device.type != "cpu" or not _numba_available():
            return False
        if keys_to_attention is not None and not isinstance(keys_to_attention, KeyRotation):
            return False
        from kvtool.runtime.kernels.cpu_lowrank import covers

        return covers(tokens, self.head_dim)

    def chunk_values(self, probs, blocks, group):
        """Palu's fold: sum_t p_t (U_h h_t + b_h) = U_h (sum_t p_t h_t) + b_h sum_t p_t, never reconstructing V."""
        latent = self._chunk_latent(blocks)  # (Sc, T, r)
        sc, g, r, t = probs.shape
        _, bias, up = self._tensors(latent.device)
        group = group.to(latent.device)
        mixed = torch.matmul(probs.reshape(sc, g * r, t), latent).view(sc, g, r, self.rank)  # one pass over the latents
        out = torch.matmul(mixed, up[0] if self.groups == 1 else up[group])  # (Sc, g, R, D)
        if self.has_bias:
            out = out + probs.sum(dim=-1, keepdim=True) * bias[group].view(sc, g, 1, self.head_dim)
        return out

    # ----- the Triton decode kernel ----------------------------------------------------------
    def kernel_format(self):
        """Latents read as fp16 data or uniform per-token-group codes, reconstructed in registers (`body_lowrank.py`)."""
        from kvtool.runtime.kernels.body_format import BodyFormat

        if self.heads_per_group != 1:
            raise RuntimeConfigError(
                f"the Triton decode kernel reads one KV head per stream; palu group_heads {self.spec.group_heads} stores "
                f"one latent for {self.heads_per_group} KV heads"
            )
        if self.spec.bits == 16:
            return BodyFormat(bits=16, per_channel=False, group=1, rank=self.rank)
        return BodyFormat(bits=self.spec.bits, per_channel=False, group=self.qgroup, rank=self.rank)

    def kernel_constants(self) -> dict[str, torch.Tensor]:
        """``recon`` (G, r, gD) = H @ U^T (the Hadamard transform folded in) and ``recon_bias`` (G, gD)."""
        return {"recon": self._recon(), "recon_bias": self.bias}

    def block_nbytes(self) -> int | float:
        s = self.block_size
        if self.spec.bits == 16:
            group_bytes = s * self.rank * 2
        else:
            group_bytes = packed_bytes(s, self.length, self.spec.bits) + 2 * 2 * s * self.qgroups
        per_head, rest = divmod(group_bytes, self.heads_per_group)
        return per_head if rest == 0 else group_bytes / self.heads_per_group


def _numba_available() -> bool:
    from kvtool.runtime.kernels.cpu_decode import numba_available

    return numba_available()


HOST_SPREAD_MIN_ELEMENTS = 1 << 16  # latents from which `_host_latents` spreads over torch's threads (about 30 us on one core)


def _host_latents(blocks: dict[str, torch.Tensor], bits: int, group: int) -> torch.Tensor:
    """`PaluQuantizer.decode_latent`'s codes x scale + zero of host blocks by the compiled
    `cpu_decode_kernel.dequantize_latents` (about a dozen tensor operations in one pass): (N, S, L) float32. At
    least `HOST_SPREAD_MIN_ELEMENTS` of them are shared out by block over torch's own OpenMP threads (`openmp_team`),
    where there are several."""
    from kvtool.runtime.kernels.cpu_decode import slice_width_table
    from kvtool.runtime.kernels.cpu_decode_kernel import dequantize_latents
    from kvtool.runtime.kernels.openmp_team import team_for

    codes = blocks["codes"].contiguous()
    n, length = codes.shape[0], codes.shape[-1]
    out = torch.empty(n, codes.shape[1] * 8 // bits, length)
    scale, zero = (blocks[name].contiguous().view(torch.int16).numpy().view("uint16") for name in ("scale", "zero"))
    team, addresses, threads = team_for(out.numel() if n > 1 else 0, HOST_SPREAD_MIN_ELEMENTS)
    dequantize_latents(codes.numpy(), slice_width_table(bits), scale, zero, group, out.numpy(), addresses, threads)
    if team is not None:
        team.runs += 1
    return out


# ----- calibration: bases per layer, ranks searched across layers and K/V ------------------------


def _second_moment(samples: torch.Tensor, bias: torch.Tensor | None, groups: int) -> torch.Tensor:
    """Per-group second moment (G, gD, gD) float64 of (samples - bias), samples (N, H, D)."""
    x = to_groups(samples.detach().double().cpu(), groups)
    if bias is not None:
        x = x - bias.detach().double().cpu().reshape(x.shape[1:])
    return torch.einsum("ngi,ngj->gij", x, x) / x.shape[0]


def _check_part(name: str, entry: dict, layer: int) -> tuple[torch.Tensor, ...]:
    samples = entry.get("samples")
    if samples is None or samples.dim() != 3 or samples.shape[0] == 0:
        got = None if samples is None else tuple(samples.shape)
        raise DataError(f"palu calibration of layer {layer} {name} needs samples (N>0, H_kv, D); got {got}")
    h, d = samples.shape[1:]
    weights, weight, bias = entry.get("weights"), entry.get("weight"), entry.get("bias")
    if weights is not None and weights.shape != samples.shape:
        raise DataError(f"layer {layer} {name}: Fisher weights {tuple(weights.shape)} do not match samples {tuple(samples.shape)}")
    if weight is not None and (weight.dim() != 2 or weight.shape[0] != h * d):
        raise DataError(f"layer {layer} {name}: projection weight {tuple(weight.shape)} should be ({h * d}, d_in)")
    if bias is not None and bias.numel() != h * d:
        raise DataError(f"layer {layer} {name}: bias {tuple(bias.shape)} should have {h * d} elements")
    return samples, weights, weight, bias


def _gradients(entry, samples: torch.Tensor, layer: int, name: str) -> torch.Tensor:
    """The signed loss gradients of a part's samples, which the ``gradient`` rank search needs."""
    gradients = entry.get("gradients")
    if gradients is None or gradients.shape != samples.shape:
        got = None if gradients is None else tuple(gradients.shape)
        raise DataError(
            f"palu rank_allocation 'gradient' needs the loss gradients of layer {layer} {name}'s samples, "
            f"shape {tuple(samples.shape)}; got {got} (calibrate with gradients: kvtool.calibration.needs_gradients)"
        )
    return gradients


def latent_rotation(rank: int) -> torch.Tensor:
    """(r, r) float64 orthogonal R for ``rotate_basis``: the basis U_r becomes U_r R, so latents h R.

    The whitened SVD orders the latents by variance (their calibration covariance is diagonal, the squared
    singular values), and on real keys the first coordinate carries most of a token's energy; one per-token
    scale then covers it and the small coordinates get few levels. With r = m 2^k (m odd),
    R = C_m^T (x) H_{2^k}: H the orthonormal Walsh-Hadamard matrix, C_m the orthonormal DCT-II matrix (its
    first basis vector constant; C_1 = [1]). Row i of R is the image of latent coordinate i; row 0 is flat
    (every entry +-1/sqrt(r)), so a token dominated by its first coordinate becomes a flat vector, and at a
    power-of-two rank every entry is +-1/sqrt(r), so every rotated coordinate's variance is exactly the mean
    of the r variances. Deterministic (no seed). SmolLM2-135M's pre-RoPE keys in 3-bit codes at ranks 72-128
    (`python -m benchmarks.palu_rotation`): 20.7-21.2 dB SQNR, against 13.1-14.6 dB for a random orthogonal R
    and 13.7-17.7 dB for ``hadamard``'s blocks (`benchmarks/RESULTS.md`, "A rotation folded into the Palu basis").
    """
    odd = rank // (rank & -rank)
    n = torch.arange(odd, dtype=torch.float64)
    dct = torch.cos(math.pi * (n[None, :] + 0.5) * n[:, None] / odd) * math.sqrt(2 / odd)  # (m, m), row j = basis j
    dct[0] /= math.sqrt(2)
    return torch.kron(dct, hadamard_matrix(rank // odd, torch.float64))  # row a 2^k + b = C row a (x) H row b


HADAMARD_RANK_MULTIPLE = 8  # Hadamard-mixed latents: ranks in multiples of 8 so every block mixes 8+ coordinates


def _round_rank(rank: int, multiple: int, full: int) -> int:
    """Round down to a multiple of ``multiple`` (never above the rank budget), at least one multiple."""
    step = min(multiple, full)
    return max(step, min(full, rank // step * step))


def fit_palu(recipe: Recipe, layers: list[dict]) -> list[dict[str, torch.Tensor]]:
    """Bases and jointly searched ranks of every layer's palu parts.

    layers[i]: ``{"keys": {...}, "values": {...}}`` with, for each part whose method is palu:
    ``samples`` (N, H_kv, D) float (pre-RoPE keys / values), ``weights`` (N, H_kv, D) Fisher
    sensitivities or None, ``gradients`` (N, H_kv, D) signed loss gradients or None (mode gradient needs them), ``weight`` (H_kv*D, d_in) projection or None (None where the output is
    not linear in the input, e.g. qwen3 keys after k_norm), ``bias`` (H_kv*D,) or None,
    ``input_second_moment`` (d_in, d_in) ``E[x x^T]`` of the projection input or None.

    Basis: whitened with weight + input moment when both are given, else from the sample second
    moment of (samples - bias); plain SVD needs weight. Ranks: every (layer, part) gets an
    error curve (Fisher-weighted when weights are given and the mode is fisher; with mode
    gradient, the error projected on ``gradients`` (N, H_kv, D), the signed loss gradients of
    the samples, `gradient_curve`); ranks are
    allocated jointly across layers and K/V (`allocate_ranks`) for a budget of
    ``sum rank_fraction_part * H*D`` kept numbers per token and layer (= the mean fraction when
    both parts are palu); mode from the specs (keys and values must agree).
    Returns per layer ``{"keys.basis" (G, gD, r), "keys.bias" (G, gD), "keys.relative_error" ()}``
    and the same for values (only palu parts).
    """
    parts = [(name, spec) for name, spec in (("keys", recipe.keys), ("values", recipe.values)) if spec.method == "palu"]
    if not parts:
        return [{} for _ in layers]
    modes = {spec.rank_allocation for _, spec in parts}
    if len(modes) > 1:
        raise RecipeError(
            f"recipe field 'values.rank_allocation': '{recipe.values.rank_allocation}' differs from keys "
            f"('{recipe.keys.rank_allocation}'); palu ranks of K and V are allocated jointly: use the same mode"
        )
    mode = modes.pop()
    fitted: dict[tuple[int, str], dict] = {}
    curves, fractions, costs = {}, {}, {}
    for i, layer in enumerate(layers):
        for name, spec in parts:
            if name not in layer or layer[name] is None:
                raise DataError(f"palu calibration of layer {i} has no '{name}' entry (recipe {name}.method is palu)")
            samples, weights, weight, bias = _check_part(name, layer[name], i)
            h, d = samples.shape[1:]
            groups, _ = group_count(h, spec.group_heads, f"{name}.group_heads")
            moment = layer[name].get("input_second_moment")
            linear_whiten = spec.whiten and weight is not None and moment is not None
            sample_moment = _second_moment(samples, bias, groups) if spec.whiten and not linear_whiten else None
            try:
                bases, _ = group_bases(
                    num_kv_heads=h, head_dim=d, group_heads=spec.group_heads, whiten=spec.whiten, weight=weight,
                    input_second_moment=moment, sample_second_moment=sample_moment, field=f"{name}.group_heads",
                )
            except ValueError as exc:
                raise RecipeError(f"recipe field '{name}.whiten': layer {i}: {exc}") from exc
            width = bases.shape[1]
            grouped_bias = torch.zeros(groups, width)
            if bias is not None:
                grouped_bias = bias.detach().float().cpu().reshape(groups, width)
            key = (i, name)
            fitted[key] = {"bases": bases, "bias": grouped_bias, "samples": samples}
            fractions[key], costs[key] = spec.rank_fraction, groups
            if mode == "fisher":
                curves[key] = error_curve(bases, samples, weights, grouped_bias)
            elif mode == "gradient":
                curves[key] = gradient_curve(bases, samples, _gradients(layer[name], samples, i, name), grouped_bias)
            else:
                curves[key] = torch.zeros(width + 1)  # only its length matters
    ranks = allocate_ranks(curves, fractions, mode, costs)
    multiple = HADAMARD_RANK_MULTIPLE if any(spec.hadamard and spec.bits != 16 for _, spec in parts) else 1
    ranks = {key: _round_rank(r, multiple, curves[key].numel() - 1) for key, r in ranks.items()}
    out: list[dict[str, torch.Tensor]] = [{} for _ in layers]
    specs = dict(parts)
    for (i, name), item in fitted.items():
        r = ranks[(i, name)]
        error = reconstruction_error(item["bases"], r, item["samples"], bias=item["bias"])
        basis = item["bases"][:, :, :r]  # (G, gD, r)
        if specs[name].rotate_basis:
            basis = (basis.double() @ latent_rotation(r)).to(basis.dtype)
        out[i][f"{name}.basis"] = basis.contiguous()
        out[i][f"{name}.bias"] = item["bias"].contiguous()
        out[i][f"{name}.relative_error"] = torch.tensor(error, dtype=torch.float32)
    return out
