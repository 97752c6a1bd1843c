"""TurboQuant's 8-bit norms (``norm_bits: 8``): a log code per token over its block's own range of norms.

The codes, the bytes they save, the error they add (small beside the codes' own), and every reader against the
dense reference built from `decode_blocks`: the CPU kernel, the Triton kernel (interpreter; CUDA with the ``gpu``
marker), generation on both.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from kvtool.errors import RecipeError
from kvtool.methods.quant.turboquant import (
    NORM_LEVEL_UNITS,
    NORM_RANGE_OCTAVES,
    TurboQuantizer,
    decode_norms8,
    encode_norms8,
)
from kvtool.recipe import CacheSpec, QuantSpec, Recipe, load_recipe, recipe_from_dict
from tests.test_kernels import add_sides, devices

KEYS_35 = dict(method="turboquant", bits=3, extra_bits=0.5, outlier_channel_fraction=0.25)
VALUES_25 = dict(method="turboquant", bits=2, extra_bits=0.5, outlier_channel_fraction=0.5)
SIDES = {  # tests/test_kernels.py's build_case sides, with 8-bit norms
    "turboquant-3-norm8": (QuantSpec(method="turboquant", bits=3, norm_bits=8, path="keys"),
                           QuantSpec(method="turboquant", bits=3, norm_bits=8, path="values")),
    "turboquant-k3.5-v2.5-norm8": (QuantSpec(**KEYS_35, norm_bits=8, path="keys"),
                                   QuantSpec(**VALUES_25, norm_bits=8, path="values")),
    "turboquant-k3.5-v2.5-query-scale-norm8": (QuantSpec(**KEYS_35, channel_scale="query", norm_bits=8, path="keys"),
                                               QuantSpec(**VALUES_25, norm_bits=8, path="values")),
    "turboquant-keys-norm8-values-norm16": (QuantSpec(**KEYS_35, norm_bits=8, path="keys"),
                                            QuantSpec(**VALUES_25, path="values")),
}
QJL_SIDES = {
    "turboquant-qjl-norm8": (QuantSpec(method="turboquant", bits=3, qjl=True, norm_bits=8, path="keys"),
                             QuantSpec(method="turboquant", bits=3, norm_bits=8, path="values")),
    "turboquant-qjl-split-norm8": (QuantSpec(**KEYS_35, qjl=True, norm_bits=8, path="keys"),
                                   QuantSpec(**VALUES_25, norm_bits=8, path="values")),
}
needs_numba = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture
def sides(monkeypatch):
    add_sides(monkeypatch, {**SIDES, **QJL_SIDES})


# --- the codes ---------------------------------------------------------------------------------------------------

def test_norm_codes_read_back_within_half_a_step_of_the_blocks_own_range():
    g = torch.Generator().manual_seed(0)
    for spread in (0.05, 0.3, 1.5):  # log-normal norms: a block spans a factor ~1.2, ~3 and ~300
        norms = torch.exp(torch.randn(256, 16, generator=g) * spread) * 5  # (N, S)
        stored = encode_norms8(norms)
        assert stored.dtype == torch.uint8 and stored.shape == (256, 20)
        bounds = stored[:, -4:].contiguous().view(torch.int16).double()  # (N, 2) hi, lo in 1/1024 octave
        level = torch.log2(norms.double()) * NORM_LEVEL_UNITS
        assert (bounds[:, 0] >= level.amax(dim=1)).all() and (bounds[:, 1] <= level.amin(dim=1)).all()
        assert (bounds[:, 0] - level.amax(dim=1) < 1).all() and (level.amin(dim=1) - bounds[:, 1] < 1).all()
        half_step = (bounds[:, 0] - bounds[:, 1]) / 255 / 2 / NORM_LEVEL_UNITS  # (N,) octaves
        error = (torch.log2(decode_norms8(stored).double()) - torch.log2(norms.double())).abs()  # (N, S) octaves
        assert (error <= half_step[:, None] + 1e-6).all()
        assert error.max() > 0  # really coded: not the float norms again
    # a block whose norms span a factor 4 (keys) reads within 0.3%: far finer than a fixed 1/32-octave grid (1.1%)
    norms = torch.linspace(1.0, 4.0, 16)[None].repeat(8, 1) * torch.arange(1, 9)[:, None]
    assert (decode_norms8(encode_norms8(norms)) / norms - 1).abs().max() < 0.003


def test_norm_codes_of_equal_tiny_and_zero_norms():
    norms = torch.tensor([[8.0, 1e-9, 0.0, 4.0], [0.0, 0.0, 0.0, 0.0], [3e4, 1.0, 2.0, 3.0], [3.0, 3.0, 3.0, 3.0]])
    read = decode_norms8(encode_norms8(norms))
    assert torch.isfinite(read).all()
    floor = 8.0 * 2.0**-NORM_RANGE_OCTAVES  # the widest range a block spans: what lies under reads at its floor
    torch.testing.assert_close(read[0, 1:3], torch.full((2,), floor), rtol=2e-3, atol=0)
    torch.testing.assert_close(read[0, [0, 3]], torch.tensor([8.0, 4.0]), rtol=0.03, atol=0)
    assert (read[1] < 1e-9).all()  # an all-zero block reads (next to) zero
    torch.testing.assert_close(read[2], norms[2], rtol=0.025, atol=0)  # 15 octaves: steps of 1/17 octave
    torch.testing.assert_close(read[3], norms[3], rtol=1e-3, atol=0)  # one level: every code 0


def test_norm8_stores_fewer_norm_bytes_per_block():
    fp16 = TurboQuantizer(QuantSpec(**KEYS_35, path="keys"), 256, 16, torch.float16)
    norm8 = TurboQuantizer(QuantSpec(**KEYS_35, norm_bits=8, path="keys"), 256, 16, torch.float16)
    spec16, spec8 = fp16.block_spec(), norm8.block_spec()
    assert spec8["norm"] == ((20,), torch.uint8) and spec8["outlier_norm"] == ((20,), torch.uint8)
    assert spec16["norm"] == ((16,), torch.float16)
    assert fp16.stored_block_nbytes() - norm8.stored_block_nbytes() == 2 * (32 - 20)  # per instance: 16 fp16 -> 16 + 4 bytes


@pytest.mark.parametrize("spec", [dict(method="turboquant", bits=3), KEYS_35, VALUES_25])
def test_norm8_adds_little_error_beside_the_codes(spec):
    """The coded norm's error (about 0.3% RMS on these made-up norms, which span a factor ~40 per block) adds about 1e-5
    to a relative squared error of 1e-2 .. 1e-1: the 8-bit round trip's error is within 1% of the float16 one's (and
    not equal: the norms are really coded)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1, 32, 128, generator=g) * torch.linspace(0.2, 3, 128) * torch.rand(64, 1, 32, 1, generator=g)
    group = torch.zeros(64, dtype=torch.long)
    errors = []
    for bits in (16, 8):
        q = TurboQuantizer(QuantSpec(**spec, norm_bits=bits, path="keys"), 128, 32, torch.float32)
        y = q.decode_blocks(q.encode_blocks(x, group), group)
        errors.append(((y - x).square().sum() / x.square().sum()).item())
    assert errors[1] != errors[0]
    assert errors[1] < errors[0] * 1.01


