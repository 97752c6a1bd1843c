"""Palu on the host: the compiled key logits (`cpu_lowrank.latent_logits`) and latent dequantization against the torch
path, the matrix product intrinsic against numpy, RoPE written half by half against the full-width formula, and the
per-forward cos / sin shared by the layers (same outputs, nothing left in the cache after a forward)."""

import dataclasses

import numpy as np
import pytest
import torch
from numba import njit

from kvtool.methods.base import BlockQuantizer
from kvtool.methods.lowrank import palu
from kvtool.methods.lowrank.palu import PaluQuantizer
from kvtool.models.cache_argument import with_cache
from kvtool.models.rope import KeyRotation, apply_rope, rotate_half, rotate_pairs
from kvtool.recipe import QuantSpec
from kvtool.runtime import cache as cache_module
from kvtool.runtime.kernels import cpu_lowrank
from kvtool.runtime.kernels.simd import matrix_product_lanes
from kvtool.runtime.memory import walked_nbytes
from kvtool.runtime.positions import RopeTable
from tests.test_palu_runtime import fitted_runtime, palu_recipe
from tests.tiny_models import tiny_model


@njit(cache=False)
def _product(a, b, out, d):
    matrix_product_lanes(a, b, out, d)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("depth", [1, 2, 7, 80])
@pytest.mark.parametrize("width", [16, 48, 64, 80, 256])
def test_matrix_product_lanes_matches_numpy(rows, depth, width):
    """Row blocks of four and the rows past them; chunk runs of four and the single chunks past them."""
    rng = np.random.default_rng(rows * 1000 + depth * 10 + width)
    a = rng.standard_normal((rows, depth), dtype=np.float32)
    b = rng.standard_normal((depth, width), dtype=np.float32)
    out = np.full((rows, width), np.nan, np.float32)  # every entry written (no accumulation into what was there)
    _product(a, b, out, width)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)


def _quantizer(bits=3, hadamard=False, rank=80, heads=3, head_dim=64, bias=False, seed=0, block_size=32, groups=1):
    g = torch.Generator().manual_seed(seed)
    width = heads * head_dim
    basis = torch.stack([torch.linalg.qr(torch.randn(width, rank, generator=g, dtype=torch.float64))[0].float()
                         for _ in range(groups)])  # (G, gD, r)
    fitted = {"basis": basis, "bias": torch.randn(groups, width, generator=g) if bias else torch.zeros(groups, width)}
    spec = QuantSpec(path="keys", method="palu", bits=bits, pre_rope=True, rank_fraction=rank / width, hadamard=hadamard,
                     group_size=128)
    return PaluQuantizer(spec, head_dim, block_size, torch.float16, fitted)


def _stream_groups(quantizer, streams=2):
    """(Sc,) the head group of each stream: streams of a sequence are its groups in turn."""
    return torch.arange(streams) % quantizer.groups


