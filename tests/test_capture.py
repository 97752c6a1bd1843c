"""Capture: pre-RoPE keys recovered inside the pass-through cache equal the keys computed directly."""

import pytest
import torch

from kvtool.calibration import QuantErrorStats
from kvtool.capture import ChannelStats, stream_batches
from kvtool.models.adapter import adapter_for
from kvtool.recipe import Recipe
from tests.tiny_models import FAMILIES, tiny_model


class Recorder:
    def __init__(self):
        self.seen = {}

    def observe(self, layer, keys_pre_rope, keys, values):
        self.seen[layer] = (keys_pre_rope, keys, values)


@pytest.mark.parametrize("family", FAMILIES)
def test_pre_rope_keys_match_the_projection(family):
    model = tiny_model(family)
    adapter = adapter_for(model)
    hidden = {}

    def keep_input(module, args, output):  # returns None: the module's output is left alone
        hidden["h"] = args[0]

    hook = adapter.kv_projection_inputs_module(1).register_forward_hook(keep_input)
    windows = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    recorder = Recorder()
    tokens = stream_batches(model, adapter, windows, [recorder], batch_size=2)
    hook.remove()
    assert tokens == 80
    expected_keys, expected_values = adapter.project_kv(1, hidden["h"])  # (B, H_kv, T, D)
    keys_pre, keys, values = recorder.seen[1]
    assert keys_pre.shape == (2, adapter.geometry.num_kv_heads, 40, adapter.geometry.head_dim)
    torch.testing.assert_close(keys_pre, expected_keys.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(values, expected_values.float(), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(keys, keys_pre)  # RoPE really was undone, not skipped


def test_channel_stats_equal_direct_statistics():
    model = tiny_model("llama")
    adapter = adapter_for(model)
    windows = torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(1))
    stats, recorder = ChannelStats(), Recorder()
    all_values = []

    class Keep:
        def observe(self, layer, keys_pre_rope, keys, values):
            if layer == 0:
                all_values.append(values)

    stream_batches(model, adapter, windows, [stats, recorder, Keep()], batch_size=2)  # two batches accumulate
    values = torch.cat(all_values)  # (4, H, T, D)
    flat = values.transpose(0, 1).reshape(values.shape[1], -1, values.shape[-1])
    tensors = stats.tensors()
    torch.testing.assert_close(tensors["layers.0.values.mean"], flat.mean(dim=1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tensors["layers.0.values.std"], flat.std(dim=1, unbiased=False), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(tensors["layers.0.values.absmax"], flat.abs().amax(dim=1))
    assert tensors["layers.1.keys_pre_rope.mean"].shape == (2, 32)


def test_quant_error_stats_rank_bit_widths():
    model = tiny_model("qwen3")
    adapter = adapter_for(model)
    windows = torch.randint(3, 128, (2, 64), generator=torch.Generator().manual_seed(2))
    observers = {bits: QuantErrorStats(Recipe().with_bits(bits), 32) for bits in (2, 4, 8)}
    stream_batches(model, adapter, windows, list(observers.values()), batch_size=2)
    sqnr = {bits: obs.summary() for bits, obs in observers.items()}
    for part in ("keys_sqnr_db", "values_sqnr_db"):
        assert sqnr[8][part] > sqnr[4][part] + 12 > sqnr[2][part] + 18, sqnr
    assert observers[4].sqnr_db()["quality.layers.1.values.sqnr_db"].shape == (2,)
