"""The CPU (Numba) decode kernel against the torch reference, and the ``numba`` backend end to end.

Reference for the kernel: the same dense softmax over the blocks decoded by the formats' own `decode_blocks` that the
Triton kernels are tested against (`tests/test_kernels.py::build_case`: ragged streams, empty and one-token ones
included). End to end: the numba backend generates the torch backend's tokens and leaves the same store behind.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import numpy as np
import pytest
import torch

from kvtool.errors import RuntimeConfigError
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import CacheSpec, EvictionSpec, QuantSpec, Recipe, load_recipe
from kvtool.runtime.attach import CompressedRuntime
from kvtool.runtime.backend import resolve_backend
from kvtool.runtime.store import take_rows
from tests.test_kernels import build_case
from tests.tiny_models import featured_model, tiny_model, tiny_tokenizer_free_inputs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")

SIDES = [
    "uniform-2", "uniform-3", "uniform-4", "uniform-8", "uniform-4-token-keys-channel-values", "fp8-dynamic", "fp8-static",
    "int8-static-channel-int4-layer", "int3-static-head-int2-channel", "nuq-3-1pct", "nuq-2-5pct-4-dense-channel-values",
    "turboquant-3", "turboquant-2.5-3.5",
]
SHAPES = [(64, 1), (64, 4), (128, 8), (256, 1)]  # (head_dim, GQA ratio)


def _cpu_args(args: dict) -> dict:
    """`build_case`'s Triton arguments as `cpu_decode_attention` takes them (host lengths, each stream's KV head)."""
    out = {k: v for k, v in args.items() if k not in ("stream_group",)}
    out["float_len"] = args["float_len"].numpy()
    out["body_len"] = args["body_len"].numpy()
    out["stream_head"] = args["stream_group"]  # streams alternate between two KV heads (per-head tables)
    return out


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("head_dim, gqa", SHAPES)
def test_cpu_kernel_equals_the_dense_reference(side, head_dim, gqa):
    from kvtool.runtime.kernels.cpu_decode import covers, cpu_decode_attention

    args, reference = build_case(side, head_dim, gqa, "cpu", seed=head_dim + gqa + 3)
    assert covers(args["formats"], torch.float16, head_dim) is None
    out = cpu_decode_attention(**_cpu_args(args))
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("source, side, rotary, interleaved", [
    ("sequence", "uniform-4", 1.0, False),  # recorded sequence positions (padding, custom ids)
    ("slots", "uniform-3", 1.0, False),  # an evicting store: positions per body slot
    ("tokens", "int8-static-channel-int4-layer", 1.0, True),  # slots are positions; Cohere's interleaved pairs
    ("sequence", "uniform-4-token-keys-channel-values", 0.5, False),  # per-token key groups; partial rotary (Phi-3)
    ("tokens", "fp8-static", 1.0, False),
    ("slots", "nuq-3-1pct", 1.0, False),  # KVQuant: codebook values, outliers placed before the rotation
    ("sequence", "nuq-2-5pct-4-dense-channel-values", 0.5, True),
    ("tokens", "nuq-4-2pct-token-keys-channel-values", 1.0, False),  # per-token key groups with outliers
])
@pytest.mark.parametrize("head_dim, gqa", [(64, 4), (256, 1)])
def test_cpu_kernel_rotates_pre_rope_keys_at_their_true_positions(source, side, rotary, interleaved, head_dim, gqa):
    """Body keys stored before RoPE (KVQuant's ``keys.pre_rope``): decoded, then rotated in the kernel at each token's
    position, read where the store keeps it, with cos / sin tables computed as the torch path does."""
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention

    rope = (source, int(head_dim * rotary), interleaved)
    args, reference = build_case(side, head_dim, gqa, "cpu", seed=head_dim + gqa + 5, rope=rope)
    out = cpu_decode_attention(**_cpu_args(args))
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
    unrotated = cpu_decode_attention(**{**_cpu_args(args), "rope": None})
    assert (unrotated - reference).abs().max() > 1e-2  # the rotation is really applied (a test that can fail)


@pytest.mark.parametrize("parts", [2, 3, 7])
@pytest.mark.parametrize("side", ["uniform-4", "uniform-4-token-keys-channel-values", "float", "turboquant-2.5-3.5"])
def test_cpu_kernel_split_into_parts_on_threads_equals_the_dense_reference(side, parts):
    """Each stream's tokens cut into ``parts`` pieces of whole blocks (more pieces than some streams have blocks:
    empty pieces), run on two threads and merged by their softmax maxima and sums: the same attention, soft-capped
    and with learned sinks too."""
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for softcap, sinks in ((None, False), (4.0, True)):
            args, reference = build_case(side, 64, 4, "cpu", softcap=softcap, sinks=sinks, seed=parts + 17)
            if side == "float":  # a float-only store: the float region alone
                names = ("q", "new_k", "new_v", "float_k", "float_v", "float_table")
                reference = _float_only_reference(args, softcap, args["sink_logits"])
                out = cpu_decode_attention(*(args[n] for n in names), args["float_len"].numpy(), softcap=softcap,
                                           sink_logits=args["sink_logits"], parallel=True, parts=parts)
            else:
                out = cpu_decode_attention(**_cpu_args(args), parallel=True, parts=parts)
            torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(threads)


def test_both_float16_widenings_are_exact_for_every_bit_pattern():
    """The kernel widens float16 by LLVM's ``fpext`` (F16C / ARM) or, on CPUs without it, by bit arithmetic: both give
    numpy's float32 for all 65536 patterns (subnormals, infinities and nans included)."""
    from numba import njit

    from kvtool.runtime.kernels.cpu_decode_kernel import _fpext_half, half_bits_to_float

    @njit
    def widen(bits, native, out):
        for i in range(bits.shape[0]):
            out[i] = _fpext_half(bits[i]) if native else half_bits_to_float(bits[i])

    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    expected = bits.view(np.float16).astype(np.float32)
    for native in (True, False):
        out = np.empty(65536, np.float32)
        widen(bits, native, out)
        assert np.array_equal(out.view(np.uint32)[~np.isnan(expected)], expected.view(np.uint32)[~np.isnan(expected)])
        assert np.isnan(out[np.isnan(expected)]).all()


def test_held_numpy_views_go_with_their_tensors():
    """The kernel's cached numpy views of pool tensors hold their memory: each goes when its tensor object goes, so a
    grown pool's old tensors and a deleted cache's blocks are freed (nothing kept until some later call)."""
    import gc

    from kvtool.runtime.kernels import cpu_decode

    pool = torch.zeros(64, 16, 1, 8, dtype=torch.float16)
    view = cpu_decode._held_view(pool, "3d")
    assert view.shape == (64, 16, 8) and cpu_decode._held_view(pool, "3d") is view  # made once
    key = (id(pool), "3d")
    del pool, view
    gc.collect()
    assert key not in cpu_decode._VIEWS


