"""TurboQuant: the codebook from the math, the rotation (orthogonal, fused into the query), QJL unbiasedness, SQNR,
the outlier channel split of the fractional rates."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from kvtool.errors import RecipeError
from kvtool.methods.base import BlockQuantizer
from kvtool.methods.quant.turboquant import (TurboQuantizer, lloyd_max_codebook, pack_mask, random_orthogonal, rotate,
                                            rotation_signs, unpack_mask, unrotate)
from kvtool.recipe import QuantSpec, load_recipe
from kvtool.recipe_summary import tensor_summary
from tests.test_kernels import add_sides, devices

D, S = 64, 32


def tq(bits=3, extra_bits=0.0, qjl=False, seed=0, head_dim=D, path="keys", outlier_channel_fraction=None) -> TurboQuantizer:
    spec = QuantSpec(method="turboquant", bits=bits, extra_bits=extra_bits, qjl=qjl, seed=seed, path=path,
                     axis="channel" if path == "keys" else "token", outlier_channel_fraction=outlier_channel_fraction)
    return TurboQuantizer(spec, head_dim, S, torch.float32)


def sqnr_db(x, y) -> float:
    return float(10 * torch.log10(x.square().sum() / (y.float() - x).square().sum()))


def test_lloyd_max_codebook_is_the_gaussian_one_at_large_dim_and_a_fixed_point():
    # one coordinate of a uniform unit vector in R^D -> N(0, 1/D): Lloyd-Max levels of N(0,1) are known constants
    for bits, known in ((1, [0.7979]), (2, [0.4528, 1.5104])):
        levels = lloyd_max_codebook(1024, bits) * math.sqrt(1024)
        torch.testing.assert_close(levels[2 ** (bits - 1):], torch.tensor(known), atol=3e-3, rtol=0)
        torch.testing.assert_close(levels, -levels.flip(0))  # symmetric
    # centroid condition on samples of the exact law (uniform unit vectors' coordinates)
    g = torch.Generator().manual_seed(0)
    u = torch.randn(20000, D, generator=g)
    t = (u / u.norm(dim=-1, keepdim=True)).flatten()
    codebook = lloyd_max_codebook(D, 3)
    cell = torch.bucketize(t, (codebook[1:] + codebook[:-1]) / 2)
    centroids = torch.stack([t[cell == i].mean() for i in range(8)])
    torch.testing.assert_close(centroids, codebook, atol=2e-3 / math.sqrt(D) * 8, rtol=0)


def test_rotation_is_orthogonal_and_inverted_exactly():
    signs = rotation_signs(D, 7)
    eye = torch.eye(D)
    matrix = rotate(eye, signs)  # rows: the rotation of each basis vector
    torch.testing.assert_close(matrix @ matrix.T, eye, atol=1e-5, rtol=0)
    x = torch.randn(5, D)
    torch.testing.assert_close(unrotate(rotate(x, signs), signs), x, atol=1e-5, rtol=0)
    assert not torch.allclose(rotation_signs(D, 7), rotation_signs(D, 8))  # the seed matters
    matrix = random_orthogonal(48, 7)  # the rotation of a non-power-of-two channel set (3/4 of 64)
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(48), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(bits=3), dict(bits=2, extra_bits=0.5), dict(bits=3, qjl=True), dict(bits=4, extra_bits=0.5, qjl=True),
                                    dict(bits=2, extra_bits=0.5, outlier_channel_fraction=0.25),
                                    dict(bits=3, extra_bits=0.5, outlier_channel_fraction=0.25, qjl=True)])
def test_attention_with_the_rotation_fused_into_the_query_equals_attention_over_unrotated_decoded_keys(kwargs):
    q = tq(**kwargs)
    x = torch.randn(3, 1, S, D) * 2 + 0.5  # blocks (N, 1, S, D)
    blocks = q.encode_blocks(x, torch.zeros(3, dtype=torch.long))
    chunk = {name: t.reshape(1, 3, *t.shape[1:]) for name, t in blocks.items()}  # (Sc=1, nb=3, ...)
    group = torch.zeros(1, dtype=torch.long)
    query = torch.randn(1, 1, 4, D)  # (Sc, g, R, D)
    reference = BlockQuantizer.chunk_scores(q, query, chunk, group)  # decode (un-rotate) the keys, then q . k
    torch.testing.assert_close(q.chunk_scores(query, chunk, group), reference, atol=1e-4, rtol=1e-4)
    probs = torch.softmax(torch.randn(1, 1, 4, 3 * S), dim=-1)
    torch.testing.assert_close(q.chunk_values(probs, chunk, group), BlockQuantizer.chunk_values(q, probs, chunk, group),
                               atol=1e-5, rtol=1e-4)


def _pairs(n: int, seed: int = 0):
    """n (query, key) pairs with correlated directions (q . k clearly positive), as attention has."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, D, generator=g)
    return k + 0.7 * torch.randn(n, D, generator=g), k


