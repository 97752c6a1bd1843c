"""Per-group low-rank bases of the K/V projections (Palu's G-LRD, whitened as in SVD-LLM).

The KV heads of a layer are cut into G groups of g = ``group_heads`` consecutive heads
(``group_heads`` 0 = one group of all heads). A group's projection is the block of rows
``W_g`` (g*D, d_in) of the layer's K (or V) weight (H*D, d_in) (rows head-major, as the
model reshapes them into heads), so a group's key is ``K_g = X W_g^T (+ b_g)``, g*D numbers.

Palu factors ``W_g ~ B^T A^T`` and caches the latent ``h = X A`` (r numbers per token):

* plain: ``W_g = U Sigma V^T`` (SVD); A = V_r Sigma_r, B = U_r^T;
* whitened (SVD-LLM): ``C = E[x x^T] = S S^T`` (Cholesky), ``W_g S = U Sigma V^T``;
  A = S^{-T} V_r Sigma_r, B = U_r^T.

In both cases ``X A == K_g U_r`` (minus the bias), because ``W_g^T U_r = A`` up to the
discarded directions. The cache holds full K/V, not X, so it stores ``(K_g - b_g) @ U_r``
and reconstructs ``latent @ U_r^T + b_g``: exactly Palu's cache content and error. Only the
orthonormal ``U`` (g*D, g*D) is needed, the "basis" here.

The whitened ``U`` are also the eigenvectors of ``E[(K_g - b)(K_g - b)^T] = W_g C W_g^T``,
so where K is not linear in X (qwen3's k_norm) the basis comes from the sample second
moment of the keys themselves.
"""

from __future__ import annotations

import torch

from kvtool.errors import RecipeError

RIDGE = 1e-6  # relative ridge eps * trace(C) / d added to C before the Cholesky factorisation


def group_count(num_kv_heads: int, group_heads: int, field: str = "group_heads") -> tuple[int, int]:
    """(G groups, g heads per group); group_heads 0 = all heads. RecipeError naming ``field`` if g does not divide."""
    g = num_kv_heads if group_heads == 0 else group_heads
    if g <= 0 or num_kv_heads % g:
        raise RecipeError(
            f"recipe field '{field}': {group_heads} heads per group does not divide the model's {num_kv_heads} KV heads; "
            f"choose a divisor of {num_kv_heads} (1 = per head, 0 = all heads jointly)"
        )
    return num_kv_heads // g, g


def _fix_signs(u: torch.Tensor) -> torch.Tensor:
    """Deterministic column signs: the largest-magnitude entry of every column is positive. u (..., n, k)."""
    idx = u.abs().argmax(dim=-2, keepdim=True)
    sign = torch.gather(u, -2, idx).sign()
    sign[sign == 0] = 1
    return u * sign