def test_held_turboquant_sides_are_made_once_remade_for_new_tensors_and_go_with_their_codes():
    """The kernel's tuple of a TurboQuant body side (views of its pool tensors, rotations in their fast form) is made
    once per set of tensors and format; a side with any new tensor (a grown pool, another rotation) gets its own; the
    entry goes when its codes tensor does (nothing keeps a freed pool's memory)."""
    import gc

    from kvtool.runtime.kernels import cpu_decode

    args, _ = build_case("turboquant-2.5-3.5", 64, 1, "cpu", seed=3, bs=16)
    side, fmt = dict(args["body"][0]), args["formats"][0]
    held = cpu_decode._held_rotated_side(side, fmt)
    assert cpu_decode._held_rotated_side(dict(side), fmt) is held  # a new dict of the same tensors: the same tuple
    regrown = {name: t.clone() for name, t in side.items()}
    other = cpu_decode._held_rotated_side(regrown, fmt)
    assert other is not held and np.shares_memory(other[2], regrown["codes"].numpy())
    key = id(regrown["codes"])
    assert key in cpu_decode._SIDES
    regrown["norm"] = regrown["norm"].clone()  # one tensor replaced: made again
    assert cpu_decode._held_rotated_side(regrown, fmt) is not other
    del regrown, other
    gc.collect()
    assert key not in cpu_decode._SIDES


def _float_only_reference(args: dict, softcap=None, sink_logits=None) -> torch.Tensor:
    """Dense attention over each stream's float tokens and the new token (a store with no body: float recipes)."""
    out = []
    fbs, d = args["float_k"].shape[1], args["q"].shape[-1]
    for s, n in enumerate(args["float_len"].tolist()):
        ids = args["float_table"][s, : -(-n // fbs)].long()
        keys = torch.cat([args["float_k"][ids].reshape(-1, d)[:n].float(), args["new_k"][s : s + 1]])
        values = torch.cat([args["float_v"][ids].reshape(-1, d)[:n].float(), args["new_v"][s : s + 1]])
        logits = args["q"][s] @ keys.T
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        if sink_logits is not None:
            logits, values = torch.cat([logits, sink_logits[s][:, None]], 1), torch.cat([values, torch.zeros(1, d)])
        out.append(torch.softmax(logits, -1) @ values)
    return torch.stack(out)


@pytest.mark.parametrize("head_dim, gqa", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_kernel_reads_float_only_stores(head_dim, gqa, dtype):
    from kvtool.runtime.kernels.cpu_decode import covers, cpu_decode_attention

    args, _ = build_case("float", head_dim, gqa, "cpu", seed=head_dim + gqa + 5)
    args["float_k"], args["float_v"] = args["float_k"].to(dtype), args["float_v"].to(dtype)
    assert covers(None, dtype, head_dim) is None
    out = cpu_decode_attention(
        args["q"], args["new_k"], args["new_v"], args["float_k"], args["float_v"], args["float_table"], args["float_len"].numpy()
    )
    torch.testing.assert_close(out, _float_only_reference(args), rtol=1e-4, atol=1e-4)


def test_cpu_kernel_soft_caps_and_adds_learned_sinks():
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention

    args, reference = build_case("uniform-3", 64, 4, "cpu", softcap=5.0, sinks=True, seed=7)
    torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)
    args, _ = build_case("float", 64, 4, "cpu", seed=8)
    sinks = torch.randn(args["q"].shape[:2], generator=torch.Generator().manual_seed(1))
    out = cpu_decode_attention(
        args["q"], args["new_k"], args["new_v"], args["float_k"], args["float_v"], args["float_table"], args["float_len"].numpy(),
        softcap=3.0, sink_logits=sinks,
    )
    torch.testing.assert_close(out, _float_only_reference(args, 3.0, sinks), rtol=1e-4, atol=1e-4)


# TurboQuant sides beyond the kernel matrix's: the split on one side only, Gemma 3's bundled rates (5-bit outliers),
# and the QJL residual the CPU kernel does not read
TURBOQUANT_SIDES = {
    "turboquant-3.5-split-keys-3-values": (
        QuantSpec(method="turboquant", bits=3, extra_bits=0.5, outlier_channel_fraction=0.25, path="keys"),
        QuantSpec(method="turboquant", bits=3, path="values")),
    "turboquant-4-keys-2.5-split-values": (
        QuantSpec(method="turboquant", bits=4, path="keys"),
        QuantSpec(method="turboquant", bits=2, extra_bits=0.5, path="values")),
    "turboquant-k3.5-v2.5": (
        QuantSpec(method="turboquant", bits=3, extra_bits=0.5, outlier_channel_fraction=0.25, path="keys"),
        QuantSpec(method="turboquant", bits=2, extra_bits=0.5, outlier_channel_fraction=0.5, path="values")),
    "turboquant-qjl": (QuantSpec(method="turboquant", bits=3, qjl=True, path="keys"),
                       QuantSpec(method="turboquant", bits=3, path="values")),
    "turboquant-k3.5-v2.5-query-scale": (
        QuantSpec(method="turboquant", bits=3, extra_bits=0.5, outlier_channel_fraction=0.25, channel_scale="query"),
        QuantSpec(method="turboquant", bits=2, extra_bits=0.5, outlier_channel_fraction=0.5, path="values")),
    "turboquant-3-query-scale": (QuantSpec(method="turboquant", bits=3, channel_scale="query"),
                                 QuantSpec(method="turboquant", bits=3, path="values")),
    # ``split_rotation: kronecker``: the regular instances' 48 / 96 / 192 channels rotate by m fast transforms and M
    "turboquant-k3.5-v2.5-kronecker": (
        QuantSpec(method="turboquant", bits=3, extra_bits=0.5, outlier_channel_fraction=0.25, split_rotation="kronecker",
                  path="keys"),
        QuantSpec(method="turboquant", bits=2, extra_bits=0.25, outlier_channel_fraction=0.25, split_rotation="kronecker",
                  path="values")),
}


# KVQuant (nuq) sides beyond the kernel matrix's: outliers on every scale mode the kernel folds or dequantizes (keys per
# channel, keys per token group, values per channel; the cases carry no RoPE unless a test gives one, so the per-channel
# keys take the fold into the query), more outliers than a block has channels
NUQ_SIDES = {
    "nuq-4-2pct-channel-keys": (
        QuantSpec(method="nuq", bits=4, outlier_fraction=0.02, pre_rope=True, path="keys"),
        QuantSpec(method="nuq", bits=3, axis="token", group_size=32, outlier_fraction=0.02, path="values")),
    "nuq-4-2pct-token-keys-channel-values": (
        QuantSpec(method="nuq", bits=4, axis="token", group_size=16, outlier_fraction=0.02, pre_rope=True, path="keys"),
        QuantSpec(method="nuq", bits=2, outlier_fraction=0.02, path="values")),
    "nuq-3-5pct-narrow-groups": (  # head_dim 24: rows that do not fill 16 lanes
        QuantSpec(method="nuq", bits=3, outlier_fraction=0.05, pre_rope=True, path="keys"),
        QuantSpec(method="nuq", bits=3, axis="token", group_size=8, outlier_fraction=0.05, path="values")),
    "nuq-2-10pct-uniform-values": (
        QuantSpec(method="nuq", bits=2, outlier_fraction=0.1, pre_rope=True, path="keys"),
        QuantSpec(bits=2, axis="token", path="values")),
}


@pytest.fixture(autouse=True)
def _turboquant_sides(monkeypatch):
    import tests.test_kernels as kernels

    for name, specs in {**TURBOQUANT_SIDES, **NUQ_SIDES}.items():
        monkeypatch.setitem(kernels.SIDES, name, specs)


@pytest.mark.parametrize("side", ["uniform-4-token-keys-channel-values", "fp8-static", "int8-static-channel-int4-layer",
                                  "nuq-3-5pct-narrow-groups"])
@pytest.mark.parametrize("rope", [None, ("tokens", 24, False)])
def test_cpu_kernel_reads_rows_narrower_than_its_vectors(side, rope):
    """head_dim 24 (not a multiple of 16): a block's logits and weighted values take one dot product / row update
    per token instead of the 16-lane tile products, and give the dense reference's result."""
    from kvtool.runtime.kernels.cpu_decode import covers, cpu_decode_attention

    args, reference = build_case(side, 24, 2, "cpu", seed=29, rope=rope)
    assert covers(args["formats"], torch.float16, 24) is None
    torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("side", [name for name in NUQ_SIDES if "narrow" not in name])
@pytest.mark.parametrize("head_dim, gqa", [(64, 4), (256, 1), (128, 8)])
def test_cpu_kernel_reads_nuq_blocks_with_outliers_as_the_dense_reference(side, head_dim, gqa, monkeypatch):
    """KVQuant bodies (`reads_nuq`): codebook values of the codes, scaled per channel (folded into the query or into
    the summed values) or per token group, every block's sparse outliers in place; the reference decodes the blocks
    with `NuqQuantizer.decode_blocks`. Without the outliers the result differs (they are really read)."""
    from kvtool.runtime.kernels import cpu_decode
    from kvtool.runtime.kernels.cpu_decode import covers, cpu_decode_attention

    args, reference = build_case(side, head_dim, gqa, "cpu", seed=head_dim + gqa + 11)
    assert covers(args["formats"], torch.float16, head_dim) is None
    torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)
    sides = cpu_decode._side_arrays  # the same blocks with their outliers dropped

    def no_outliers(side_tensors, fmt):
        arrays = sides(side_tensors, fmt)
        return arrays[:12] + (arrays[12][:, :0], arrays[13][:, :0]) if arrays[12].shape[1] else arrays

    monkeypatch.setattr(cpu_decode, "_side_arrays", no_outliers)
    dense_only = cpu_decode_attention(**_cpu_args(args))
    assert (dense_only - reference).abs().max() > 1e-3


@pytest.mark.parametrize("side", [name for name in TURBOQUANT_SIDES if "qjl" not in name])
@pytest.mark.parametrize("head_dim, gqa", [(64, 4), (256, 1), (128, 8)])
def test_cpu_kernel_reads_turboquant_blocks_as_the_dense_reference(side, head_dim, gqa):
    """TurboQuant bodies (`cpu_decode_rotated.py`): queries rotated into each instance's domain (per block with the
    outlier split, whose channel order is the block's own), value sums rotated back; soft-capped, with learned sinks."""
    from kvtool.runtime.kernels.cpu_decode import covers, cpu_decode_attention

    for softcap, sinks in ((None, False), (5.0, True)):
        args, reference = build_case(side, head_dim, gqa, "cpu", softcap=softcap, sinks=sinks, seed=head_dim + gqa)
        assert covers(args["formats"], torch.float16, head_dim) is None
        torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("side", ["turboquant-3", "turboquant-k3.5-v2.5", "turboquant-k3.5-v2.5-query-scale",
                                  "turboquant-k3.5-v2.5-kronecker"])
@pytest.mark.parametrize("head_dim, gqa", [(64, 4), (256, 1)])
def test_cpu_kernel_reads_16_token_turboquant_blocks(side, head_dim, gqa):
    """``cache.block_size: 16`` (turboquant only): the kernel reads the shorter blocks as the dense reference."""
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention

    args, reference = build_case(side, head_dim, gqa, "cpu", seed=head_dim + gqa + 5, bs=16)
    assert args["block_size"] == 16
    torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("side", ["turboquant-k3.5-v2.5-query-scale", "turboquant-3-query-scale"])
def test_cpu_kernel_scales_the_query_by_the_keys_channel_scale_of_its_kv_head(side):
    """Keys with ``channel_scale: query`` hold k / s per KV head: the kernel multiplies the body's query by the row of
    the stream's head (the reference decodes k itself); without the scale, or with one head's for all, it is wrong."""
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention

    args, reference = build_case(side, 64, 4, "cpu", seed=11)
    assert args["formats"][0].query_scale
    torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)
    keys, values = args["body"]
    unscaled = {name: t for name, t in keys.items() if name != "channel_scale"}
    out = cpu_decode_attention(**{**_cpu_args(args), "body": (unscaled, values)})
    assert (out - reference).abs().max() > 1e-2
    one_head = {**keys, "channel_scale": keys["channel_scale"][:1].expand_as(keys["channel_scale"]).contiguous()}
    out = cpu_decode_attention(**{**_cpu_args(args), "body": (one_head, values)})
    assert (out - reference).abs().max() > 1e-2


