"""Float blocks (sinks, recent window, open block) in one byte per value: ``cache.float_dtype: float8_e4m3`` and
``int8``.

float8_e4m3: written saturating at +-448 (`store.to_float_slots`), no scale. int8: codes with one float16 scale per 32
channels of each token (`store.encode_int8_slots`: 8.5 bits per value). Both are read by the torch path (widened or
decoded), the CPU kernel (bytes decoded in registers; int8 codes times their scales) and the Triton kernels (general,
tiled and sparse); key summaries, token sums and the body formats' floats stay float16. The bytes held are what the
formats say, measured, walked and predicted."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from kvtool.errors import RecipeError
from kvtool.recipe import CacheSpec, EvictionSpec, QuantSpec, Recipe, load_recipe
from kvtool.recipe_summary import window_summary
from kvtool.runtime.memory import walked_nbytes
from kvtool.runtime.store import (
    INT8_SLOTS, decode_int8_slots, encode_int8_slots, encode_int8_slots_torch, int8_slots_numpy, int8_slots_on_host, round_trip_float_slots,
    slot_scale_group, to_float_slots, wide_float_dtype,
)
from tests.test_float_block_size import (
    KIVI, WINDOWLESS, assert_predicted_bytes_match_held, assert_triton_matches_torch, generate, with_float_block,
)
from tests.test_kernels import build_case, devices
from tests.tiny_models import featured_model, tiny_model

needs_numba = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

FP8 = torch.float8_e4m3fn
BYTE_FORMATS = {"float8_e4m3": FP8, "int8": INT8_SLOTS}  # recipe name: pool dtype


def in_bytes(recipe: Recipe, name: str = "float8_e4m3") -> Recipe:
    """``recipe`` with its float blocks in the one-byte format ``name``."""
    return dataclasses.replace(recipe, name=f"{recipe.name}-{name}", cache=dataclasses.replace(recipe.cache, float_dtype=name))


FLOAT_ONLY = Recipe(name="float-only", keys=QuantSpec(method="none", bits=16, path="keys"),
                    values=QuantSpec(method="none", bits=16, axis="token", path="values"))
H2O_FLOAT = dataclasses.replace(  # scored eviction of a float store: evicted slots refilled in place (`fill_holes`)
    FLOAT_ONLY, name="h2o-float", eviction=EvictionSpec(policy="h2o", budget_tokens=48, sink_tokens=2, window=8))
H2O_KIVI = dataclasses.replace(  # scored eviction of a quantized store: float slots compacted in order (`keep`)
    KIVI, name="h2o-kivi", eviction=EvictionSpec(policy="h2o", budget_tokens=64, sink_tokens=2, window=8))


# --- the recipe and the formats -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BYTE_FORMATS)
def test_the_recipe_takes_the_one_byte_formats_and_names_the_choices_otherwise(name):
    assert in_bytes(KIVI, name).cache.float_dtype == name
    with pytest.raises(RecipeError, match="float8_e4m3.*int8"):
        CacheSpec(float_dtype="float8")
    assert name in window_summary(in_bytes(KIVI, name))


def test_float8_slots_saturate_instead_of_turning_into_nan():
    x = torch.tensor([1000.0, -1000.0, 448.0, 0.1, -3e-4, 0.0])
    stored = to_float_slots(x, FP8)
    assert stored.dtype == FP8 and torch.isfinite(stored.float()).all()
    assert stored.float().tolist()[:3] == [448.0, -448.0, 448.0]
    assert torch.equal(stored.float()[3:], x[3:].to(FP8).float())
    assert wide_float_dtype(FP8) == torch.float16 and wide_float_dtype(torch.bfloat16) == torch.bfloat16
    assert wide_float_dtype(INT8_SLOTS) == torch.float16


def test_int8_slots_keep_every_value_within_half_a_step_of_its_group():
    """One float16 scale per 32 channels = the group's largest magnitude / 127: codes in [-127, 127], each value within
    half a step, the largest one exact up to the scale's float16 rounding; zeros stay zero; no overflow to inf."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 64, generator=g) * torch.linspace(0.01, 30, 64)  # channels of very different sizes
    x[0, 0, :32] = 0.0  # a group of zeros
    x[1, 1, 5] = 1e6  # beyond float16's largest / 127 x 127: the scale saturates, the codes clamp
    codes, scales = encode_int8_slots(x, 32)
    assert codes.dtype == torch.int8 and codes.shape == x.shape and scales.dtype == torch.float16 and scales.shape == (5, 3, 2)
    assert int(codes.abs().max()) == 127 and codes.min() >= -127
    held = decode_int8_slots(codes, scales)
    assert torch.isfinite(held).all() and torch.equal(held[0, 0, :32], torch.zeros(32))
    step = scales.float().repeat_interleave(32, dim=-1)
    error = (held - x).abs()
    error[1, 1, 5] = 0.0  # the saturated value
    assert (error <= 0.5 * step * (1 + 1e-3) + 1e-6).all()
    sqnr = 10 * torch.log10(x[2:].square().sum() / (held[2:] - x[2:]).square().sum())
    assert sqnr > 35, sqnr  # ~42 dB on Gemma-3-270M's K / V (benchmarks/RESULTS.md)
    assert slot_scale_group(256) == 32 and slot_scale_group(48) == 16 and slot_scale_group(24) == 8