def test_qjl_inner_products_are_unbiased_and_the_plain_codes_are_not():
    queries, keys = _pairs(1024)
    estimate, codes_only = [], []
    zero = torch.zeros(1, dtype=torch.long)
    for i in range(keys.shape[0] // S):  # a fresh rotation and sketch per block of S pairs: the estimator's randomness
        q = tq(bits=2, qjl=True, seed=i)  # 1-bit codes + 1-bit QJL residual
        k, qu = keys[i * S : (i + 1) * S], queries[i * S : (i + 1) * S]  # (S, D) each
        blocks = q.encode_blocks(k.reshape(1, 1, S, D), zero)
        chunk = {name: t[:, None] for name, t in blocks.items()}
        scores = q.chunk_scores(qu.reshape(1, 1, S, D), chunk, zero)[0, 0]  # (S queries, S keys)
        estimate.append(scores.diagonal())
        on = q._on(keys.device)[0]
        y_hat = q._reconstruct(q.instances[0], blocks, on)[0]  # (S, D): the same codes without the correction
        codes_only.append(blocks["norm"][0].float() * (rotate(qu, on["signs"]) * y_hat).sum(dim=-1))
    estimate, codes_only = torch.cat(estimate), torch.cat(codes_only)
    truth = (queries * keys).sum(dim=-1)
    scale = float(truth.abs().mean())
    bias = (estimate - truth).mean() / scale
    stderr = (estimate - truth).std() / scale / math.sqrt(len(estimate))
    plain_bias = (codes_only - truth).mean() / scale
    assert abs(float(bias)) < 3 * float(stderr) + 0.01  # unbiased (mean error ~ 0 within its noise)
    assert float(plain_bias) < -0.15  # 1-bit Lloyd-Max codes alone shrink q . k by ~ 1 - 2/pi


@pytest.mark.parametrize("bits, extra, floor_db", [(2, 0.0, 9.0), (2, 0.5, 12.5), (3, 0.0, 14.5), (3, 0.5, 18.0), (4, 0.0, 20.0)])
def test_sqnr_floors_per_bit_width_with_no_calibration(bits, extra, floor_db):
    # measured on this data: 9.9 / 13.7 / 15.2 / 19.2 / 20.9 dB; 6.02 dB/bit gives 12.0 / 15.1 / 18.1 / 21.1 / 24.1
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 8, S, D, generator=g)
    x[..., 3] = x[..., 3] * 8 + 5  # an outlier channel: the rotation spreads it (the split isolates it)
    q = tq(bits=bits, extra_bits=extra)
    assert sqnr_db(x, q.roundtrip(x)) > floor_db
    # codes + one fp16 norm per token and instance (+ a D-bit outlier mask per block with the split)
    assert q.bits_per_element() == pytest.approx(bits + extra + (32 / D + 1 / S if extra else 16 / D))