def test_power_of_two_turboquant_rotations_run_as_the_fast_transform():
    """The kernel runs H diag(s) by the Walsh-Hadamard transform (signs found from the rotation) and reads any other
    rotation (the split's Haar-random rest) as its matrix; a matrix whose first row looks like H diag(s)'s is checked
    whole."""
    from kvtool.methods.quant.turboquant import Instance, _rotation_matrix
    from kvtool.runtime.kernels.cpu_decode import _signs

    for dim in (8, 64, 256):
        inst = Instance("", dim, 3, seed=7, qjl=False)
        tensors = inst.tensors()
        signs = _signs(_rotation_matrix(dim, tensors).numpy())
        np.testing.assert_allclose(signs, tensors["signs"].numpy() / math.sqrt(dim), rtol=1e-6)
    haar = Instance("", 192, 3, seed=7, qjl=False)
    assert _signs(_rotation_matrix(192, haar.tensors()).numpy()).shape == (0,)
    fake = _rotation_matrix(64, Instance("", 64, 3, seed=9, qjl=False).tensors()).numpy().copy()
    fake[0, 3] *= -1  # a first row of +-1 / sqrt(d) whose matrix is not H diag(s)
    assert _signs(fake).shape == (0,)


@pytest.mark.parametrize("rows", [3, 5])
@pytest.mark.parametrize("dim", [48, 56, 96, 160, 192])
def test_kronecker_split_rotations_run_as_fast_transforms_and_a_small_matrix(dim, rows, monkeypatch):
    """``split_rotation: kronecker``: P = (M kron H_n) diag(s) is orthogonal, the kernel finds (M, s / sqrt(n)) from P
    (not the dense product), and its transform equals P on the queries and P^T on the value sums (3 query rows, and 5:
    four gathered and scattered together, one alone); a Haar-random matrix
    or a perturbed Kronecker one stays dense."""
    from kvtool.methods.quant.turboquant import Instance, _rotation_matrix, kronecker_factors
    from kvtool.runtime.kernels.cpu_decode import _fast_rotation
    from kvtool.runtime.kernels.cpu_decode_rotated import rotate_rows, unrotate_into

    m, n = kronecker_factors(dim)
    p = _rotation_matrix(dim, Instance("", dim, 3, seed=5, qjl=False, kronecker=True).tensors()).numpy()
    np.testing.assert_allclose(p @ p.T, np.eye(dim), atol=1e-5)
    assert np.abs(p).max() < 1.0 / math.sqrt(n) + 1e-6  # spread: no entry larger than H_n's
    mix, signs = _fast_rotation(p)
    assert mix.shape == (m, m) and signs.shape == (dim,)
    rng = np.random.default_rng(dim)
    queries = rng.standard_normal((rows, dim + 8)).astype(np.float32)  # rows of a wider head, read at an offset
    order = rng.permutation(dim + 8).astype(np.int64)
    rotated = np.empty((rows, dim), np.float32)
    rotate_rows(queries, order, 8, mix, signs, np.empty((rows, dim), np.float32), rotated)
    np.testing.assert_allclose(rotated, queries[:, order[8:]] @ p.T, rtol=1e-4, atol=1e-4)
    sums = rng.standard_normal((rows, dim)).astype(np.float32)
    acc = np.zeros((rows, dim + 8), np.float32)
    unrotate_into(sums, mix, signs, order, 8, np.empty((rows, dim), np.float32), acc)
    expected = np.zeros_like(acc)
    expected[:, order[8:]] = sums @ p
    np.testing.assert_allclose(acc, expected, rtol=1e-4, atol=1e-4)
    haar = _rotation_matrix(dim, Instance("", dim, 3, seed=5, qjl=False).tensors()).numpy()
    assert _fast_rotation(haar)[1].shape == (0,)
    bent = p.copy()
    bent[1, 2] += 0.05  # not among the entries the cache keys on: the check itself must refuse it
    monkeypatch.setattr("kvtool.runtime.kernels.cpu_decode._KRONECKER", {})
    assert _fast_rotation(bent)[1].shape == (0,)