def _cholesky(c: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of c (d, d) float64 plus a relative ridge (grown until it factorises)."""
    d = c.shape[0]
    scale = (torch.trace(c) / d).clamp(min=1e-30)
    c = (c + c.T) / 2
    eye = torch.eye(d, dtype=c.dtype, device=c.device)
    eps = RIDGE
    while True:
        factor, info = torch.linalg.cholesky_ex(c + eps * scale * eye)
        if int(info) == 0:
            return factor
        if eps > 1.0:
            raise ValueError("the input second moment is not positive semi-definite (Cholesky failed)")
        eps *= 100


def _left_basis(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left singular vectors (rows, rows) and singular values (rows,) of m (rows, cols), completed to a square basis."""
    rows, cols = m.shape
    u, s, _ = torch.linalg.svd(m, full_matrices=cols < rows)
    spectrum = torch.zeros(rows, dtype=m.dtype, device=m.device)
    spectrum[: s.numel()] = s
    return u[:, :rows], spectrum


def _moment_blocks(moment: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """(H*D, H*D) or already per group (G, g*D, g*D) -> (G, g*D, g*D) diagonal blocks."""
    if moment.dim() == 3:
        if moment.shape != (groups, width, width):
            raise ValueError(f"sample_second_moment {tuple(moment.shape)} should be ({groups}, {width}, {width})")
        return moment
    if moment.shape != (groups * width, groups * width):
        raise ValueError(f"sample_second_moment {tuple(moment.shape)} should be ({groups * width}, {groups * width})")
    return torch.stack([moment[i * width : (i + 1) * width, i * width : (i + 1) * width] for i in range(groups)])


def group_bases(
    *,
    num_kv_heads: int,
    head_dim: int,
    group_heads: int,
    whiten: bool,
    weight: torch.Tensor | None = None,
    input_second_moment: torch.Tensor | None = None,
    sample_second_moment: torch.Tensor | None = None,
    field: str = "group_heads",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthonormal bases of every head group, columns sorted by importance.

    weight: (H*D, d_in) projection (rows head-major); input_second_moment: (d_in, d_in)
    ``E[x x^T]`` of the projection inputs; sample_second_moment: (H*D, H*D) (or per group
    (G, g*D, g*D)) ``E[(k - b)(k - b)^T]`` of the bias-free K (or V) vectors.

    * whiten, weight and input_second_moment given: left singular vectors of ``W_g S``
      (``C + eps*trace(C)/d*I = S S^T``);
    * whiten otherwise: eigenvectors of the sample second moment (the same U, see module doc);
    * not whiten: left singular vectors of ``W_g`` (needs ``weight``; ValueError otherwise).

    Returns (bases (G, g*D, g*D) float32 orthonormal columns, spectrum (G, g*D) float32
    singular values in descending order; for the sample-moment path sqrt of the eigenvalues,
    which equals the whitened singular values when C is the same distribution's moment).
    ``field`` names the recipe field in the RecipeError raised when group_heads does not divide.
    """
    groups, g = group_count(num_kv_heads, group_heads, field)
    width = g * head_dim
    if weight is not None and weight.shape[0] != num_kv_heads * head_dim:
        raise ValueError(f"weight {tuple(weight.shape)} should have {num_kv_heads * head_dim} rows (H_kv * head_dim)")
    bases, spectra = [], []
    if whiten and weight is not None and input_second_moment is not None:
        w = weight.detach().double().cpu()
        c = input_second_moment.detach().double().cpu()
        if c.shape != (w.shape[1], w.shape[1]):
            raise ValueError(
                f"input_second_moment {tuple(c.shape)} should be ({w.shape[1]}, {w.shape[1]}) for weight {tuple(w.shape)}"
            )
        s = _cholesky(c)
        for i in range(groups):
            u, spectrum = _left_basis(w[i * width : (i + 1) * width] @ s)
            bases.append(u)
            spectra.append(spectrum)
    elif whiten:
        if sample_second_moment is None:
            raise ValueError(
                "the whitened decomposition needs the projection weight and its input second moment, or the sample "
                "second moment of the K/V vectors"
            )
        blocks = _moment_blocks(sample_second_moment.detach().double().cpu(), groups, width)
        for block in blocks:
            values, vectors = torch.linalg.eigh((block + block.T) / 2)
            order = torch.argsort(values, descending=True)
            bases.append(vectors[:, order])
            spectra.append(values[order].clamp(min=0).sqrt())
    else:
        if weight is None:
            raise ValueError(
                "plain SVD (whiten: false) needs the projection weight; this projection has none usable (its output "
                "is not linear in the input, e.g. qwen3's k_norm): use whiten: true"
            )
        w = weight.detach().double().cpu()
        for i in range(groups):
            u, spectrum = _left_basis(w[i * width : (i + 1) * width])
            bases.append(u)
            spectra.append(spectrum)
    return _fix_signs(torch.stack(bases)).float(), torch.stack(spectra).float()


def to_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(N, H, D) -> (N, G, g*D): heads of a group side by side (head-major, like the weight rows)."""
    n, h, d = x.shape
    return x.reshape(n, groups, (h // groups) * d)


def reconstruction_error(
    bases: torch.Tensor,
    rank: int,
    samples: torch.Tensor,
    weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> float:
    """Relative squared error of keeping ``rank`` columns of every group's basis.

    bases: (G, g*D, >= rank); samples, weights: (N, H, D); bias: (H*D,) or (G, g*D) or None.
    Reconstruction ``x_hat = (x - b) U_r U_r^T + b``; returns
    ``sum w (x - x_hat)^2 / sum w x^2`` (w = 1 without weights) over all samples and groups.
    """
    groups = bases.shape[0]
    x = to_groups(samples.detach().float().cpu(), groups)
    b = torch.zeros(x.shape[1:]) if bias is None else bias.detach().float().cpu().reshape(x.shape[1:])
    u = bases[:, :, :rank].float().cpu()
    centred = x - b
    latent = torch.einsum("ngi,gir->ngr", centred, u)
    residual = centred - torch.einsum("ngr,gir->ngi", latent, u)
    w = torch.ones_like(x) if weights is None else to_groups(weights.detach().float().cpu(), groups)
    num = (w.double() * residual.double().square()).sum()
    den = (w.double() * x.double().square()).sum().clamp(min=1e-300)
    return float(num / den)
