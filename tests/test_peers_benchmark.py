"""benchmarks/peers.py without the peer environment (kvpress and quanto are not needed here, nor in CI).

* the bytes walked from a transformers cache are its K/V tensors, and "16-bit bytes" halves float32;
* kvtool's comparison rows evict at prefill only (kvpress's protocol): decoding appends without cuts;
* the side-by-side table refuses two sides that scored different windows.
"""

import json

import pytest
import torch
from transformers import DynamicCache

from benchmarks.eviction import eviction_recipe
from benchmarks.peers import cache_bytes, markdown_table, prefill_only
from kvtool.models.cache_argument import with_cache
from kvtool.runtime.attach import CompressedRuntime
from tests.tiny_models import tiny_model


def test_cache_bytes_of_a_dynamic_cache_are_its_keys_and_values():
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    ids = torch.randint(3, 100, (2, 10))  # (B, T)
    with torch.no_grad():
        model(ids, **with_cache(cache), use_cache=True)
    config = model.config
    elements = config.num_hidden_layers * 2 * 2 * config.num_key_value_heads * 10 * config.head_dim  # layers x K/V x (B, H_kv, T, D)
    assert cache_bytes(cache, float_as_16bit=True) == (4 * elements, 2 * elements)
    assert cache_bytes(cache, float_as_16bit=False) == (4 * elements, 4 * elements)


def test_kvtool_rows_evict_at_prefill_only():
    model = tiny_model("llama")
    seq_len, prefill = 160, 128
    ids = torch.randint(3, 100, (1, seq_len))  # (B, T)
    kept = {}
    for interval in (1, seq_len):
        recipe = eviction_recipe("snapkv", 0.5)
        recipe = prefill_only(recipe, seq_len) if interval == seq_len else prefill_only(recipe, 1)
        cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
        with torch.no_grad():
            model(ids[:, :prefill], **with_cache(cache), use_cache=True)
            for t in range(prefill, seq_len):
                model(ids[:, t:t + 1], **with_cache(cache), use_cache=True)
        kept[interval] = cache.kept_fraction()
    assert kept[seq_len] == pytest.approx((prefill // 2 + seq_len - prefill) / seq_len)  # half the prompt + every decoded token
    assert kept[1] == pytest.approx(0.5, abs=0.01)  # per-step eviction (kvtool eval ppl) stays at the budget


def test_table_refuses_sides_with_different_windows(tmp_path):
    for side, digest in (("peers", "a" * 64), ("kvtool", "b" * 64)):
        payload = {"windows_sha256": digest, "environment": {"transformers": "x"}, "rows": []}
        (tmp_path / f"peers_m_{side}.json").write_text(json.dumps(payload))
    with pytest.raises(SystemExit, match="different windows"):
        markdown_table("m", tmp_path)


def test_a_compressed_sliding_layer_masks_what_it_holds_as_the_latest_tokens():
    """`press_cache(model, "equal")`: after a press cut a sliding layer's keys, the mask covers exactly the tokens held
    (all visible) and the new one; uncut, it sizes the mask as transformers' own sliding layer does."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from benchmarks.peers import _compressed_sliding_layer

    window, seen = 8, 10
    own, ours = DynamicSlidingWindowLayer(window), DynamicSlidingWindowLayer(window)
    ours.__class__ = _compressed_sliding_layer(DynamicSlidingWindowLayer)
    for layer in (own, ours):
        layer.update(torch.randn(1, 1, seen, 4), torch.randn(1, 1, seen, 4))  # holds the last window - 1 = 7
    assert ours.get_mask_sizes(1) == own.get_mask_sizes(1) == (window, seen - window + 1)
    ours.keys, ours.values = ours.keys[:, :, :3], ours.values[:, :, :3]  # a press kept 3
    assert ours.get_mask_sizes(1) == (4, seen - 3)
    assert ours.get_mask_sizes(torch.arange(seen, seen + 1)) == (4, seen - 3)  # transformers 5.2 passes positions


def test_a_press_on_a_sliding_layer_keeps_what_a_global_layer_keeps():
    """`_window_share`: fed n tokens, a sliding layer holding w - 1 keeps (1 - ratio) n of them (all if more), and the
    press's own ratio is restored after."""
    from types import SimpleNamespace

    from benchmarks.peers import _window_share

    seen = []
    press = SimpleNamespace(compression_ratio=0.75)
    press.forward_hook = lambda module, args, kwargs, output: seen.append(press.compression_ratio)
    hook = _window_share(press)
    cache = SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(1, 1, 511, 4))])
    module = SimpleNamespace(layer_idx=0)
    for fed in (1024, 512, 4096):
        hook(module, (), {"past_key_values": cache, "hidden_states": torch.zeros(1, fed, 8)}, None)
    assert seen == pytest.approx([1 - 256 / 511, 1 - 128 / 511, 0.0])
    assert press.compression_ratio == 0.75
