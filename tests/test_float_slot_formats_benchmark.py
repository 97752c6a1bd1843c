"""`benchmarks.float_slot_formats`: the 8-bit formats it simulates, and that its patch really rounds what the store
holds (so its KL figures measure the format)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.float_slot_formats import patch, rounded
from kvtool.runtime.store import INT8_SLOTS, LayerStore, round_trip_float_slots, to_float_slots
from tests.test_byte_float_blocks import FLOAT_ONLY
from tests.test_float_block_size import generate
from tests.tiny_models import tiny_model


def _sqnr(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(10 * torch.log10(x.square().sum() / (x - y).square().sum()))


def test_finer_scales_give_more_sqnr_on_keys_with_an_outlier_channel():
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(0))
    x[:, 7] *= 40  # one channel 40x the rest, as real keys have
    sqnr = {fmt: _sqnr(x, rounded(x, fmt)) for fmt in ("e4m3", "int8-token", "int8-g64", "int8-g32")}
    assert sqnr["int8-token"] < sqnr["int8-g64"] < sqnr["int8-g32"]
    assert 28 < sqnr["e4m3"] < 33  # 3 mantissa bits, whatever the scale
    assert torch.equal(rounded(x, "e4m3"), to_float_slots(x, torch.float8_e4m3fn).float())  # = the shipped format
    assert torch.equal(rounded(x, "int8-g32").float(), round_trip_float_slots(x, INT8_SLOTS))  # = `float_dtype: int8`
    groups = rounded(x, "int8-g32").reshape(512, 8, 32)
    assert (groups.abs().amax(-1) > 0).all()  # no group rounded away


def test_an_unknown_format_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="int8-g"):
        rounded(torch.zeros(2, 64), "int4")


def test_the_patch_rounds_every_float_slot_the_store_holds(monkeypatch):
    import kvtool.runtime.kernels.cpu_decode as cpu_decode

    monkeypatch.setattr(LayerStore, "write_float", LayerStore.write_float)  # restored after the test
    monkeypatch.setattr(cpu_decode, "cpu_decode_attention", cpu_decode.cpu_decode_attention)
    patch("int8-g32")
    _, cache = generate(tiny_model("llama", kv_heads=2), FLOAT_ONLY, tokens=6)
    store = cache.layers[0].store
    held = store.float_pool.tensors["k"][store.float_pool.in_use].float()  # (blocks, fbs, g, D)
    assert held.abs().sum() > 0
    torch.testing.assert_close(rounded(held, "int8-g32").float(), held, rtol=0, atol=1e-3)  # already on the grid