@pytest.mark.parametrize("rows", [1, 3, 4, 6])
def test_dense_rotation_reads_four_query_rows_per_pass_and_equals_the_matrix(rows):
    """A Haar-random instance rotation (no fast form) runs four query rows per pass over P (and P^T for the value
    sums), with the rows past a multiple of four on their own: both equal the matrix product for 1, 3, 4 and 6 rows."""
    from kvtool.runtime.kernels.cpu_decode_rotated import rotate_rows, unrotate_into

    dim, offset = 192, 64
    rng = np.random.default_rng(rows)
    p = np.linalg.qr(rng.standard_normal((dim, dim)))[0].astype(np.float32)
    queries = rng.standard_normal((rows, dim + offset)).astype(np.float32)
    order = rng.permutation(dim + offset).astype(np.int64)
    no_signs = np.empty(0, np.float32)
    rotated = np.empty((rows, dim), np.float32)
    rotate_rows(queries, order, offset, p, no_signs, np.empty((rows, dim), np.float32), rotated)
    np.testing.assert_allclose(rotated, queries[:, order[offset:]] @ p.T, rtol=1e-4, atol=1e-4)
    sums = rng.standard_normal((rows, dim)).astype(np.float32)
    acc = np.ones((rows, dim + offset), np.float32)
    unrotate_into(sums, p, no_signs, order, offset, np.empty((rows, dim), np.float32), acc)
    expected = np.ones_like(acc)
    expected[:, order[offset:]] += sums @ p
    np.testing.assert_allclose(acc, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("levels", [2, 3, 4, 8, 12, 16, 32, 64])
@pytest.mark.parametrize("width", [16, 64, 200])
def test_codebook_lookup_in_lanes_equals_indexing(levels, width):
    """`lookup_row` (16 codes at a time by a permute of the padded codebook up to 32 levels, then the rest one by one;
    larger codebooks one by one) gives exactly ``codebook[code]`` for every code, also past the last full vector and
    for a codebook whose size is not a power of two."""
    from kvtool.runtime.kernels.cpu_decode_kernel import lookup_row, padded_codebook

    rng = np.random.default_rng(levels * width)
    codebook = np.sort(rng.standard_normal(levels)).astype(np.float32)
    codes = rng.integers(0, levels, size=width)
    codes[:2] = [0, levels - 1]  # both ends of the table
    table = np.empty(32, np.float32)
    padded_codebook(codebook, table)
    row = codes.astype(np.float32)
    lookup_row(row, codebook, table)
    np.testing.assert_array_equal(row, codebook[codes])


@pytest.mark.parametrize("widths", [[1], [2], [4], [2, 1], [4, 1], [2, 2], [1, 1, 1], [2, 1, 1]])
@pytest.mark.parametrize("bs, dim", [(8, 48), (16, 16), (16, 192), (32, 64)])
def test_block_codes_read_in_one_pass_equal_the_unpacked_codes_looked_up(widths, bs, dim):
    """`codebook_tile`'s one pass from a block's bit-sliced bytes to codebook values (`simd.codebook_block_lanes`: one
    to three slices, codes of up to 4 bits from one half of the padded codebook, 5 bits from both) gives exactly
    ``codebook[code]`` of the codes `unpack_block` reads from the same bytes, for every slice layout, block size and
    row length; the fallback (no slice table) gives the same."""
    from kvtool.runtime.kernels.cpu_decode_kernel import codebook_tile, padded_codebook, slice_table, unpack_block

    bits = sum(widths)
    rng = np.random.default_rng(bits * bs + dim)
    codes = rng.integers(0, 256, size=(3, bs * bits // 8, dim), dtype=np.uint8)  # any bytes are valid codes
    codebook = np.sort(rng.standard_normal(2**bits)).astype(np.float32)
    table, slices = np.empty(32, np.float32), np.zeros(12, np.int32)
    padded_codebook(codebook, table)
    width_array = np.zeros(4, np.int64)
    width_array[: len(widths)] = widths
    slice_table(width_array, bs, slices)
    assert slices[1] > 0  # the one-pass read applies
    for block in range(3):
        unpacked = np.empty((bs, dim), np.float32)
        unpack_block(codes, block, width_array, unpacked)
        expected = codebook[unpacked.astype(np.int64)]
        fast, fallback = np.full((bs, dim), np.nan, np.float32), np.full((bs, dim), np.nan, np.float32)
        codebook_tile(codes, block, width_array, codebook, table, slices, fast)
        codebook_tile(codes, block, width_array, codebook, table, np.zeros(12, np.int32), fallback)
        np.testing.assert_array_equal(fast, expected)
        np.testing.assert_array_equal(fallback, expected)


def _tile_products():
    """njit wrappers of `simd.tile_dots_lanes` and `simd.weighted_rows_lanes` over 2-D arrays."""
    from numba import njit

    from kvtool.runtime.kernels.simd import tile_dots_lanes, weighted_rows_lanes

    @njit
    def dots(rows, tile, out):
        tile_dots_lanes(rows, tile, out, rows.shape[1])

    @njit
    def weighted(coef, tile, summed):
        weighted_rows_lanes(coef, tile, summed, tile.shape[1])  # (any rank, read flat)

    return dots, weighted


@pytest.mark.parametrize("rows, tokens, dim", [(1, 16, 16), (3, 16, 48), (4, 16, 256), (5, 32, 64), (3, 32, 192)])
def test_tile_products_in_lanes_equal_the_matrix_products(rows, tokens, dim):
    """The kernel's block products: `simd.tile_dots_lanes` (the logits of R query rows against T tokens, sixteen
    tokens' sums reduced together) equals rows @ tile.T, and `simd.weighted_rows_lanes` (four chunks per pass, then one
    at a time: 1, 3, 4, 12 and 16 chunks here) adds coef @ tile to what the sums held."""
    dots, weighted = _tile_products()
    rng = np.random.default_rng(rows * tokens + dim)
    queries = rng.standard_normal((rows, dim)).astype(np.float32)
    tile = rng.standard_normal((tokens, dim)).astype(np.float32)
    out = np.full((rows, tokens), np.nan, np.float32)
    dots(queries, tile, out)
    np.testing.assert_allclose(out, queries.astype(np.float64) @ tile.T, rtol=1e-5, atol=1e-4)
    coef = rng.standard_normal((rows, tokens)).astype(np.float32)
    summed = rng.standard_normal((rows, dim)).astype(np.float32)
    expected = summed + coef.astype(np.float64) @ tile
    weighted(coef, tile, summed)
    np.testing.assert_allclose(summed, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dim", [8, 16, 32, 64, 128, 256, 2048])
def test_walsh_hadamard_in_lanes_equals_the_matrix(dim):
    """The kernel's transform (16-lane vectors from d = 16, `simd.walsh_hadamard_lanes`; scalar at 8) equals
    sqrt(d) H x with H Sylvester's Hadamard matrix, on a slice inside a longer row (nothing outside it changes)."""
    from kvtool.runtime.kernels.cpu_decode_rotated import walsh_hadamard

    hadamard = np.ones((1, 1))
    while hadamard.shape[0] < dim:  # Sylvester: H_2n = [[H, H], [H, -H]]
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    rng = np.random.default_rng(dim)
    x = rng.standard_normal(dim + 24).astype(np.float32)
    expected = x.copy()
    expected[8 : 8 + dim] = hadamard @ x[8 : 8 + dim].astype(np.float64)
    _transform_slice(x, 8, dim, walsh_hadamard)
    np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-4 * math.sqrt(dim))


def _transform_slice(x, start, dim, transform):
    from numba import njit

    @njit
    def run(x, start, dim):
        transform(x[start : start + dim])

    run(x, start, dim)


def test_kronecker_split_rotation_needs_a_wide_power_of_two_factor():
    from kvtool.errors import RecipeError
    from kvtool.methods.quant.turboquant import TurboQuantizer

    spec = QuantSpec(method="turboquant", bits=2, extra_bits=0.5, outlier_channel_fraction=0.25, split_rotation="kronecker")
    TurboQuantizer(spec, 64, 32)  # 16 + 48 = 3 x 16
    with pytest.raises(RecipeError, match="split_rotation"):
        TurboQuantizer(spec, 16, 32)  # 4 + 12 = 3 x 4
    with pytest.raises(RecipeError, match="split_rotation"):
        QuantSpec(method="uniform", bits=4, split_rotation="kronecker")


def test_cpu_kernel_refuses_what_it_cannot_read():
    from kvtool.runtime.kernels.cpu_decode import covers

    for side in ("palu-fp16", "float", "uniform-4-keys-turboquant-2-values", "turboquant-3.5-keys-palu-values",
                 "turboquant-qjl"):
        args, _ = build_case(side, 64, 1, "cpu")
        assert covers(args["formats"], torch.float16, 64) is not None, side
    assert "float32" in covers(None, torch.float32, 64)


def test_cpu_kernel_writes_the_new_token_where_the_store_would_and_nowhere_else():
    """``write``: each stream's next float slot gets new_k / new_v rounded as the pool's dtype rounds them (float16
    and bfloat16), after the attention that read the new token in float32; every other slot keeps its bytes."""
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention

    for dtype in (torch.float16, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        fbs, d, lengths = 16, 64, np.array([1, 17, 5])
        table = torch.tensor([[3, 0], [1, 4], [2, 0]], dtype=torch.int32)  # blocks the streams already have
        float_k = torch.randn(6, fbs, d, generator=g).to(dtype)
        float_v = torch.randn(6, fbs, d, generator=g).to(dtype)
        before_k, before_v = float_k.clone(), float_v.clone()
        q, new_k, new_v = torch.randn(3, 2, d, generator=g), torch.randn(3, d, generator=g) * 3, torch.randn(3, d, generator=g)
        read_only = cpu_decode_attention(q, new_k, new_v, float_k.clone(), float_v.clone(), table, lengths)
        out = cpu_decode_attention(q, new_k, new_v, float_k, float_v, table, lengths, write=True)
        torch.testing.assert_close(out, read_only, rtol=0, atol=0)  # written after the read, not read back rounded
        block = table[torch.arange(3), torch.from_numpy(lengths // fbs)].long()
        offset = torch.from_numpy(lengths % fbs)
        assert torch.equal(float_k[block, offset].view(torch.int16), new_k.to(dtype).view(torch.int16))
        assert torch.equal(float_v[block, offset].view(torch.int16), new_v.to(dtype).view(torch.int16))
        float_k[block, offset], float_v[block, offset] = before_k[block, offset], before_v[block, offset]
        assert torch.equal(float_k.view(torch.int16), before_k.view(torch.int16))
        assert torch.equal(float_v.view(torch.int16), before_v.view(torch.int16))


@pytest.mark.parametrize("parts", [1, 2])
def test_cpu_kernel_adds_the_attention_each_held_slot_received_to_its_score(parts):
    """``scores`` + ``scoring``: each held float slot's score grows by its probability summed over its stream's rows
    (the dense reference's), the written slot gets its own sum and position; slots nobody holds keep their bytes. (Body
    blocks' scores: `test_numba_backend_generates_the_torch_backends_tokens_and_store[h2o-4bit]`.)"""
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention

    g = torch.Generator().manual_seed(3)
    fbs, d, rows, lengths = 16, 64, 4, np.array([1, 17, 5])
    table = torch.tensor([[3, 0], [1, 4], [2, 5]], dtype=torch.int32)
    float_k, float_v = torch.randn(6, fbs, d, generator=g).half(), torch.randn(6, fbs, d, generator=g).half()
    q, new_k, new_v = torch.randn(3, rows, d, generator=g) * 0.3, torch.randn(3, d, generator=g), torch.randn(3, d, generator=g)
    score = torch.rand(6, fbs, generator=g)
    pos = torch.zeros(6, fbs, dtype=torch.int32)
    before = score.clone()
    cpu_decode_attention(q, new_k, new_v, float_k, float_v, table, lengths, write=True, scores=(score, None), scoring=True,
                         positions=(pos, np.array([7, 30, 11])), parallel=parts > 1, parts=parts)
    for s, n in enumerate(lengths.tolist()):
        ids = table[s, : -(-n // fbs)].long()
        keys = torch.cat([float_k[ids].reshape(-1, d)[:n].float(), new_k[s : s + 1]])
        p = torch.softmax(q[s] @ keys.T, -1).sum(0)  # (n + 1,) summed over the rows
        slot = torch.arange(n + 1)
        block, offset = table[s, slot // fbs].long(), slot % fbs
        expected = torch.cat([before[block[:n], offset[:n]] + p[:n], p[n:]])
        torch.testing.assert_close(score[block, offset], expected, rtol=1e-5, atol=1e-6)
        assert int(pos[block[n], offset[n]]) == [7, 30, 11][s]
        score[block, offset] = before[block, offset]
    assert torch.equal(score, before)  # nothing else moved


def test_a_full_float_block_is_reserved_for_the_kernels_write_and_counted_with_it():
    """`LayerStore.can_append_one` / `reserve_one`: a stream whose last float block is full gets its next one right
    before the kernel writes the step's token (the append would allocate it too) and the bytes stay what the lengths
    say; a quantized store due to encode a block cannot take the token in place (the torch path encodes it)."""
    model = tiny_model("llama", kv_heads=2)
    # float16: 32 tokens fill two float blocks; kivi-3bit: 2 sinks + 39 tokens, one short of encoding a 32-token block
    for recipe, seq, in_place in ((RECIPES["float16"], 32, True), (RECIPES["kivi-3bit"], 41, False)):
        ids, _ = tiny_tokenizer_free_inputs(batch=2, seq=seq)
        cache = CompressedRuntime.from_recipe(model, recipe, backend="torch").new_cache()
        with torch.no_grad():
            model(ids, **with_cache(cache), use_cache=True)
        store = cache.layers[0].store
        assert store.quiet_appends() == 0
        assert store.can_append_one() is in_place
        if in_place:
            blocks = store.float_blocks().copy()
            store.reserve_one()
            store.appended_one()  # as after the kernel's write
            assert (store.float_blocks() == blocks + 1).all() and store.quiet_appends() == 15
            assert store.used_nbytes() == store.expected_nbytes()


def test_auto_is_numba_on_cpu_for_every_store_the_kernel_reads():
    from kvtool.calibration import build_quantizers

    def backend(recipe, requested="auto"):
        return resolve_backend(requested, torch.device("cpu"), recipe, build_quantizers(recipe, 64, torch.float32, {}))

    for name in ("kivi-4bit", "kivi-2bit", "int8", "uncompressed", "h2o", "tova", "streamingllm"):  # codes, float-only
        assert backend(load_recipe(name)) == "numba", name
        assert backend(load_recipe(name), "numba") == "numba", name
    assert backend(load_recipe("uniform-3bit-prerope")) == "numba"  # keys before RoPE: rotated in the kernel
    assert backend(load_recipe("kivi-4bit"), "torch") == "torch"
    assert backend(load_recipe("fp8-e4m3")) == "numba"  # fp8 bytes with a float32 scale per block
    for name in ("turboquant-3bit", "turboquant-2.5bit", "turboquant-k3.5-v2.5"):  # rotated codes, with the split too
        assert backend(load_recipe(name)) == "numba", name
    qjl = Recipe(name="tq-qjl", keys=QuantSpec(method="turboquant", bits=3, qjl=True, path="keys"),
                 values=QuantSpec(method="turboquant", bits=3, path="values"))
    assert backend(qjl) == "torch"  # the QJL residual is not in the CPU kernel
    with pytest.raises(RuntimeConfigError, match="--backend numba: recipe"):
        backend(qjl, "numba")


RECIPES = {
    "kivi-3bit": Recipe(
        name="kivi3", keys=QuantSpec(bits=3, path="keys"), values=QuantSpec(bits=3, axis="token", group_size=16, path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
    ),
    "float16": Recipe(name="f16", cache=CacheSpec(float_dtype="float16"),
                      keys=QuantSpec(method="none", bits=16, path="keys"),
                      values=QuantSpec(method="none", bits=16, axis="token", path="values")),
    "bfloat16-kivi-4bit": Recipe(name="bf16", cache=CacheSpec(sink_tokens=1, recent_tokens=0, block_size=32, float_dtype="bfloat16")),
    "streamingllm-4bit": Recipe(  # an evicting store: the kernel reads it, the torch path stores and evicts
        name="sl4", cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
        eviction=EvictionSpec(policy="streamingllm", budget_tokens=64, sink_tokens=4, window=16),
    ),
    "fp8-e4m3": Recipe(  # fp8 bytes with a float32 scale per block
        name="fp8", keys=QuantSpec(method="fp8", bits=8, granularity="block", path="keys"),
        values=QuantSpec(method="fp8", bits=8, granularity="block", axis="token", path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
    ),
    "h2o": Recipe(  # scored eviction of a float store: between cuts the kernel stores the token and adds the scores
        name="h2o", keys=QuantSpec(method="none", bits=16, path="keys"),
        values=QuantSpec(method="none", bits=16, axis="token", path="values"), cache=CacheSpec(float_dtype="float16"),
        eviction=EvictionSpec(policy="h2o", budget_tokens=48, sink_tokens=2, window=8),
    ),
    "knorm": Recipe(  # a policy that keeps a feature per token (the key's norm): the kernel's steps write it too
        name="knorm", keys=QuantSpec(method="none", bits=16, path="keys"),
        values=QuantSpec(method="none", bits=16, axis="token", path="values"),
        eviction=EvictionSpec(policy="knorm", budget_tokens=48, sink_tokens=2, window=8),
    ),
    "vatp-4bit": Recipe(  # ... attention x the value's L1 norm, over a quantized store
        name="vatp4", cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
        eviction=EvictionSpec(policy="vatp", budget_tokens=72, sink_tokens=2, window=8),
    ),
    "h2o-4bit": Recipe(  # ... and of a quantized store: scores of body blocks too
        name="h2o4", cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
        eviction=EvictionSpec(policy="h2o", budget_tokens=72, sink_tokens=2, window=8),
    ),
    "uniform-3bit-prerope": load_recipe("uniform-3bit-prerope"),  # keys before RoPE: rotated at recorded positions
    "turboquant-k3.5-v2.5": load_recipe("turboquant-k3.5-v2.5"),  # rotated codes, each block its own outlier channels
    "turboquant-3bit": Recipe(name="tq3", keys=QuantSpec(method="turboquant", bits=3, path="keys"),
                              values=QuantSpec(method="turboquant", bits=3, path="values"),
                              cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32)),
    "turboquant-k3.5-v2.5-block16": dataclasses.replace(  # 16-token blocks: a block encoded every 16 steps
        load_recipe("turboquant-k3.5-v2.5"), cache=CacheSpec(block_size=16, sink_tokens=4, recent_tokens=0)),
    "turboquant-3bit-h2o-block16": Recipe(  # ... evicting whole 16-token blocks
        name="tq3h", keys=QuantSpec(method="turboquant", bits=3, path="keys"),
        values=QuantSpec(method="turboquant", bits=3, path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=16),
        eviction=EvictionSpec(policy="h2o", budget_tokens=72, sink_tokens=2, window=8)),
    "h2o-local-half-4bit": Recipe(  # eviction on the sliding-window layers only (`sliding_budget`)
        name="h2o4l", cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
        eviction=EvictionSpec(policy="h2o", budget=1.0, sliding_budget=0.5, sink_tokens=2, window=8),
    ),
    "h2o-local-half-4bit-prerope": Recipe(  # ... keys before RoPE: the global layers (no policy) read the sequences'
        # recorded positions, the sliding ones their slots' (row 1 left-padded)
        name="h2o4lp", keys=QuantSpec(bits=4, pre_rope=True, path="keys"), cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
        eviction=EvictionSpec(policy="h2o", budget=1.0, sliding_budget=0.5, sink_tokens=2, window=8),
    ),
    "h2o-4bit-prerope": Recipe(  # ... and at the positions an evicting store keeps per slot
        name="h2o4p", keys=QuantSpec(bits=4, pre_rope=True, path="keys"), cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
        eviction=EvictionSpec(policy="h2o", budget_tokens=72, sink_tokens=2, window=8),
    ),
}


def _generate(model, recipe, backend, ids, mask, tokens=24, profile=None):
    runtime = CompressedRuntime.from_recipe(model, recipe, profile=profile, backend=backend)
    cache = runtime.new_cache()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **with_cache(cache), max_new_tokens=tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out, cache


def _held(store) -> tuple:
    """A store's lengths and the float keys / values of every stream's held slots, gathered through its tables."""
    width = int(store.float_len.max())
    slots = torch.arange(width)[None].expand(store.streams, width)
    valid = slots < torch.from_numpy(store.float_len)[:, None]
    ids = store.float_slot_ids(slots)
    names = ("k", "v") + tuple(name for name in ("pos", "score", "cls", "feature") if name in store.layout.meta)
    floats = [store.read_float_values(name, ids, per_slot=True)[valid] for name in names]  # int8 codes: decoded
    if store.body_pool is not None and "score" in store.layout.meta:  # the body blocks' scores too
        blocks = int(store.body_len.max())
        body_ids = store.body_block_ids(0, blocks)
        body_valid = torch.arange(blocks)[None] < torch.from_numpy(store.body_len)[:, None]
        floats.append(take_rows(store.body_pool.tensors["score"], body_ids)[body_valid])
    return store.float_len.tolist(), store.body_len.tolist(), store.n_sink.tolist(), floats


@pytest.mark.parametrize("name", list(RECIPES))
def test_numba_backend_generates_the_torch_backends_tokens_and_store(name):
    """Batch of two, row 1 left-padded (ragged streams), GQA 4:2; 24 tokens cross block flushes and float-block
    boundaries, so the kernel's own writes (`LayerStore.quiet_appends`) and the torch path's alternate; with scored
    eviction the kernel's steps (stores, positions, scores) and the torch path's cuts alternate too."""
    steps = {"float16": 23, "h2o-4bit": 12, "h2o-4bit-prerope": 12, "turboquant-3bit-h2o-block16": 12, "vatp-4bit": 16}.get(name, 20)  # of 23 decode steps (flushes and cuts go to torch)
    _assert_numba_matches_torch(tiny_model("llama", kv_heads=2), RECIPES[name], steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_take_the_host_array_path_and_a_bfloat16_model_decodes_as_on_torch(dtype, monkeypatch):
    """Decode steps the kernel runs and stores go through `KvtoolLayer._cpu_kernel_step` (queries and tokens as host
    arrays, no general-path tensor operations): in nearly every step of every layer, so the lean path cannot silently
    turn off. A bfloat16 model's queries are widened to float32 on the host and the output cast back: its tokens are
    the torch backend's."""
    from kvtool.runtime.layer import KvtoolLayer

    taken = []
    step = KvtoolLayer._cpu_kernel_step

    def counted(self, *args):
        out = step(self, *args)
        taken.append(out is not None)
        if out is not None:
            assert out.dtype == dtype and out.shape[1] == 1  # (B, 1, H_q, D) in the model's dtype
        return out

    monkeypatch.setattr(KvtoolLayer, "_cpu_kernel_step", counted)
    model = tiny_model("llama", kv_heads=2).to(dtype)
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=70)
    by_torch, _ = _generate(model, RECIPES["kivi-3bit"], "torch", ids, mask)
    assert not taken  # the torch backend never asks
    by_numba, cache = _generate(model, RECIPES["kivi-3bit"], "numba", ids, mask)
    layers = model.config.num_hidden_layers
    assert sum(taken) >= 20 * layers and cache.memory_report()["kernel_steps"] >= sum(taken)
    assert torch.equal(by_torch.sequences, by_numba.sequences)
    tolerance = 2e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(torch.stack(by_numba.logits).float(), torch.stack(by_torch.logits).float(), rtol=tolerance,
                               atol=tolerance)


@pytest.mark.parametrize("name,steps", [("knorm", 20), ("vatp-4bit", 16)])
def test_feature_policies_store_their_decode_tokens_on_the_kernel(name, steps, monkeypatch):
    """KNorm and VATP keep a feature per token (the key's norm, the value's L1 norm): the kernel's lean steps write
    it with the token (`_count_kernel_write`), so between cuts their decode steps are `_cpu_kernel_step`'s, not the
    torch path's store (KNorm's attention was read by the kernel before too, its tokens stored by torch)."""
    from kvtool.runtime.layer import KvtoolLayer

    taken = []
    step = KvtoolLayer._cpu_kernel_step

    def counted(self, *args):
        out = step(self, *args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(KvtoolLayer, "_cpu_kernel_step", counted)
    model = tiny_model("llama", kv_heads=2)
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=70)
    _generate(model, RECIPES[name], "numba", ids, mask)
    assert sum(taken) >= steps * model.config.num_hidden_layers


def _assert_numba_matches_torch(model, recipe, steps: int, profile=None) -> None:
    """Batch of two (row 1 left-padded), 70-token prompt, 24 generated: the numba backend ran on every layer in at least
    ``steps`` of the 23 decode steps and gives the torch backend's tokens, logits, bytes and held slots."""
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=70)
    by_torch, torch_cache = _generate(model, recipe, "torch", ids, mask, profile=profile)
    by_numba, numba_cache = _generate(model, recipe, "numba", ids, mask, profile=profile)
    report = numba_cache.memory_report()
    assert report["backend"] == "numba"
    assert report["kernel_steps"] >= steps * model.config.num_hidden_layers  # the kernel really ran
    assert torch.equal(by_torch.sequences, by_numba.sequences)
    torch.testing.assert_close(torch.stack(by_numba.logits), torch.stack(by_torch.logits), rtol=2e-3, atol=2e-3)
    assert report["cache_bytes"] == torch_cache.memory_report()["cache_bytes"]
    for a, b in zip(torch_cache.layers, numba_cache.layers):
        held_a, held_b = _held(a.store), _held(b.store)
        assert held_a[:3] == held_b[:3]
        for x, y in zip(held_a[3], held_b[3]):
            # the same tokens in the same slots (the values differ by the attention's rounding: the torch path reads
            # the new token back from float16, the kernel uses it in float32, so later layers' inputs differ slightly)
            torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=2e-2)


def test_pre_rope_keys_stay_on_torch_when_the_rope_frequencies_change_with_length():
    """Both kernels rotate pre-RoPE keys with fixed frequencies: longrope / dynamic NTK models keep the torch path."""
    from types import SimpleNamespace

    from kvtool.calibration import build_quantizers
    from kvtool.runtime.backend import cpu_kernel_unsupported, kernel_unsupported

    recipe = load_recipe("uniform-3bit-prerope")
    quantizers = build_quantizers(recipe, 64, torch.float32, {})
    fixed = SimpleNamespace(rope_type="default", long_after=None, grow_after=None)
    longrope = SimpleNamespace(rope_type="longrope", long_after=4096, grow_after=None)
    assert cpu_kernel_unsupported(recipe, quantizers, [fixed, fixed]) is None
    for check in (cpu_kernel_unsupported, kernel_unsupported):
        assert "longrope" in check(recipe, quantizers, [fixed, longrope])
    assert resolve_backend("auto", torch.device("cpu"), recipe, quantizers, [longrope]) == "torch"


SLIDING = [("gemma3_text", "kivi-3bit"), ("gemma3_text", "float16"), ("gemma3_text", "uniform-3bit-prerope"),
           ("gemma2", "kivi-3bit"), ("mistral", "fp8-e4m3"), ("mistral", "streamingllm-4bit"),
           ("gemma3_text", "turboquant-k3.5-v2.5"), ("gemma3_text", "turboquant-k3.5-v2.5-block16"),
           ("gemma3_text", "h2o"), ("gemma3_text", "h2o-4bit"), ("gemma3_text", "turboquant-3bit-h2o-block16"),
           ("gemma3_text", "h2o-local-half-4bit"), ("gemma3_text", "h2o-local-half-4bit-prerope")]


@pytest.mark.parametrize("family,name", SLIDING, ids=[f"{f}-{n}" for f, n in SLIDING])
def test_numba_backend_reads_sliding_window_layers_as_the_torch_path_does(family, name):
    """Sliding-window layers (window 24 < the 70-token prompt) on the kernel: it hides the held tokens the window does
    not show (the rule frees body blocks whole, so the oldest block is partly hidden; sinks are hidden until freed),
    after soft-capping (Gemma 2). Same tokens, logits and store as the torch path; the kernel ran on the sliding
    layers too (every layer, at least 16 of 23 decode steps). Evicting recipes (H2O, and H2O on the sliding layers
    only): between the policy's cuts and the window rule's the kernel stores the token and adds its scores there too
    (before, a sliding layer with a policy took the torch path at every step: these cases ran the kernel on the
    global layers only and failed the count)."""
    model = featured_model(family, sliding_window=24, kv_heads=2)
    assert any(CompressedRuntime.from_recipe(model, RECIPES[name]).adapter.geometry.sliding_windows)
    _assert_numba_matches_torch(model, RECIPES[name], 16)


def _decoded_tokens(args: dict, s: int, side: str = "uniform-4") -> tuple[torch.Tensor, torch.Tensor]:
    """Stream s's held keys and values (T, D) float32 in the kernel's order (body blocks, then float slots), the body
    decoded by the side's own quantizers (uniform codes: nothing fitted)."""
    from kvtool.calibration import build_quantizers
    from tests.test_kernels import BS, SIDES as KERNEL_SIDES

    key_spec, value_spec = KERNEL_SIDES[side]
    recipe = Recipe(name=side, keys=key_spec, values=value_spec, cache=CacheSpec(block_size=BS))
    head_dim = args["q"].shape[-1]
    kq, vq = build_quantizers(recipe, head_dim, torch.float32, {})
    ids = args["body_table"][s, : int(args["body_len"][s])].long()
    group = torch.zeros(ids.numel(), dtype=torch.long)
    pick = lambda side_tensors: {k: t[ids] for k, t in side_tensors.items() if t.shape[0] == args["body"][0]["codes"].shape[0]}  # noqa: E731
    body_k = kq.decode_blocks(pick(args["body"][0]), group)[:, 0].float().reshape(-1, head_dim)
    body_v = vq.decode_blocks(pick(args["body"][1]), group)[:, 0].float().reshape(-1, head_dim)
    n = int(args["float_len"][s])
    f_ids = args["float_table"][s, : -(-n // args["float_k"].shape[1])].long()
    float_k = args["float_k"][f_ids].reshape(-1, head_dim)[:n].float()
    float_v = args["float_v"][f_ids].reshape(-1, head_dim)[:n].float()
    return torch.cat([body_k, float_k]), torch.cat([body_v, float_v])


def test_cpu_kernel_hides_what_the_window_does_not_show():
    """The kernel with a window against the same call with those tokens' logits at -inf done by hand: a window that
    hides part of the body and the sinks, one that hides nothing, and one that hides every held token (only the
    step's own token is attended)."""
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention

    args, _ = build_case("uniform-4", 64, 2, "cpu", seed=11)
    cpu = _cpu_args(args)
    streams = cpu["q"].shape[0]
    float_pos = torch.zeros(cpu["float_k"].shape[:2], dtype=torch.int32)
    body_pos = torch.zeros(cpu["body"][0]["codes"].shape[0], cpu["block_size"], dtype=torch.int32)
    bs, fbs = cpu["block_size"], cpu["float_k"].shape[1]
    held = []  # per stream: its tokens' positions in kernel order (body blocks, then float slots)
    for s in range(streams):
        positions = []
        for j in range(int(cpu["body_len"][s])):
            block = int(cpu["body_table"][s, j])
            body_pos[block] = torch.arange(len(positions), len(positions) + bs, dtype=torch.int32) + 100
            positions += (body_pos[block]).tolist()
        for f in range(int(cpu["float_len"][s])):
            block = int(cpu["float_table"][s, f // fbs])
            float_pos[block, f % fbs] = len(positions) + 100
            positions.append(len(positions) + 100)
        held.append(positions)
    newest = np.array([max(p, default=99) + 1 for p in held], dtype=np.int64)  # the query's position per stream
    full = cpu_decode_attention(**cpu)
    seen = set()
    for size in (10_000, 20, 1):  # every token visible; the newest 19 of each stream; none
        out = cpu_decode_attention(**cpu, window=(size, newest, float_pos, body_pos))
        for s in range(streams):
            visible = [p > newest[s] - size for p in held[s]]
            seen.add("all" if all(visible) else "none" if not any(visible) else "some")
            if all(visible):
                torch.testing.assert_close(out[s], full[s], rtol=1e-5, atol=1e-5)
            elif not any(visible):  # only the new token: its value, whatever the rows
                torch.testing.assert_close(out[s], cpu["new_v"][s].expand_as(out[s]), rtol=1e-5, atol=1e-5)
            else:  # the reference: the same call on the visible tokens only (a window of exactly those)
                q = cpu["q"][s]
                k, v = _decoded_tokens(args, s)
                logits = q @ k.T  # (R, T)
                logits[:, ~torch.tensor(visible)] = -math.inf
                logits = torch.cat([logits, (q @ cpu["new_k"][s])[:, None]], dim=1)
                p = torch.softmax(logits, dim=-1)
                expected = p[:, :-1] @ v + p[:, -1:] * cpu["new_v"][s]
                torch.testing.assert_close(out[s], expected, rtol=1e-4, atol=1e-4)
    assert seen == {"all", "some", "none"}


def test_numba_backend_decodes_when_no_float_block_was_ever_allocated():
    """A 64-token prompt, window 32, 32-token blocks, no sinks, no recent window: the sliding layer keeps the prompt's
    last 32 tokens, stored as one body block, so its float pool has no rows yet at the first decode step (its empty
    numpy views must still be made)."""
    recipe = Recipe(name="bare4", cache=CacheSpec(sink_tokens=0, recent_tokens=0, block_size=32))
    model = featured_model("gemma3_text", sliding_window=32)
    ids = torch.randint(3, 100, (1, 64), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    by_torch, _ = _generate(model, recipe, "torch", ids, mask, tokens=6)
    runtime = CompressedRuntime.from_recipe(model, recipe, backend="numba")
    prefilled = runtime.new_cache()
    with torch.no_grad():
        model(input_ids=ids, **with_cache(prefilled), use_cache=True)
    sliding = [layer for layer, w in zip(prefilled.layers, runtime.adapter.geometry.sliding_windows) if w]
    assert sliding and all(layer.store.float_pool.tensors["k"].shape[0] == 0 for layer in sliding)
    by_numba, numba_cache = _generate(model, recipe, "numba", ids, mask, tokens=6)
    assert numba_cache.memory_report()["kernel_steps"] >= model.config.num_hidden_layers
    assert torch.equal(by_torch.sequences, by_numba.sequences)
    torch.testing.assert_close(torch.stack(by_numba.logits), torch.stack(by_torch.logits), rtol=2e-3, atol=2e-3)