def _with_outlier_channels(seed: int, channels: int = 4) -> tuple[torch.Tensor, list[int]]:
    """(1, 2, 8, S, D) Gaussian data whose ``channels`` random channels are large and offset, as KV caches have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, 8, S, D, generator=g)
    picked = torch.randperm(D, generator=g)[:channels].tolist()
    x[..., picked] = x[..., picked] * 6 + torch.linspace(-8, 8, channels)
    return x, sorted(picked)


def rotated_half_split(x: torch.Tensor, bits: int, seed: int = 0) -> torch.Tensor:
    """The former fractional mode, for comparison: one rotation of all D channels, the first half of the
    rotated coordinates coded at bits + 1, the rest at bits, one fp16 norm per token."""
    norm = x.norm(dim=-1, keepdim=True)
    y = rotate(x / norm, rotation_signs(D, seed))  # (..., D)
    parts = []
    for part, b in ((y[..., : D // 2], bits + 1), (y[..., D // 2 :], bits)):
        codebook = lloyd_max_codebook(D, b)
        parts.append(codebook[torch.bucketize(part.contiguous(), (codebook[1:] + codebook[:-1]) / 2)])
    return unrotate(torch.cat(parts, dim=-1), rotation_signs(D, seed)) * norm.half().float()


@pytest.mark.parametrize("bits, fraction, gain_db", [(2, 0.5, 2.0), (2, 0.25, 2.0), (3, 0.5, 2.0), (3, 0.25, 2.0)])
def test_outlier_split_beats_the_rotated_half_split_on_data_with_outlier_channels(bits, fraction, gain_db):
    x, _ = _with_outlier_channels(seed=bits)
    split = sqnr_db(x, tq(bits=bits, extra_bits=0.5, outlier_channel_fraction=fraction).roundtrip(x))
    assert split > sqnr_db(x, rotated_half_split(x, bits)) + gain_db


def test_outlier_split_is_exact_per_block_channels_bits_and_bytes():
    q = tq(bits=2, extra_bits=0.5, outlier_channel_fraction=0.25)  # 16 of 64 channels at 4 bits, 48 at 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 1, S, D, generator=g)  # 2 blocks (N, 1, S, D)
    picked = [sorted(torch.randperm(D, generator=g)[:16].tolist()) for _ in range(2)]  # each block its own set
    for block, channels in enumerate(picked):
        x[block, 0, :, channels] = x[block, 0, :, channels] * 4 + 3
    blocks = q.encode_blocks(x, torch.zeros(2, dtype=torch.long))
    mask = unpack_mask(blocks["outlier_mask"])  # (2, D)
    for block, channels in enumerate(picked):
        assert mask[block].nonzero().flatten().tolist() == channels
        bits = q.channel_bits(mask[block])
        assert bits[channels].tolist() == [4] * 16 and int(bits.sum()) == 16 * 4 + 48 * 2
        assert float(bits.float().mean()) == 2.5
    assert torch.equal(unpack_mask(pack_mask(mask)), mask)
    shapes = {name: tuple(t.shape[1:]) for name, t in blocks.items()}
    assert shapes == {"outlier_mask": (D // 8,), "outlier_codes": (S * 4 // 8, 16), "outlier_norm": (S,),
                      "codes": (S * 2 // 8, 48), "norm": (S,)}
    assert shapes == {name: shape for name, (shape, _) in q.block_spec().items()}
    # per token: 16 x 4 + 48 x 2 code bits, two fp16 norms; per block: the 64-bit mask
    assert q.block_nbytes() == S * (16 * 4 + 48 * 2) // 8 + S * 2 * 2 + D // 8
    decoded = q.decode_blocks(blocks, torch.zeros(2, dtype=torch.long)).float()
    for block, channels in enumerate(picked):  # the outlier channels are coded at 4 bits: smaller relative error
        rest = [c for c in range(D) if c not in channels]
        assert sqnr_db(x[block, 0, :, channels], decoded[block, 0, :, channels]) > sqnr_db(x[block, 0, :, rest],
                                                                                          decoded[block, 0, :, rest]) + 6


@pytest.mark.parametrize("name, key_bits, value_bits", [("turboquant-2.5bit", (16, 4, 48, 2), (32, 3, 32, 2)),
                                                        ("turboquant-3.5bit", (16, 5, 48, 3), (32, 4, 32, 3))])
def test_the_fractional_recipes_use_the_outlier_split(name, key_bits, value_bits):
    # (outlier channels, their bits, other channels, their bits) at head_dim 64; fails if the split turns off
    recipe = load_recipe(name)
    x, picked = _with_outlier_channels(seed=7)
    for spec, expected in ((recipe.keys, key_bits), (recipe.values, value_bits)):
        q = TurboQuantizer(spec, D, S, torch.float32)
        assert [(i.dim, i.bits) for i in q.instances] == [expected[:2], expected[2:]]
        assert "outlier_mask" in q.block_spec()
        assert tensor_summary(spec) == (f"turboquant {spec.bits + 0.5:g}-bit, {expected[0] / D:.0%} outlier channels at "
                                        f"{expected[1]}-bit per block")  # what `kvtool recipes` shows
        masks = unpack_mask(q.encode(x)["outlier_mask"]).reshape(-1, D)  # every block found the outlier channels
        assert bool(masks[:, picked].all())
        assert sqnr_db(x, q.roundtrip(x)) > sqnr_db(x, rotated_half_split(x, spec.bits)) + 2.0


def test_qjl_is_keys_only_and_needs_a_power_of_two_head_dim():
    with pytest.raises(RecipeError, match="keys only"):
        QuantSpec(method="turboquant", bits=3, qjl=True, path="values", axis="token")
    with pytest.raises(RecipeError, match="power-of-two head_dim"):
        tq(head_dim=96)
    with pytest.raises(RecipeError, match="extra_bits"):
        QuantSpec(method="turboquant", bits=3, extra_bits=0.75, path="keys")
    with pytest.raises(RecipeError, match="outlier_channel_fraction"):
        QuantSpec(method="turboquant", bits=3, extra_bits=0.5, outlier_channel_fraction=0.1, path="keys")
    with pytest.raises(RecipeError, match="outlier_channel_fraction"):
        QuantSpec(method="turboquant", bits=3, outlier_channel_fraction=0.5, path="keys")


# --- a quarter bit over the codes: extra_bits 0.25 ---------------------------------------------------------------

@pytest.mark.parametrize("fraction, outliers, outlier_bits", [(0.25, 16, 4), (0.125, 8, 5)])
def test_a_quarter_bit_split_codes_a_quarter_at_one_more_bit_or_an_eighth_at_two(fraction, outliers, outlier_bits):
    q = tq(bits=3, extra_bits=0.25, outlier_channel_fraction=fraction)
    assert [(i.dim, i.bits) for i in q.instances] == [(outliers, outlier_bits), (D - outliers, 3)]
    assert float(q.channel_bits(torch.arange(D) < outliers).float().mean()) == 3.25
    assert q.block_nbytes() == S * (outliers * outlier_bits + (D - outliers) * 3) // 8 + S * 2 * 2 + D // 8
    assert QuantSpec(method="turboquant", bits=3, extra_bits=0.25, path="keys").outlier_channel_fraction == 0.25
    x, picked = _with_outlier_channels(seed=11)
    masks = unpack_mask(q.encode(x)["outlier_mask"]).reshape(-1, D)
    assert bool(masks[:, picked].all())  # every block found the outlier channels
    # between 3 bits and the half-bit split with the outliers as many bits up (twice the outlier channels)
    half = tq(bits=3, extra_bits=0.5, outlier_channel_fraction=2 * fraction)
    quarter = sqnr_db(x, q.roundtrip(x))
    assert sqnr_db(x, tq(bits=3).roundtrip(x)) + 1.0 < quarter < sqnr_db(x, half.roundtrip(x))


@pytest.mark.parametrize("extra, fraction", [(0.25, 0.5), (0.5, 0.125), (0.25, 0.0625)])
def test_a_split_puts_the_outliers_one_or_two_bits_above_the_rest(extra, fraction):
    with pytest.raises(RecipeError, match="outlier_channel_fraction"):
        QuantSpec(method="turboquant", bits=3, extra_bits=extra, outlier_channel_fraction=fraction, path="keys")


QUARTER_SIDES = {
    "turboquant-k3.25-eighth-v2.25": (
        QuantSpec(method="turboquant", bits=3, extra_bits=0.25, outlier_channel_fraction=0.125, norm_bits=8, path="keys"),
        QuantSpec(method="turboquant", bits=2, extra_bits=0.25, path="values")),
}


@pytest.fixture
def quarter_sides(monkeypatch):
    add_sides(monkeypatch, QUARTER_SIDES)


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
@pytest.mark.parametrize("head_dim, gqa, bs", [(64, 4, 32), (256, 1, 16)])
def test_cpu_kernel_reads_quarter_bit_splits_as_the_dense_reference(head_dim, gqa, bs, quarter_sides):
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention
    from tests.test_cpu_decode import _cpu_args
    from tests.test_kernels import build_case

    for side in QUARTER_SIDES:
        args, reference = build_case(side, head_dim, gqa, "cpu", seed=head_dim + bs, bs=bs)
        torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("head_dim, gqa, bs", [(64, 4, 32), (256, 1, 16)])
def test_triton_kernel_reads_quarter_bit_splits_as_the_dense_reference(head_dim, gqa, bs, device, quarter_sides):
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention
    from tests.test_kernels import build_case

    for side in QUARTER_SIDES:
        args, reference = build_case(side, head_dim, gqa, device, seed=head_dim + bs + 1, bs=bs)
        out = paged_decode_attention(**args, kernel="general")
        torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)
