"""Palu low-rank latents: bases (plain / whitened SVD), rank search, Hadamard, the quantizer, fit_palu.

A small linear "model": inputs X (N, d_in) with a correlated (anisotropic) covariance, a K/V
projection W (H*D, d_in) and bias b; K = X W^T + b as (N, H, D). The generic quantizer checks
(shapes, block independence, bytes, dtypes) run for palu rows in `test_quantizers.py`.
"""

import math

import pytest
import torch

from kvtool.errors import ArtifactError, DataError, RecipeError
from kvtool.methods.lowrank.decompose import group_bases, reconstruction_error, to_groups
from kvtool.methods.lowrank.hadamard import fwht, hadamard_matrix
from kvtool.methods.lowrank.palu import PaluQuantizer, fit_palu, latent_rotation
from kvtool.methods.lowrank.rank_search import allocate_ranks, error_curve
from kvtool.methods.registry import quantizer_class
from kvtool.recipe import QuantSpec, Recipe

H, D, D_IN, N_TOK = 4, 16, 48, 2048
S = 32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def correlated_inputs(n=N_TOK, d_in=D_IN, seed=0, decay=0.85) -> torch.Tensor:
    """(n, d_in) float64 with covariance R diag(decay^i) R^T: a strongly anisotropic input distribution."""
    g = gen(seed)
    rotation = torch.linalg.qr(torch.randn(d_in, d_in, generator=g, dtype=torch.float64))[0]
    scales = decay ** torch.arange(d_in, dtype=torch.float64)
    return torch.randn(n, d_in, generator=g, dtype=torch.float64) * scales @ rotation.T


def linear_model(seed=0, heads=H, with_bias=True):
    """(X (N, d_in), W (H*D, d_in), b (H*D,) or None, K (N, H, D)), all float64."""
    x = correlated_inputs(seed=seed)
    g = gen(seed + 100)
    w = torch.randn(heads * D, D_IN, generator=g, dtype=torch.float64) / math.sqrt(D_IN)
    b = torch.randn(heads * D, generator=g, dtype=torch.float64) if with_bias else None
    k = x @ w.T + (0 if b is None else b)
    return x, w, b, k.reshape(-1, heads, D)


def moment(x: torch.Tensor) -> torch.Tensor:
    return x.T @ x / x.shape[0]


def spec(part="keys", bits=16, **kwargs) -> QuantSpec:
    return QuantSpec(method="palu", bits=bits, pre_rope=part == "keys", path=part, **kwargs)


def recipe(keys=None, values=None) -> Recipe:
    none = lambda part: QuantSpec(method="none", bits=16, path=part)  # noqa: E731
    return Recipe(keys=keys or none("keys"), values=values or none("values"))


def part_entry(x, w, b, k, weights=None, linear=True) -> dict:
    return {
        "samples": k.float(),
        "weights": weights,
        "weight": w.float() if linear else None,
        "bias": None if b is None or not linear else b.float(),
        "input_second_moment": moment(x).float() if linear else None,
    }


def quantizer(part_spec, fitted, dtype=torch.float32, part="keys") -> PaluQuantizer:
    own = {name[len(part) + 1 :]: t for name, t in fitted.items() if name.startswith(part + ".")}
    return PaluQuantizer(part_spec, D, S, dtype, own)


def blocks_of(k: torch.Tensor, n_blocks=4) -> torch.Tensor:
    """(N, H, D) -> (1, H, n_blocks, S, D), the first n_blocks*S tokens."""
    h = k.shape[1]
    return k[: n_blocks * S].reshape(n_blocks, S, h, D).permute(2, 0, 1, 3).unsqueeze(0)