# --- the recipe ----------------------------------------------------------------------------------------------------

def test_norm_bits_is_checked_in_the_recipe():
    assert QuantSpec(method="turboquant", bits=3, norm_bits=8).norm_bits == 8
    with pytest.raises(RecipeError, match=r"keys.norm_bits.*12 is not one of \[16, 8\]"):
        QuantSpec(method="turboquant", bits=3, norm_bits=12)
    with pytest.raises(RecipeError, match="values.norm_bits.*needs method 'turboquant', not 'uniform'"):
        QuantSpec(bits=3, norm_bits=8, path="values")
    with pytest.raises(RecipeError, match="norm_bits"):
        QuantSpec(method="turboquant", bits=3, norm_bits=True)
    recipe = Recipe(name="n8", keys=QuantSpec(**KEYS_35, norm_bits=8, path="keys"), values=QuantSpec(**VALUES_25, path="values"))
    assert recipe_from_dict(recipe.to_dict()) == recipe  # round trip through the manifest's form
    assert recipe.with_bits(16).keys.norm_bits == 16  # uncompressed: no turboquant field left behind


def test_the_bundled_norm8_recipe_holds_fewer_bytes_than_its_float16_norm_twin():
    recipe = load_recipe("turboquant-k3.5-v2.5-n8")
    assert recipe.keys.norm_bits == 8 and recipe.values.norm_bits == 8 and recipe.cache.block_size == 16
    assert recipe.cache.float_block_size == 4  # the open block's tokens in 4-token float blocks
    twin = dataclasses.replace(recipe, keys=dataclasses.replace(recipe.keys, norm_bits=16),
                               values=dataclasses.replace(recipe.values, norm_bits=16))
    k8, v8 = (TurboQuantizer(s, 256, 16, torch.float16) for s in (recipe.keys, recipe.values))
    k16, v16 = (TurboQuantizer(s, 256, 16, torch.float16) for s in (twin.keys, twin.values))
    bits = lambda q: q.bits_per_element()  # noqa: E731
    assert bits(k16) - bits(k8) == pytest.approx(2 * 12 * 8 / (16 * 256))
    assert bits(v16) - bits(v8) == pytest.approx(2 * 12 * 8 / (16 * 256))


# --- the kernels against the dense reference ---------------------------------------------------------------------