def _blocks(quantizer, streams=2, blocks=5, seed=1):
    """Encoded body blocks {name: (Sc, nb, ...)} of random keys, each stream's in its own head group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(streams * blocks, quantizer.heads_per_group, quantizer.block_size, quantizer.head_dim, generator=g) * 2
    stored = quantizer.encode_blocks(x, _stream_groups(quantizer, streams).repeat_interleave(blocks))
    return {name: t.view(streams, blocks, *t.shape[1:]) for name, t in stored.items()}


def _rotation(streams, tokens, rotary, interleaved=False, scaling=1.0, seed=2):
    g = torch.Generator().manual_seed(seed)
    positions = torch.sort(torch.randint(0, 4000, (streams, tokens), generator=g), dim=1).values  # gapped, per stream
    freqs = positions[..., None].float() * (10000.0 ** (-torch.arange(rotary // 2) / (rotary // 2)))
    emb = torch.repeat_interleave(freqs, 2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return KeyRotation(emb.cos() * scaling, emb.sin() * scaling, interleaved)


@pytest.fixture
def host_calls(monkeypatch):
    """How many times the compiled logits ran (a test cannot pass through the torch fallback unnoticed)."""
    calls = []
    kernel = cpu_lowrank.latent_logits

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(cpu_lowrank, "latent_logits", counted)
    return calls


@pytest.mark.parametrize("case", [
    dict(),
    dict(bits=4, hadamard=True, rank=128),
    dict(bits=16, rank=96),
    dict(bias=True),
    dict(heads=1, head_dim=128, rank=64),
    dict(heads=2, head_dim=256, rank=200, bits=2),
    dict(heads=1, rank=40, groups=2, bias=True),  # per-head groups (palu-30, palu-50): each stream its group's basis
    dict(heads=1, rank=45, groups=3, bits=16),  # an odd rank (ranks searched per layer)
])
@pytest.mark.parametrize("rope", ["none", "halves", "pairs", "partial", "scaled"])
def test_host_logits_match_the_torch_path(case, rope, host_calls):
    quantizer = _quantizer(**case)
    blocks = _blocks(quantizer)
    streams, tokens, d = 2, 5 * quantizer.block_size, quantizer.head_dim
    rotation = {
        "none": None, "halves": _rotation(streams, tokens, d), "pairs": _rotation(streams, tokens, d, interleaved=True),
        "partial": _rotation(streams, tokens, d // 2), "scaled": _rotation(streams, tokens, d, scaling=1.3),
    }[rope]
    query = torch.randn(streams, quantizer.heads_per_group, 3, d, generator=torch.Generator().manual_seed(3))
    group = _stream_groups(quantizer, streams)
    ours = quantizer.chunk_scores(query, blocks, group, rotation)
    reference = BlockQuantizer.chunk_scores(quantizer, query, blocks, group, rotation)  # keys reconstructed whole
    assert host_calls, "the compiled logits did not run"
    assert ours.shape == reference.shape == (streams, quantizer.heads_per_group, 3, tokens)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-4 * float(reference.abs().max()))


@pytest.mark.parametrize("case", [dict(block_size=8), dict(block_size=8, rank=81)])
def test_host_logits_leave_what_they_do_not_tile_to_the_torch_path(case, host_calls):
    """A chunk of 40 tokens (not a multiple of 16): the torch path's own result."""
    quantizer = _quantizer(**case)
    blocks = _blocks(quantizer)
    tokens = 5 * quantizer.block_size
    query = torch.randn(2, 3, 3, 64, generator=torch.Generator().manual_seed(3))
    rotation, group = _rotation(2, tokens, 64), torch.zeros(2, dtype=torch.long)
    ours = quantizer.chunk_scores(query, blocks, group, rotation)
    assert not host_calls
    assert torch.equal(ours, BlockQuantizer.chunk_scores(quantizer, query, blocks, group, rotation))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("rank,group_size", [(80, 128), (144, 64), (100, 32)])