def test_int8_slots_decoded_and_written_again_keep_their_codes():
    """A flush rewrites the window's tokens it keeps from their decoded values (`LayerStore._flush`): encoding what was
    decoded gives the same codes and scales back, so tokens do not drift while they wait."""
    g = torch.Generator().manual_seed(4)
    codes, scales = encode_int8_slots(torch.randn(200, 64, generator=g) * 4, 32)
    again = encode_int8_slots(decode_int8_slots(codes, scales), 32)
    assert torch.equal(again[0], codes) and torch.equal(again[1], scales)


# --- the store ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BYTE_FORMATS)
def test_the_float_pool_is_one_byte_and_what_sits_beside_it_is_float16(name):
    model = tiny_model("llama", kv_heads=2)
    _, cache = generate(model, in_bytes(load_recipe("rocketkv"), name), tokens=8)  # key summaries and token sums
    for layer in cache.layers:
        store, tensors = layer.store, layer.store.float_pool.tensors
        assert tensors["k"].dtype == BYTE_FORMATS[name] and tensors["v"].dtype == BYTE_FORMATS[name]
        beside = [n for n in ("kmax", "kmin", "ksum", "vsum") if n in tensors]
        assert beside and all(tensors[n].dtype == torch.float16 for n in beside)
        if name == "int8":  # a float16 scale per 32 channels of each slot (tiny models: head_dim 32)
            d = store.layout.head_dim
            assert tensors["ks"].shape == (tensors["k"].shape[0], store.fbs, 1, d // slot_scale_group(d))
            assert tensors["ks"].dtype == tensors["vs"].dtype == torch.float16
        else:
            assert "ks" not in tensors
    _, cache = generate(model, in_bytes(KIVI, name), tokens=8)
    for layer in cache.layers:
        assert layer.store.float_pool.tensors["k"].dtype == BYTE_FORMATS[name]
        assert layer.store.body_pool.tensors["k.scale"].dtype == torch.float16  # the format's floats


@pytest.mark.parametrize("name", BYTE_FORMATS)
@pytest.mark.parametrize("summaries", [{"summary_tokens": 4, "unread": "drop"}, {}], ids=["max-min", "sums"])
def test_summaries_written_with_each_token_equal_the_ones_recomputed_from_the_slots(summaries, name):
    """A decode step folds its key into the block's max / min (or its key and value into the block's sums) as stored
    (rounded to the one-byte format), so the running summaries equal a recomputation from what the slots hold (the sums
    up to float16 rounding)."""
    model = tiny_model("llama", kv_heads=2)
    base = load_recipe("rocketkv")
    recipe = in_bytes(dataclasses.replace(
        base, sparse_attention=dataclasses.replace(base.sparse_attention, min_tokens=16, **summaries)), name)
    expected = ["kmax", "kmin"] if summaries else ["ksum", "vsum"]
    _, cache = generate(model, recipe, tokens=12, batch=1)
    compared = 0
    for layer in cache.layers:
        store = layer.store
        if store._summaries_stale:
            continue
        names = [n for n in ("kmax", "kmin", "ksum", "vsum") if n in store.float_pool.tensors]
        assert set(expected) <= set(names)
        used = store.float_pool.in_use
        running = {n: store.float_pool.tensors[n][used].float() for n in names}
        store.refresh_summaries()
        for n, before in running.items():
            exact = n in ("kmax", "kmin")
            torch.testing.assert_close(before, store.float_pool.tensors[n][used].float(),
                                       rtol=0 if exact else 2e-3, atol=0 if exact else 2e-2)
        compared += 1
    assert compared > 0


# --- kernels against the dense reference ---------------------------------------------------------------------------

@needs_numba
@pytest.mark.parametrize("name", BYTE_FORMATS)
@pytest.mark.parametrize("side", ["uniform-2", "uniform-4", "turboquant-2.5-3.5"])
@pytest.mark.parametrize("fbs", [4, 16])
def test_cpu_kernel_reads_one_byte_float_blocks(side, fbs, name):
    from kvtool.runtime.kernels.cpu_decode import covers, cpu_decode_attention
    from tests.test_cpu_decode import _cpu_args

    dtype = BYTE_FORMATS[name]
    args, reference = build_case(side, 64, 4, "cpu", seed=fbs + 5, fbs=fbs, float_dtype=dtype)
    assert covers(args["formats"], dtype, 64) is None
    torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", [pytest.param("cpu", marks=needs_numba), pytest.param("triton", marks=needs_triton)])
def test_kernels_refuse_int8_pools_without_their_scales(kernel):
    """Codes read as if they were values would be garbage: every kernel refuses an int8 pool given without scales."""
    args, _ = build_case("uniform-4", 64, 4, "cpu", seed=3, float_dtype=INT8_SLOTS)
    args.pop("float_scales")
    if kernel == "cpu":
        from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention
        from tests.test_cpu_decode import _cpu_args

        with pytest.raises(ValueError, match="float_scales"):
            cpu_decode_attention(**_cpu_args(args))
        return
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    for choice in ("auto", "general"):
        with pytest.raises(ValueError, match="float_scales"):
            paged_decode_attention(**args, kernel=choice)


@needs_triton
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", BYTE_FORMATS)
@pytest.mark.parametrize("side, kernel", [("float", "auto"), ("float", "general"), ("uniform-4", "auto"),
                                          ("uniform-4", "general"), ("turboquant-2.5-3.5", "auto")])
def test_triton_kernels_read_one_byte_float_blocks(side, kernel, name, device):
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    args, reference = build_case(side, 64, 4, device, softcap=5.0, sinks=True, seed=11, fbs=8, float_dtype=BYTE_FORMATS[name])
    for splits in (1, 3):
        out = paged_decode_attention(**args, splits=splits, kernel=kernel)
        torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", BYTE_FORMATS)
def test_the_tiled_kernels_half_products_widen_one_byte_slots_to_float16(name, device):
    """precision "half" multiplies float16 operands: float8 tiles are widened (exactly) and int8 codes times their
    scales rounded once to float16 first, never multiplied in one byte with the query cast down."""
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    args, reference = build_case("uniform-4", 64, 4, device, seed=12, fbs=8, float_dtype=BYTE_FORMATS[name])
    out = paged_decode_attention(**args, kernel="auto", precision="half")
    torch.testing.assert_close(out.cpu(), reference, rtol=2e-2, atol=2e-2)
    half_args, _ = build_case("uniform-4", 64, 4, device, seed=12, fbs=8, float_dtype=torch.float16)
    scales = args.pop("float_scales", None)
    held_k, held_v = (args[n].float() if scales is None else decode_int8_slots(args[n], s) for n, s in
                      zip(("float_k", "float_v"), scales or (None, None)))
    half_args["float_k"], half_args["float_v"] = held_k.half(), held_v.half()  # the same values in float16
    same = paged_decode_attention(**half_args, kernel="auto", precision="half")
    torch.testing.assert_close(out, same, rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", BYTE_FORMATS)
def test_the_sparse_kernel_reads_one_byte_pools(name, device):
    """RocketKV's stage 2 reads listed float slots in place: float8 pools, and int8 codes with their scales."""
    from kvtool.runtime.kernels.sparse_decode import sparse_decode_attention
    from tests.test_kernels import sparse_listing

    g = torch.Generator().manual_seed(7)
    k_pool, v_pool, slots, valid, q, new_k, new_v = sparse_listing(g, device, 64, 4)
    scales = None
    if name == "int8":
        (k_pool, k_scales), (v_pool, v_scales) = (encode_int8_slots(x.float(), 32) for x in (k_pool, v_pool))
        scales = (k_scales, v_scales)
        held_k, held_v = decode_int8_slots(k_pool, k_scales).cpu(), decode_int8_slots(v_pool, v_scales).cpu()
    else:
        k_pool, v_pool = k_pool.to(FP8), v_pool.to(FP8)
        held_k, held_v = k_pool.cpu().float(), v_pool.cpu().float()
    out = sparse_decode_attention(q.to(device), new_k.to(device), new_v.to(device), k_pool, v_pool, slots.to(device),
                                  valid.to(device), None, None, float_scales=scales).cpu()
    for stream in range(slots.shape[0]):
        ids = slots[stream][valid[stream]]
        keys = torch.cat([held_k[ids], new_k[stream : stream + 1]])
        values = torch.cat([held_v[ids], new_v[stream : stream + 1]])
        want = torch.softmax(q[stream] @ keys.T, dim=-1) @ values
        torch.testing.assert_close(out[stream], want, rtol=1e-4, atol=1e-5)


# --- generation --------------------------------------------------------------------------------------------------------

def _kv_bytes_per_block(cache, layer) -> int:
    """Bytes of one float block's keys and values (with int8 slots' scales) in ``layer`` of ``cache``."""
    tensors = cache.layers[layer].store.float_pool.tensors
    return sum(tensors[n][0].numel() * tensors[n].element_size() for n in ("k", "v", "ks", "vs") if n in tensors)


@pytest.mark.parametrize("name", BYTE_FORMATS)
@pytest.mark.parametrize("recipe", [WINDOWLESS, KIVI, FLOAT_ONLY, H2O_FLOAT, H2O_KIVI], ids=lambda r: r.name)
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_one_byte_blocks_hold_what_the_format_says_and_generate_close_to_float16(recipe, family, name):
    """The same tokens held, the float blocks' K/V in one byte per value (int8: plus a float16 scale per 32 channels;
    measured = analytic = walked), logits close to 16-bit float blocks' and not equal to them (the bytes really are
    one byte)."""
    model = featured_model(family) if family != "llama" else tiny_model("llama", kv_heads=2)
    base, base_cache = generate(model, recipe)
    small, cache = generate(model, in_bytes(recipe, name))
    assert cache.memory_report()["kept_tokens"] == base_cache.memory_report()["kept_tokens"]
    saved = sum(
        layer.store.float_pool.used * (_kv_bytes_per_block(base_cache, i) - _kv_bytes_per_block(cache, i))
        for i, layer in enumerate(cache.layers)
    )
    d = cache.layers[0].store.layout.head_dim
    per_value = 1 + 2 / slot_scale_group(d) if name == "int8" else 1  # bytes per value of one K / V slot
    assert _kv_bytes_per_block(cache, 0) == _kv_bytes_per_block(base_cache, 0) * per_value / 2
    assert saved > 0 and base_cache.nbytes() - cache.nbytes() == saved
    assert cache.nbytes() == cache.expected_nbytes()
    assert walked_nbytes(cache) == cache.reserved_nbytes() + cache.constant_nbytes()
    # logits while both generated the same tokens: the prefill's equal (new tokens attend to each other at the model's
    # precision), the decode steps' close (they read the one-byte slots) and not equal
    ours, theirs = torch.stack(small.logits), torch.stack(base.logits)  # (steps, B, V)
    prompt = base.sequences.shape[1] - ours.shape[0]
    differs = (small.sequences[:, prompt:] != base.sequences[:, prompt:]).any(dim=0).nonzero()
    steps = int(differs[0]) + 1 if differs.numel() else ours.shape[0]
    assert steps >= 2 and torch.equal(ours[0], theirs[0])
    diff = (ours[1:steps] - theirs[1:steps]).abs().max()
    assert 0 < diff < 0.3 * theirs.abs().max(), (steps, diff)  # tiny random models: 3% per value adds up


def test_int8_blocks_are_closer_to_float16_than_float8_blocks():
    """8.5 bits with a scale per 32 channels keep more than e4m3's 3 mantissa bits: the decode steps' logits move less
    from the 16-bit cache's (tiny Gemma 3, KIVI with a window and float-only)."""
    model = featured_model("gemma3_text")
    for recipe in (KIVI, FLOAT_ONLY):
        base, _ = generate(model, recipe)
        diffs = {}
        for name in BYTE_FORMATS:
            out, _ = generate(model, in_bytes(recipe, name))
            diffs[name] = float((torch.stack(out.logits)[1:4] - torch.stack(base.logits)[1:4]).abs().mean())
        assert 0 < diffs["int8"] < 0.5 * diffs["float8_e4m3"], diffs


@pytest.mark.parametrize("name", BYTE_FORMATS)
def test_predicted_bytes_follow_one_byte_blocks(name):
    model = tiny_model("llama")
    for recipe in (WINDOWLESS, KIVI, FLOAT_ONLY):
        assert_predicted_bytes_match_held(model, in_bytes(with_float_block(recipe, 4), name))


@needs_numba
@pytest.mark.parametrize("name", BYTE_FORMATS)
@pytest.mark.parametrize("recipe", [WINDOWLESS, KIVI, FLOAT_ONLY, H2O_FLOAT], ids=lambda r: r.name)
def test_numba_generation_with_one_byte_blocks_equals_torch(recipe, name):
    """The kernel attends to the step's token as its slot holds it (as the torch path reads it back) and writes the
    same bytes (int8: the codes in the kernel, the scales beside them)."""
    from tests.test_cpu_decode import _assert_numba_matches_torch

    steps = {"h2o-float": 12, "float-only": 23}.get(recipe.name, 12)
    _assert_numba_matches_torch(tiny_model("llama", kv_heads=2), in_bytes(recipe, name), steps)


@needs_triton
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", BYTE_FORMATS)
def test_triton_generation_with_one_byte_blocks_equals_torch(name, device):
    model = tiny_model("llama", kv_heads=2).to(device)
    for recipe in (with_float_block(WINDOWLESS, 4), KIVI, FLOAT_ONLY):
        assert_triton_matches_torch(model, in_bytes(recipe, name))


@needs_triton
@pytest.mark.parametrize("device", devices())
def test_triton_generation_with_int8_blocks_and_a_sparse_read_equals_torch(device):
    """RocketKV's stage 2 on int8 float blocks: the sparse kernel reads codes and scales as the torch path decodes them."""
    model = tiny_model("llama", kv_heads=2).to(device)
    base = load_recipe("rocketkv")
    recipe = dataclasses.replace(base, sparse_attention=dataclasses.replace(base.sparse_attention, min_tokens=16))
    assert_triton_matches_torch(model, in_bytes(recipe, "int8"))


def test_int8_slots_encode_the_same_bits_in_numpy_and_in_torch():
    """CPU tensors are encoded in numpy (`int8_slots_on_host`: a decode step writes one token per stream and layer,
    where torch's dispatch costs more than the arithmetic), others in torch (`encode_int8_slots_torch`): the same codes,
    scales and values, halfway cases and zeros included, so every backend and device holds the same bytes."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, 256, generator=g) * torch.logspace(-6, 3, 256)
    x[0, 0, :32] = 0.0
    x[1, 2, :32] = torch.arange(32) * 0.5 - 8  # values landing on halfway codes
    x[1, 3, :32] = torch.logspace(-9, -7, 32)  # scales among float16's subnormals
    want_codes, want_scales = encode_int8_slots_torch(x, 32)
    for encode in (int8_slots_on_host, int8_slots_numpy):  # compiled (Numba) and numpy
        codes, scales, held = encode(x.numpy(), 32)
        assert torch.equal(torch.from_numpy(codes), want_codes) and torch.equal(torch.from_numpy(scales), want_scales)
        assert torch.equal(torch.from_numpy(held), decode_int8_slots(want_codes, want_scales))
    assert torch.equal(round_trip_float_slots(x, INT8_SLOTS), decode_int8_slots(want_codes, want_scales))


@needs_numba
def test_the_compiled_float16_rounding_of_scales_equals_torchs_cast():
    """`half_bits_of_scale` (float32 -> float16 bits in the CPU encoder, no float16 type in Numba) over the whole range
    the scales take: subnormals, normals, values exactly halfway between two float16 numbers, the largest."""
    from numba import njit

    from kvtool.runtime.kernels.cpu_decode_kernel import half_bits_of_scale

    @njit
    def all_bits(values):
        out = np.empty(values.shape[0], np.uint16)
        for i in range(values.shape[0]):
            out[i] = half_bits_of_scale(values[i])
        return out

    g = torch.Generator().manual_seed(6)
    halves = torch.arange(0, 0x7BFF, dtype=torch.int32).to(torch.int16).view(torch.float16).float()  # every finite >= 0
    ties = (halves[:-1] + halves[1:]) / 2  # exactly halfway (representable in float32)
    values = torch.cat([halves, ties, torch.rand(100000, generator=g) * 65504, torch.rand(10000, generator=g) * 1e-4,
                        torch.tensor([65504.0, 0.0])])
    got = torch.from_numpy(all_bits(values.numpy()).view(np.int16))
    assert torch.equal(got, values.to(torch.float16).view(torch.int16))