@needs_numba
@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("head_dim, gqa, bs", [(64, 4, 32), (256, 1, 16), (128, 8, 16)])
def test_cpu_kernel_reads_8_bit_norms_as_the_dense_reference(side, head_dim, gqa, bs, sides):
    from kvtool.runtime.kernels.cpu_decode import covers, cpu_decode_attention
    from tests.test_cpu_decode import _cpu_args
    from tests.test_kernels import build_case

    args, reference = build_case(side, head_dim, gqa, "cpu", seed=head_dim + gqa + bs, bs=bs)
    assert any(fmt.scales == "norm8" for fmt in args["formats"])
    assert covers(args["formats"], torch.float16, head_dim) is None
    torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)


@needs_numba
def test_the_cpu_kernel_compiles_once_per_float_pool_width(sides):
    """Every storage format goes through one compiled signature per float-pool width (16-bit bits as uint16; float8
    bytes and int8 codes as uint8), whatever its norms (fp16 or 8-bit, keys and values alike or not): a compiled
    signature costs seconds on first use (per machine, then cached on disk), so a signature per format multiplied the
    first run's wait (41 signatures across the test suite before, about 10 s each on the 2-core VM)."""
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention
    from kvtool.runtime.kernels.cpu_decode_kernel import combine, decode_step
    from kvtool.runtime.kernels.cpu_decode_rotated import decode_rotated_step
    from kvtool.runtime.store import INT8_SLOTS
    from tests.test_cpu_decode import _cpu_args
    from tests.test_kernels import build_case

    for side in ("uniform-4", "turboquant-2.5-3.5", "turboquant-3-norm8", "turboquant-keys-norm8-values-norm16"):
        for float_dtype in (torch.float16, torch.float8_e4m3fn, INT8_SLOTS):
            args, reference = build_case(side, 64, 4, "cpu", seed=7, fbs=4, float_dtype=float_dtype)
            torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)
    for kernel in (decode_step, decode_rotated_step, combine):
        assert len(kernel.signatures) <= 2, (kernel, kernel.signatures)


@needs_triton
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("side", [*SIDES, *QJL_SIDES])
@pytest.mark.parametrize("head_dim, gqa, bs", [(64, 4, 32), (256, 1, 16)])
def test_triton_kernel_reads_8_bit_norms_as_the_dense_reference(side, head_dim, gqa, bs, device, sides):
    """Under the interpreter on CPU (CI), on CUDA with the ``gpu`` marker."""
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention
    from tests.test_kernels import build_case

    args, reference = build_case(side, head_dim, gqa, device, seed=head_dim + gqa + bs + 7, bs=bs)
    out = paged_decode_attention(**args, kernel="general")
    torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)


# --- generation ----------------------------------------------------------------------------------------------------

NORM8_RECIPE = Recipe(
    name="tq-n8", keys=QuantSpec(**KEYS_35, norm_bits=8, path="keys"), values=QuantSpec(**VALUES_25, norm_bits=8, path="values"),
    cache=CacheSpec(sink_tokens=2, recent_tokens=0, block_size=16),
)


@needs_numba
def test_numba_generation_with_8_bit_norms_equals_torch_and_holds_fewer_bytes():
    from tests.test_cpu_decode import _assert_numba_matches_torch, _generate
    from tests.tiny_models import tiny_model, tiny_tokenizer_free_inputs

    model = tiny_model("llama", kv_heads=2)
    _assert_numba_matches_torch(model, NORM8_RECIPE, 12)
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=70)
    fp16_norms = dataclasses.replace(NORM8_RECIPE, keys=dataclasses.replace(NORM8_RECIPE.keys, norm_bits=16),
                                     values=dataclasses.replace(NORM8_RECIPE.values, norm_bits=16))
    _, small = _generate(model, NORM8_RECIPE, "torch", ids, mask)
    _, large = _generate(model, fp16_norms, "torch", ids, mask)
    blocks = sum(int(layer.store.body_len.sum()) for layer in small.layers)
    assert blocks > 0
    assert [int(layer.store.body_len.sum()) for layer in small.layers] == [int(layer.store.body_len.sum()) for layer in large.layers]
    saved = large.memory_report()["cache_bytes"] - small.memory_report()["cache_bytes"]
    assert saved == blocks * 2 * 2 * (2 * 16 - 20)  # per block: 2 sides x 2 instances x (32 - 20) bytes


@needs_triton
@pytest.mark.parametrize("device", devices())
def test_triton_generation_with_8_bit_norms_equals_torch(device):
    from tests.test_kernels import _generate
    from tests.tiny_models import tiny_model, tiny_tokenizer_free_inputs

    model = tiny_model("llama", kv_heads=2).to(device)
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=80)
    by_torch, _ = _generate(model, NORM8_RECIPE, "torch", ids, mask)
    by_triton, cache = _generate(model, NORM8_RECIPE, "triton", ids, mask)
    assert cache.memory_report()["backend"] == "triton"
    assert cache.memory_report()["kernel_steps"] >= 5 * model.config.num_hidden_layers
    assert torch.equal(by_torch.sequences, by_triton.sequences)
    torch.testing.assert_close(torch.stack(by_triton.logits), torch.stack(by_torch.logits), rtol=1e-3, atol=1e-3)