def test_host_latents_are_the_torch_latents_bit_for_bit(bits, rank, group_size, monkeypatch):
    quantizer = _quantizer(bits=bits, rank=rank)
    quantizer.qgroup = min(group_size, rank)
    quantizer.qgroups = -(-rank // quantizer.qgroup)
    flat = {name: t.flatten(0, 1) for name, t in _blocks(quantizer).items()}
    host = quantizer._coded_latent(flat)
    monkeypatch.setattr(palu, "_numba_available", lambda: False)
    assert torch.equal(host, quantizer._coded_latent(flat))


@pytest.fixture
def two_threads():
    """torch on two threads for one test (its OpenMP team then has a second thread to share work with)."""
    from kvtool.runtime.kernels.openmp_team import openmp_team

    if openmp_team() is None:
        pytest.skip("no OpenMP team in this torch build")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield openmp_team()
    torch.set_num_threads(before)


def test_host_logits_and_latents_spread_over_torch_threads_give_the_one_thread_bits(two_threads, monkeypatch):
    """A chunk large enough to spread (`SPREAD_MIN_WORK`, `HOST_SPREAD_MIN_ELEMENTS`) runs on torch's OpenMP team: the
    same bits as on one thread (each item's sums in the same order), and the team really ran (its run count grows)."""
    quantizer = _quantizer(bits=3, rank=80, groups=2, bias=True)
    blocks = _blocks(quantizer, streams=2, blocks=24)
    streams, tokens, d = 2, 24 * quantizer.block_size, quantizer.head_dim
    assert streams * tokens * 3 * 80 * d >= cpu_lowrank.SPREAD_MIN_WORK
    assert streams * tokens * 80 >= palu.HOST_SPREAD_MIN_ELEMENTS
    rotation = _rotation(streams, tokens, d)
    query = torch.randn(streams, 3, 3, d, generator=torch.Generator().manual_seed(3))
    group = _stream_groups(quantizer, streams)
    runs = two_threads.runs
    spread = quantizer.chunk_scores(query, blocks, group, rotation)
    assert two_threads.runs == runs + 2  # the keys' latents dequantized, then their logits, each on the team
    monkeypatch.setattr(palu, "HOST_SPREAD_MIN_ELEMENTS", 1 << 62)
    monkeypatch.setattr(cpu_lowrank, "SPREAD_MIN_WORK", 1 << 62)
    serial = quantizer.chunk_scores(query, blocks, group, rotation)
    assert two_threads.runs == runs + 2  # (one thread)
    assert torch.equal(spread, serial)
    torch.testing.assert_close(spread, BlockQuantizer.chunk_scores(quantizer, query, blocks, group, rotation),
                               rtol=1e-5, atol=1e-4 * float(serial.abs().max()))


def _full_width(x, cos, sin, interleaved=False):
    """The model's formula: x cos + rotate(x) sin on the first R channels, the rest passed through."""
    rotary = cos.shape[-1]
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    turn = rotate_pairs if interleaved else rotate_half
    x_rot = x[..., :rotary]
    return torch.cat((x_rot * cos + turn(x_rot) * sin, x[..., rotary:]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 3, 37, 64, 64, 1), (2, 4, 5, 128, 64, 2), (2, 3, 4, 64, 64, 1), (1, 2, 3, 80, 40, 1)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_gives_the_full_width_formula_bits(dtype, shape, interleaved):
    b, h, t, d, rotary, cos_batch = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, h, t, d, generator=g).to(dtype)
    rotation = _rotation(cos_batch, t, rotary, interleaved)
    ours = apply_rope(x, rotation.cos, rotation.sin, interleaved)
    reference = _full_width(x, rotation.cos, rotation.sin, interleaved)
    assert ours.dtype == reference.dtype and torch.equal(ours, reference)


def test_apply_rope_still_differentiates():
    x = torch.randn(1, 2, 5, 64, requires_grad=True)
    rotation = _rotation(1, 5, 64)
    apply_rope(x, rotation.cos, rotation.sin).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_rope_kinds_follow_the_layers_ropes():
    from kvtool.models.adapter import adapter_for

    llama = RopeTable.from_adapter(adapter_for(tiny_model("llama", layers=3)))
    assert llama.kinds == (0, 0, 0)
    gemma = RopeTable.from_adapter(adapter_for(tiny_model(
        "gemma3_text", layers=4, kv_heads=1, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )))
    assert gemma.kinds == (0, 1, 0, 1)  # local RoPE base 10k, global 1M


def test_cos_sin_shared_within_a_forward_changes_no_output_and_leaves_nothing(monkeypatch):
    """Decode through pre-RoPE Palu keys with the per-forward cos / sin and with each layer computing its own: the same
    logits bit for bit; after each forward no table is held (the walk of the cache finds its own bytes only)."""
    model = tiny_model("llama", layers=3)
    recipe = dataclasses.replace(palu_recipe(0.5, bits=4), name="palu-shared-rope")
    runtime = fitted_runtime(model, recipe)
    ids = torch.randint(3, 128, (2, 80), generator=torch.Generator().manual_seed(4))

    def decode(cache):
        out = []
        with torch.no_grad():
            out.append(model(input_ids=ids[:, :72], **with_cache(cache), use_cache=True).logits[:, -1])
            for step in range(72, 80):
                out.append(model(input_ids=ids[:, step:step + 1], **with_cache(cache), use_cache=True).logits[:, -1])
                assert not cache.context._cos_sin
                assert walked_nbytes(cache) == cache.reserved_nbytes() + cache.constant_nbytes()
        return torch.stack(out)

    computed = []
    shared = cache_module.CacheContext.body_cos_sin

    def counted(self, layer, positions):
        computed.append(layer)
        return shared(self, layer, positions)

    monkeypatch.setattr(cache_module.CacheContext, "body_cos_sin", counted)
    cache = runtime.new_cache()
    with_shared = decode(cache)
    assert computed and not cache.context._cos_sin
    own = lambda self, layer, positions: self.rope.cos_sin(layer, positions)  # noqa: E731  every layer its own table
    monkeypatch.setattr(cache_module.CacheContext, "body_cos_sin", own)
    assert torch.equal(with_shared, decode(runtime.new_cache()))


def test_a_forward_that_fails_leaves_no_shared_cos_sin(monkeypatch):
    """A layer that raises ends the forward (a middle one: the last layer would drop them anyway): the tables shared
    so far are dropped with it."""
    model = tiny_model("llama", layers=3)
    runtime = fitted_runtime(model, palu_recipe(0.5, bits=4))
    cache = runtime.new_cache()
    ids = torch.randint(3, 128, (1, 72), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(input_ids=ids[:, :64], **with_cache(cache), use_cache=True)
        middle = cache.layers[1]

        def broken(*args, **kwargs):
            assert cache.context._cos_sin  # layer 0 shared its table
            raise RuntimeError("a middle layer fails")

        monkeypatch.setattr(middle, "_attend", broken)
        with pytest.raises(RuntimeError, match="a middle layer fails"):
            model(input_ids=ids[:, 64:65], **with_cache(cache), use_cache=True)
    assert not cache.context._cos_sin