def rel_error(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return float((ref - approx).square().sum() / ref.square().sum())


# ----- bases ---------------------------------------------------------------------------------


@pytest.mark.parametrize("whiten", [True, False])
@pytest.mark.parametrize("group_heads", [1, 2, 0])
def test_full_rank_reproduces_input(group_heads, whiten):
    x, w, b, k = linear_model()
    fitted = fit_palu(
        recipe(keys=spec(rank_fraction=1.0, group_heads=group_heads, whiten=whiten)),
        [{"keys": part_entry(x, w, b, k)}],
    )[0]
    groups = H // (group_heads or H)
    basis = fitted["keys.basis"]
    assert basis.shape == (groups, (H // groups) * D, (H // groups) * D)
    eye = torch.eye(basis.shape[1]).expand_as(basis)
    assert torch.allclose(basis.transpose(1, 2) @ basis, eye, atol=1e-5)  # orthonormal columns
    assert float(fitted["keys.relative_error"]) < 1e-10
    out = quantizer(spec(rank_fraction=1.0, group_heads=group_heads, whiten=whiten), fitted).roundtrip(blocks_of(k))
    assert rel_error(blocks_of(k), out) < 1e-6  # fp16 latents: float rounding only


@pytest.mark.parametrize("whiten", [True, False])
def test_error_falls_monotonically_with_rank(whiten):
    x, w, b, k = linear_model()
    bases, spectrum = group_bases(
        num_kv_heads=H, head_dim=D, group_heads=1, whiten=whiten, weight=w, input_second_moment=moment(x)
    )
    assert torch.all(spectrum[:, :-1] >= spectrum[:, 1:] - 1e-6)
    errors = [reconstruction_error(bases, r, k, bias=b) for r in range(D + 1)]
    assert all(a >= c - 1e-9 for a, c in zip(errors, errors[1:]))
    assert errors[0] > 0.01 and errors[-1] < 1e-10
    curve = error_curve(bases, k, bias=b)
    assert curve.shape == (D + 1,)
    assert torch.all(curve[:-1] >= curve[1:] - 1e-9)
    total = (k.double() - b.reshape(H, D)).square().sum() / k.shape[0]
    assert curve[0] == pytest.approx(float(total), rel=1e-4)


def test_whitened_beats_plain_svd_on_anisotropic_inputs():
    x, w, b, k = linear_model()
    whitened, _ = group_bases(num_kv_heads=H, head_dim=D, group_heads=1, whiten=True, weight=w, input_second_moment=moment(x))
    plain, _ = group_bases(num_kv_heads=H, head_dim=D, group_heads=1, whiten=False, weight=w)
    for rank in (2, 4, 8, 12):
        e_white = reconstruction_error(whitened, rank, k, bias=b)
        e_plain = reconstruction_error(plain, rank, k, bias=b)
        assert e_white < 0.8 * e_plain, f"rank {rank}: whitened {e_white:.4f} vs plain {e_plain:.4f}"


def test_key_fact_latent_from_k_equals_palu_xa():
    """Palu caches h = X A with A = S^-T V_r Sigma_r (W_g S = U Sigma V^T); the cache sees K, and
    (K_g - b_g) U_r is the same latent, B = U_r^T reconstructs it. Checked per group of 2 heads."""
    x, w, b, k = linear_model()
    c = moment(x)
    bases, spectrum = group_bases(num_kv_heads=H, head_dim=D, group_heads=2, whiten=True, weight=w, input_second_moment=c)
    s_factor = torch.linalg.cholesky(c)
    r, width = 10, 2 * D
    kg = to_groups(k, 2)  # (N, G, 2D)
    bg = b.reshape(2, width)
    for g in range(2):
        wg = w[g * width : (g + 1) * width]
        u, sigma, vh = torch.linalg.svd(wg @ s_factor, full_matrices=False)
        a = torch.linalg.solve_triangular(s_factor.T, vh[:r].T * sigma[:r], upper=True)  # S^-T V_r Sigma_r (d_in, r)
        palu_latent = x @ a  # (N, r): what Palu caches
        ours = (kg[:, g] - bg[g]) @ bases[g, :, :r].double()  # what kvtool caches, from K
        signs = torch.sign((palu_latent * ours).sum(0))  # SVD column signs are arbitrary
        assert torch.allclose(ours * signs, palu_latent, atol=1e-4 * palu_latent.abs().max())
        assert torch.allclose(spectrum[g, :r].double(), sigma[:r], rtol=1e-4)
        # Palu's reconstruction X A B + b_g equals ours: latent U_r^T + b_g
        palu_k = palu_latent @ u[:, :r].T + bg[g]
        ours_k = ours @ bases[g, :, :r].double().T + bg[g]
        assert torch.allclose(palu_k, ours_k, atol=1e-4 * palu_k.abs().max())


def test_key_fact_sample_second_moment_spans_same_subspace():
    """Where K is not linear in X (qwen3 k_norm) the basis comes from E[(K-b)(K-b)^T] = W C W^T:
    on a linear model it spans the same rank-r subspaces as the weight + input moment basis."""
    x, w, b, k = linear_model()
    from_weight, spec_w = group_bases(num_kv_heads=H, head_dim=D, group_heads=1, whiten=True, weight=w, input_second_moment=moment(x))
    centred = (k - b.reshape(H, D)).reshape(-1, H * D)
    sample = centred.T @ centred / centred.shape[0]
    from_samples, spec_s = group_bases(num_kv_heads=H, head_dim=D, group_heads=1, whiten=True, sample_second_moment=sample)
    assert torch.allclose(spec_w, spec_s, rtol=1e-3, atol=1e-6)
    for rank in (1, 4, 8, 15):
        p_w = from_weight[:, :, :rank] @ from_weight[:, :, :rank].transpose(1, 2)
        p_s = from_samples[:, :, :rank] @ from_samples[:, :, :rank].transpose(1, 2)
        assert torch.allclose(p_w, p_s, atol=1e-3), f"rank {rank}"


def test_fit_palu_without_weight_uses_sample_moment():
    """fit_palu with weight None (non-linear keys) gives the same reconstruction as the linear path."""
    x, w, b, k = linear_model(with_bias=False)
    keys = spec(rank_fraction=0.5, rank_allocation="uniform")
    linear = fit_palu(recipe(keys=keys), [{"keys": part_entry(x, w, b, k)}])[0]
    sampled = fit_palu(recipe(keys=keys), [{"keys": part_entry(x, w, b, k, linear=False)}])[0]
    assert linear["keys.basis"].shape == sampled["keys.basis"].shape == (H, D, D // 2)
    assert float(sampled["keys.relative_error"]) == pytest.approx(float(linear["keys.relative_error"]), rel=1e-3)


def test_plain_svd_ignores_inputs_and_needs_weight():
    x, w, b, k = linear_model()
    with pytest.raises(ValueError, match="whiten: true"):
        group_bases(num_kv_heads=H, head_dim=D, group_heads=1, whiten=False, sample_second_moment=torch.eye(H * D))
    with pytest.raises(RecipeError, match=r"'keys\.whiten'"):
        fit_palu(recipe(keys=spec(whiten=False)), [{"keys": part_entry(x, w, b, k, linear=False)}])


# ----- Hadamard ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_hadamard_orthonormal_and_fwht_matches_matrix(n):
    h = hadamard_matrix(n, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    x = torch.randn(3, 5, n, generator=gen(1), dtype=torch.float64)
    assert torch.allclose(fwht(x), x @ h, atol=1e-12)


def test_fwht_round_trip_exact():
    x = torch.randn(4, 7, 128, generator=gen(2))
    y = fwht(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (fwht(y) - x).abs().max() < 1e-6
    assert y.norm() == pytest.approx(float(x.norm()), rel=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        fwht(torch.zeros(3, 12))
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(6)


def test_hadamard_reduces_outlier_peak():
    latent = torch.randn(256, 64, generator=gen(3))
    latent[:, 5] *= 30  # one outlier coordinate

    def peak(v):
        return float((v.abs().amax(dim=-1) / v.square().mean(dim=-1).sqrt()).mean())

    assert peak(fwht(latent)) < 0.5 * peak(latent)


def test_hadamard_improves_quantized_latents_with_outlier_coordinate():
    """A latent basis whose first direction carries most energy: 3-bit codes do better after a Hadamard transform."""
    x, w, b, k = linear_model()
    fitted = fit_palu(recipe(keys=spec(rank_fraction=0.75, rank_allocation="uniform")), [{"keys": part_entry(x, w, b, k)}])[0]
    blocks = blocks_of(k)
    plain = quantizer(spec(bits=3, rank_fraction=0.75), fitted).roundtrip(blocks)
    rotated = quantizer(spec(bits=3, rank_fraction=0.75, hadamard=True), fitted).roundtrip(blocks)
    assert rel_error(blocks, rotated) < rel_error(blocks, plain)


@pytest.mark.parametrize("rank", [1, 3, 8, 12, 16, 96, 136])
def test_latent_rotation_orthogonal_with_a_flat_first_row(rank):
    r = latent_rotation(rank)
    assert r.dtype == torch.float64 and r.shape == (rank, rank)
    assert torch.allclose(r @ r.T, torch.eye(rank, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(r[0].abs(), torch.full((rank,), rank**-0.5, dtype=torch.float64))  # the dominant coordinate spread flat
    if rank & (rank - 1) == 0:  # Walsh-Hadamard: every entry +-1/sqrt(r)
        assert torch.allclose(r.abs(), torch.full_like(r, rank**-0.5))


def test_latent_rotation_flattens_a_token_dominated_by_its_first_coordinate():
    """Per-token 3-bit codes of latents whose first coordinate dominates (as SmolLM2's keys' do): the rotation beats a
    random orthogonal one (whose images of e_0 are Gaussian-like, max/rms about 2.5) at a rank that is not a power of two."""
    rank = 96
    latent = torch.randn(512, rank, generator=gen(4), dtype=torch.float64) * 0.8 ** torch.arange(rank, dtype=torch.float64)
    latent[:, 0] += 20 * torch.rand(512, generator=gen(5), dtype=torch.float64)  # a large first coordinate per token

    def error(v):
        lo, hi = v.amin(dim=-1, keepdim=True), v.amax(dim=-1, keepdim=True)
        step = (hi - lo) / 7
        return float(((torch.round((v - lo) / step) * step + lo) - v).square().sum())

    random = torch.linalg.qr(torch.randn(rank, rank, generator=gen(6), dtype=torch.float64))[0]
    assert error(latent @ latent_rotation(rank)) < 0.5 * error(latent @ random) < 0.5 * error(latent)


def _variances(basis: torch.Tensor, k: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per latent coordinate calibration variance, basis (H, D, r) per head, k (N, H, D)."""
    latent = torch.einsum("nhd,hdr->nhr", k.double() - b.reshape(H, D), basis.double())
    return latent.square().mean(dim=0)  # (H, r)


@pytest.mark.parametrize("fraction, rank", [(0.5, 8), (0.75, 12)])
def test_rotate_basis_keeps_the_subspace_and_equalizes_latent_variances(fraction, rank):
    """The rotated basis spans the unrotated one's subspace (same reconstruction); its latents all get the mean
    variance (exactly at a power-of-two rank; closer than the sorted SVD order otherwise); no rank rounding."""
    x, w, b, k = linear_model()
    entry = [{"keys": part_entry(x, w, b, k)}]
    plain = fit_palu(recipe(keys=spec(bits=3, rank_fraction=fraction, rank_allocation="uniform")), entry)[0]
    rotated = fit_palu(recipe(keys=spec(bits=3, rank_fraction=fraction, rank_allocation="uniform", rotate_basis=True)), entry)[0]
    u, v = plain["keys.basis"].double(), rotated["keys.basis"].double()
    assert u.shape == v.shape == (H, D, rank)  # hadamard would round 12 down to 8
    assert torch.allclose(u @ u.transpose(1, 2), v @ v.transpose(1, 2), atol=1e-5)  # the same projector
    assert torch.allclose(v.transpose(1, 2) @ v, torch.eye(rank, dtype=torch.float64).expand(H, -1, -1), atol=1e-5)
    assert float(rotated["keys.relative_error"]) == pytest.approx(float(plain["keys.relative_error"]))
    before, after = _variances(u, k, b), _variances(v, k, b)
    assert torch.allclose(after.mean(dim=1), before.mean(dim=1), rtol=1e-5)  # energy kept
    spread = lambda var: float((var.amax(dim=1) / var.amin(dim=1)).max())  # noqa: E731
    if rank & (rank - 1) == 0:
        assert spread(after) < 1 + 1e-3 < 10 < spread(before)
    else:
        assert spread(after) < spread(before) / 3


@pytest.mark.parametrize("fraction", [0.5, 0.75])
def test_rotate_basis_improves_quantized_latents(fraction):
    """3-bit per-token codes of the rotated latents add less error to the rank-r projection than of the variance-sorted ones."""
    x, w, b, k = linear_model()
    entry = [{"keys": part_entry(x, w, b, k)}]
    blocks = blocks_of(k)
    errors = {}
    for rotate in (False, True):
        part = spec(bits=3, rank_fraction=fraction, rank_allocation="uniform", rotate_basis=rotate)
        fitted = fit_palu(recipe(keys=part), entry)[0]
        projected = quantizer(spec(bits=16, rank_fraction=fraction), fitted).roundtrip(blocks)  # float latents
        errors[rotate] = rel_error(projected, quantizer(part, fitted).roundtrip(blocks))
    assert errors[True] < 0.8 * errors[False]  # measured 0.63 (r = 8) and 0.52 (r = 12)


@pytest.mark.parametrize("changes, match", [
    ({"method": "uniform", "bits": 3}, "needs method 'palu'"),
    ({"bits": 16}, "16-bit latents"),
    ({"bits": 3, "hadamard": True}, "keep one"),
    ({"bits": 3, "rotate_basis": 1}, "true or false"),
])
def test_rotate_basis_recipe_errors(changes, match):
    fields = {"method": "palu", "rotate_basis": True, "pre_rope": True, "path": "keys", **changes}
    with pytest.raises(RecipeError, match=rf"'keys\.rotate_basis'.*{match}"):
        QuantSpec(**fields)


# ----- rank search ---------------------------------------------------------------------------


def _curve(decay: float, dim=16) -> torch.Tensor:
    """Error when keeping r of dim coordinates whose energies fall geometrically by ``decay``."""
    energy = decay ** torch.arange(dim, dtype=torch.float64)
    tail = torch.flip(torch.cumsum(torch.flip(energy, [0]), 0), [0])
    return torch.cat([tail, torch.zeros(1, dtype=torch.float64)])


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.77, 1.0])
def test_allocate_ranks_hits_total_exactly(fraction):
    curves = {(layer, part): _curve(0.5 + 0.1 * layer + (0.05 if part == "v" else 0)) for layer in range(4) for part in "kv"}
    ranks = allocate_ranks(curves, fraction, "fisher")
    assert sum(ranks.values()) == max(len(curves), round(fraction * 16 * len(curves)))
    assert all(1 <= r <= 16 for r in ranks.values())


def test_allocate_ranks_uniform_gives_equal_fractions():
    curves = {layer: _curve(0.3 + 0.2 * layer) for layer in range(4)}
    assert allocate_ranks(curves, 0.5, "uniform") == {layer: 8 for layer in range(4)}
    assert allocate_ranks(curves, 0.01, "uniform") == {layer: 1 for layer in range(4)}  # at least rank 1
    assert allocate_ranks(curves, {0: 0.25, 1: 0.5, 2: 0.75, 3: 1.0}, "uniform") == {0: 4, 1: 8, 2: 12, 3: 16}


def test_allocate_ranks_fisher_favours_slowly_falling_curve():
    curves = {"fast": _curve(0.3), "slow": _curve(0.95)}  # same energy scale at rank 0
    ranks = allocate_ranks(curves, 0.5, "fisher")
    assert ranks["slow"] > ranks["fast"]
    assert ranks["slow"] + ranks["fast"] == 16
    assert allocate_ranks(curves, 0.5, "fisher") == ranks  # deterministic
    tied = allocate_ranks({"a": _curve(0.5), "b": _curve(0.5)}, 0.5, "fisher")
    assert tied == {"a": 8, "b": 8}
    with pytest.raises(ValueError, match="'fisher', 'gradient' or 'uniform'"):
        allocate_ranks(curves, 0.5, "greedy")


def test_allocate_ranks_with_costs_counts_groups():
    """A key with 4 head groups pays 4 kept numbers per rank step; the budget is never exceeded."""
    curves = {"per_head": _curve(0.8, dim=16), "joint": _curve(0.8, dim=64)}
    costs = {"per_head": 4, "joint": 1}
    ranks = allocate_ranks(curves, 0.5, "fisher", costs)
    spent = 4 * ranks["per_head"] + ranks["joint"]
    assert 64 - 4 < spent <= 64


def test_error_curve_weighted_exact_matches_brute_force_and_approximation():
    x, w, b, k = linear_model()
    bases, _ = group_bases(num_kv_heads=H, head_dim=D, group_heads=2, whiten=True, weight=w, input_second_moment=moment(x))
    fisher = torch.rand(k.shape, generator=gen(4), dtype=torch.float64) ** 2
    exact = error_curve(bases, k, fisher, b, exact=True)
    kg, wg, bg = to_groups(k, 2), to_groups(fisher, 2), b.reshape(2, 2 * D)
    for r in (0, 5, 17, 32):
        u = bases[:, :, :r].double()
        centred = kg - bg
        residual = centred - torch.einsum("ngr,gir->ngi", torch.einsum("ngi,gir->ngr", centred, u), u)
        brute = float((wg * residual.square()).sum()) / k.shape[0]
        assert float(exact[r]) == pytest.approx(brute, rel=1e-4, abs=1e-8)
    approx = error_curve(bases, k, fisher, b)
    assert torch.allclose(approx[:-1], exact[:-1], rtol=0.05)  # diagonal approximation, close on real-ish data
    # exact when the weights are constant per token and group
    per_token = to_groups(fisher, 2).mean(dim=-1, keepdim=True).expand(-1, 2, 2 * D).reshape(k.shape)
    assert torch.allclose(error_curve(bases, k, per_token, b), error_curve(bases, k, per_token, b, exact=True), rtol=1e-4, atol=1e-8)
    # and without weights it is the discarded energy
    assert torch.allclose(error_curve(bases, k, None, b), error_curve(bases, k, torch.ones_like(k), b, exact=True), rtol=1e-4, atol=1e-8)


# ----- fit_palu ----------------------------------------------------------------------------


def test_fit_palu_joint_allocation_across_layers_and_parts():
    """Two layers, K and V: ranks sum to the budget; the layer with the flatter spectrum gets more rank."""
    layers = []
    for layer, decay in enumerate((0.5, 0.97)):
        x = correlated_inputs(seed=layer, decay=decay)
        entry = {}
        for part, seed in (("keys", 10), ("values", 20)):
            _, w, b, _ = linear_model(seed=seed + layer)
            k = (x @ w.T + b).reshape(-1, H, D)
            entry[part] = part_entry(x, w, b, k, weights=torch.ones(k.shape))
        layers.append(entry)
    keys, values = spec("keys", bits=3, rank_fraction=0.5), spec("values", bits=3, rank_fraction=0.5)
    fitted = fit_palu(recipe(keys=keys, values=values), layers)
    ranks = {(i, part): f[f"{part}.basis"].shape[-1] for i, f in enumerate(fitted) for part in ("keys", "values")}
    assert sum(ranks.values()) == 0.5 * D * 4  # per-head groups: budget in rank units per group, equal costs
    assert ranks[(1, "keys")] > ranks[(0, "keys")] and ranks[(1, "values")] > ranks[(0, "values")]
    for f in fitted:
        assert set(f) == {f"{p}.{n}" for p in ("keys", "values") for n in ("basis", "bias", "relative_error")}
        assert f["keys.bias"].shape == (H, D) and f["keys.basis"].dtype == torch.float32
        assert f["keys.relative_error"].dim() == 0 and 0 <= float(f["keys.relative_error"]) < 1
    uniform = fit_palu(recipe(keys=spec("keys", rank_allocation="uniform"), values=spec("values", rank_allocation="uniform")), layers)
    assert all(f[f"{p}.basis"].shape[-1] == D // 2 for f in uniform for p in ("keys", "values"))


def test_fit_palu_only_palu_parts():
    x, w, b, k = linear_model()
    fitted = fit_palu(recipe(values=spec("values")), [{"values": part_entry(x, w, b, k)}])
    assert set(fitted[0]) == {"values.basis", "values.bias", "values.relative_error"}
    assert fit_palu(recipe(), [{}, {}]) == [{}, {}]


def test_fit_palu_errors():
    x, w, b, k = linear_model()
    with pytest.raises(RecipeError, match=r"'keys\.group_heads'.*4 KV heads"):
        fit_palu(recipe(keys=spec(group_heads=3)), [{"keys": part_entry(x, w, b, k)}])
    with pytest.raises(RecipeError, match=r"'values\.group_heads'"):
        fit_palu(recipe(values=spec("values", group_heads=8)), [{"values": part_entry(x, w, b, k)}])
    with pytest.raises(RecipeError, match=r"rank_allocation"):
        fit_palu(recipe(keys=spec(), values=spec("values", rank_allocation="uniform")),
                 [{"keys": part_entry(x, w, b, k), "values": part_entry(x, w, b, k)}])
    with pytest.raises(DataError, match="no 'keys' entry"):
        fit_palu(recipe(keys=spec()), [{}])
    with pytest.raises(DataError, match="Fisher weights"):
        fit_palu(recipe(keys=spec()), [{"keys": part_entry(x, w, b, k, weights=torch.ones(3, H, D))}])
    with pytest.raises(NotImplementedError, match="fit_palu"):
        quantizer_class("palu").fit(spec(), D, S, k.float())
    with pytest.raises(ArtifactError, match="calibrated tensors"):
        PaluQuantizer(spec(), D, S)


# ----- the quantizer: storage and bytes ----------------------------------------------------------


def _fitted_random(groups: int, width: int, rank: int) -> dict:
    basis = torch.linalg.qr(torch.randn(groups, width, width, generator=gen(5)))[0][:, :, :rank].contiguous()
    return {"basis": basis, "bias": torch.randn(groups, width, generator=gen(6))}


@pytest.mark.parametrize(
    "bits, hadamard, group_heads, rank, group_size",
    [
        (16, False, 1, 5, 32),
        (16, False, 0, 37, 32),
        (3, False, 1, 12, 32),  # one scale group of 12
        (3, False, 0, 40, 32),  # 32 + a partial group of 8
        (2, True, 1, 12, 32),  # padded to 16
        (4, True, 0, 40, 16),  # padded to 64, 4 scale groups
        (8, False, 2, 24, 8),
    ],
)
def test_block_nbytes_equals_stored_bytes(bits, hadamard, group_heads, rank, group_size):
    g = H if group_heads == 0 else group_heads
    groups = H // g
    fitted = _fitted_random(groups, g * D, rank)
    q = PaluQuantizer(spec(bits=bits, hadamard=hadamard, group_heads=group_heads, group_size=group_size), D, S, torch.float16, fitted)
    x = torch.randn(2, H, 3, S, D, generator=gen(7))
    storage = q.encode(x)
    for name, t in storage.items():
        assert t.shape[:3] == (2, groups, 3), name
    stored = sum(t.numel() * t.element_size() for t in storage.values())
    assert q.block_nbytes() * 2 * H * 3 == stored  # per (sequence, KV head) block
    assert q.bits_per_element() == pytest.approx(stored * 8 / (2 * H * 3 * S * D))
    out = q.decode(storage)
    assert out.shape == x.shape and out.dtype == torch.float16 and torch.isfinite(out).all()


def test_16_bit_latent_stores_r_numbers_per_token_and_group():
    rank = 24
    q = PaluQuantizer(spec(bits=16, group_heads=2), D, S, torch.float16, _fitted_random(2, 2 * D, rank))
    storage = q.encode(torch.randn(1, H, 2, S, D, generator=gen(8)))
    assert set(storage) == {"latent"}
    assert storage["latent"].shape == (1, 2, 2, S, rank) and storage["latent"].dtype == torch.float16
    assert q.block_nbytes() == S * rank * 2 // 2  # per head: the group's S*r fp16 numbers shared by 2 heads
    half = PaluQuantizer(spec(bits=16), D, S, torch.float16, _fitted_random(H, D, D // 2))
    assert half.bits_per_element() == 8.0  # 50% rank at 16 bits


def test_quantizer_checks_geometry():
    q = PaluQuantizer(spec(bits=16), D, S, torch.float16, _fitted_random(H, D, 8))
    with pytest.raises(ArtifactError, match="another model"):
        q.encode(torch.randn(1, H + 1, 1, S, D))
    with pytest.raises(ArtifactError, match="shape"):
        PaluQuantizer(spec(bits=16), D, S, torch.float16, {"basis": torch.randn(H, D + 1, 4)})


def test_quantized_error_falls_with_bits_and_rank():
    x, w, b, k = linear_model()
    blocks = blocks_of(k)
    errors = {}
    for fraction in (0.5, 1.0):
        fitted = fit_palu(recipe(keys=spec(rank_fraction=fraction, rank_allocation="uniform")), [{"keys": part_entry(x, w, b, k)}])[0]
        for bits in (2, 4, 8, 16):
            errors[fraction, bits] = rel_error(blocks, quantizer(spec(bits=bits, rank_fraction=fraction), fitted).roundtrip(blocks))
    for fraction in (0.5, 1.0):
        assert errors[fraction, 2] > errors[fraction, 4] > errors[fraction, 8] >= errors[fraction, 16] * 0.99
    assert errors[0.5, 16] > errors[1.0, 16]


def test_recipe_summary_names_the_latents_mixing():
    from kvtool.recipe_summary import tensor_summary

    assert tensor_summary(spec(bits=3, rotate_basis=True)).endswith("3-bit latents + rotated basis")
    assert tensor_summary(spec(bits=3, hadamard=True)).endswith("3-bit latents + Hadamard")
    assert tensor_summary(spec(bits=3)).endswith("3-bit latents")
