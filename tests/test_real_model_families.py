"""The adapters on the real pretrained test models (SmolLM2-135M: Llama; Gemma 3 270M: sliding + global layers).

* the reading matches what the real model caches and asks its attention to do;
* Gemma 3's layout: 15 sliding-window (512) layers with the local RoPE base, 3 global ones with 1M, MQA, head_dim 256;
* the paged runtime: the no-op recipe generates transformers' tokens, and on a prompt longer than Gemma 3's
  window, 4-bit keeps the next-token distribution close.
"""

import pytest
import torch
from transformers import DynamicCache

from kvtool.models import adapter_for
from kvtool.models.cache_argument import with_cache
from kvtool.models.verify import check_adapter
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe
from tests.test_model_families import quant_recipe

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_reading_matches_the_real_model(name, request):
    model, _ = request.getfixturevalue(name)
    assert check_adapter(model, adapter_for(model)) == []


def test_gemma3_layers_windows_and_rope(gemma3):
    model, _ = gemma3
    adapter = adapter_for(model)
    g = adapter.geometry
    assert (g.family, g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim) == ("gemma3_text", 18, 4, 1, 256)
    specs = [adapter.layer_spec(i) for i in range(18)]
    global_layers = [i for i, spec in enumerate(specs) if spec.sliding_window is None]
    assert global_layers == [5, 11, 17]
    assert all(spec.sliding_window == 512 for i, spec in enumerate(specs) if i not in global_layers)
    assert all(spec.logit_softcap is None and not spec.has_sinks and spec.scaling == 256**-0.5 for spec in specs)
    local, global_ = specs[0].rope.inv_freq, specs[5].rope.inv_freq  # (128,)
    torch.testing.assert_close(local, 1.0 / 10000.0 ** (torch.arange(0, 256, 2).float() / 256))
    torch.testing.assert_close(global_, 1.0 / 1e6 ** (torch.arange(0, 256, 2).float() / 256))


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_noop_recipe_generates_transformers_tokens(name, request):
    model, tokenizer = request.getfixturevalue(name)
    batch = tokenizer(["The capital of France is", "Once upon a time, in a small village,"], return_tensors="pt", padding=True)
    kwargs = dict(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        reference = model.generate(**with_cache(DynamicCache(config=model.config)), **kwargs)
        ours = model.generate(**with_cache(CompressedRuntime.from_recipe(model, uncompressed_recipe("model")).new_cache()), **kwargs)
    assert torch.equal(ours, reference)


def test_gemma3_4bit_beyond_the_sliding_window(gemma3):
    """600 tokens: the sliding layers see only their last 512; 4-bit keys/values keep the next token's distribution close."""
    model, tokenizer = gemma3
    text = open(__file__).read() * 3
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :601]  # (1, 601)
    assert ids.shape[1] == 601

    def next_token_probs(cache):
        with torch.no_grad():
            model(input_ids=ids[:, :-1], **with_cache(cache), use_cache=True)
            return model(input_ids=ids[:, -1:], **with_cache(cache), use_cache=True).logits[0, -1].float().softmax(-1)

    exact = next_token_probs(DynamicCache(config=model.config))
    cache = CompressedRuntime.from_recipe(model, quant_recipe(4)).new_cache()
    quantized = next_token_probs(cache)
    for layer, window in zip(cache.layers, cache.context.sliding_windows):
        if window is None:  # global layers: 600 tokens -> 18 quantized blocks of 32
            assert (layer.store.body_len >= 18).all(), (layer.index, layer.store.body_len)
        else:  # sliding layers hold their window (whole blocks) plus the eviction slack, quantized too
            assert (layer.store.tokens() <= window + 32 + 15).all() and (layer.store.body_len >= 14).all(), layer.index
    total_variation = 0.5 * (quantized - exact).abs().sum().item()
    assert total_variation < 0.15, total_variation
    assert quantized.argmax() == exact.argmax()
