"""Runtime mechanics on tiny random models of every supported family.

* a no-op recipe generates exactly the tokens of transformers' own cache (greedy, batch of 2, left padding);
* 8-bit keeps next-token logits close, and a broken or switched-off quantizer cannot meet the same bound;
* the bytes the cache holds equal the analytic size and are fewer than the 16-bit cache.
"""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from kvtool.recipe import CacheSpec, QuantSpec, Recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe
from tests.tiny_models import FAMILIES, tiny_model, tiny_tokenizer_free_inputs


def make_recipe(bits: int, *, sinks=2, recent=8, block=32, float_dtype="float16", group=32) -> Recipe:
    method = "none" if bits == 16 else "uniform"
    return Recipe(
        name=f"test-{bits}",
        keys=QuantSpec(method=method, bits=bits, axis="channel", path="keys"),
        values=QuantSpec(method=method, bits=bits, axis="token", group_size=group, path="values"),
        cache=CacheSpec(block_size=block, sink_tokens=sinks, recent_tokens=recent, float_dtype=float_dtype),
    )


def generate(model, cache, new_tokens=40, **kwargs):
    input_ids, attention_mask = tiny_tokenizer_free_inputs(batch=2, seq=12)
    with torch.no_grad():
        return model.generate(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, pad_token_id=0, **kwargs,
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_noop_recipe_generates_exactly_the_plain_cache_tokens(family):
    model = tiny_model(family)
    reference = generate(model, DynamicCache(config=model.config), do_sample=False)
    # The body path is exercised too: with no recent window, full blocks go through the `none` quantizer.
    recipe = make_recipe(16, sinks=2, recent=0, float_dtype="model")
    cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
    ours = generate(model, cache, do_sample=False)
    assert ours.shape[1] >= 12 + 32
    assert torch.equal(ours, reference)
    assert all(layer.body_blocks() >= 1 for layer in cache.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_uncompressed_recipe_matches_plain_cache_with_sampling(family):
    model = tiny_model(family)
    torch.manual_seed(3)
    reference = generate(model, DynamicCache(config=model.config), do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(3)
    cache = CompressedRuntime.from_recipe(model, uncompressed_recipe()).new_cache()
    ours = generate(model, cache, do_sample=True, top_k=0, temperature=1.0)
    assert torch.equal(ours, reference)


def _next_token_logits(model, cache, ids):
    """Prefill ids[:, :-1] into the cache, then one decode step; returns (B, V) logits of the last step."""
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
        return model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits[:, -1].float()


def _relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_8bit_logits_stay_close_and_lower_bits_do_not(family):
    model = tiny_model(family)
    ids = torch.randint(3, 128, (2, 100), generator=torch.Generator().manual_seed(1))
    exact = _next_token_logits(model, CompressedRuntime.from_recipe(model, uncompressed_recipe()).new_cache(), ids)
    errors = {}
    for bits in (8, 4, 2):
        runtime = CompressedRuntime.from_recipe(model, make_recipe(bits, sinks=0, recent=0))
        cache = runtime.new_cache()
        errors[bits] = _relative_error(_next_token_logits(model, cache, ids), exact)
        assert all(layer.body_blocks() == 3 for layer in cache.layers)  # 99 tokens -> 3 quantized blocks of 32
    assert errors[8] < 0.01, errors
    assert errors[8] > 0, "8-bit cache returned exact logits: compression is not active"
    assert errors[2] > 4 * errors[8] and errors[4] > 2 * errors[8], errors


def _uniform_block_bytes(bits, head_dim, block, group):
    codes = block * head_dim * bits // 8
    key_scales = 2 * head_dim * 2  # fp16 scale + zero per channel
    value_scales = 2 * block * (head_dim // min(group, head_dim)) * 2  # fp16 scale + zero per token group
    return 2 * codes + key_scales + value_scales


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_cache_bytes_match_the_analytic_size_and_beat_16_bit(bits):
    model = tiny_model("llama")  # 2 layers, 2 KV heads, head_dim 32
    recipe = make_recipe(bits, sinks=2, recent=8)
    cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
    out = generate(model, cache, new_tokens=80, do_sample=False)
    tokens = out.shape[1] - 1  # the last generated token is never fed back
    assert cache.get_seq_length() == tokens
    blocks = (tokens - 2 - 8) // 32
    floats = tokens - blocks * 32
    per_layer = 2 * 2 * (2 * floats * 32 * 2) + 2 * 2 * blocks * _uniform_block_bytes(bits, 32, 32, 32)
    assert cache.nbytes() == cache.expected_nbytes() == 2 * per_layer
    assert cache.fp16_nbytes() == 2 * 2 * 2 * 2 * tokens * 32 * 2
    assert cache.nbytes() < cache.fp16_nbytes()
    report = cache.memory_report()
    assert report["bits_per_element"] < 16 and report["compression_ratio"] > 1


def test_cache_holds_packed_codes_not_floats():
    model = tiny_model("qwen2")
    cache = CompressedRuntime.from_recipe(model, make_recipe(4, sinks=0, recent=0)).new_cache()
    generate(model, cache, new_tokens=60, do_sample=False)
    layer = cache.layers[0]
    assert layer.body_k["codes"].dtype == torch.int32 and layer.body_v["codes"].dtype == torch.int32
    float_tokens = layer.recent_k.shape[2] + layer.sink_k.shape[2]
    assert float_tokens < 32, "tokens that filled a block must leave the float buffers"
    # (B, H_kv, N, S*D*bits/32): 4-bit codes of a 32x32 block are 128 words per stream
    assert layer.body_k["codes"].shape[:2] == (2, 2) and layer.body_k["codes"].shape[-1] == 128


def test_batch_rows_match_running_each_sequence_alone():
    model = tiny_model("llama")
    recipe = make_recipe(4, sinks=0, recent=0)
    ids = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(5))
    runtime = CompressedRuntime.from_recipe(model, recipe)
    both = _next_token_logits(model, runtime.new_cache(), ids)
    for row in range(2):
        alone = _next_token_logits(model, runtime.new_cache(), ids[row : row + 1])
        torch.testing.assert_close(both[row : row + 1], alone, rtol=1e-4, atol=1e-4)


def test_gqa_storage_is_per_kv_head_not_expanded():
    model = tiny_model("mistral", heads=4, kv_heads=1)
    cache = CompressedRuntime.from_recipe(model, make_recipe(4)).new_cache()
    generate(model, cache, new_tokens=50, do_sample=False)
    for tensor in cache.layers[0].storage_tensors():
        assert tensor.shape[1] == 1


def test_group_size_that_does_not_divide_head_dim_is_refused():
    from kvtool.errors import RecipeError

    model = tiny_model("llama", head_dim=48, hidden=96, heads=2, kv_heads=1)
    with pytest.raises(RecipeError, match="values.group_size"):
        CompressedRuntime.from_recipe(model, make_recipe(4, group=32))


def test_context_beyond_the_model_limit_is_refused():
    from kvtool.errors import RuntimeConfigError

    runtime = CompressedRuntime.from_recipe(tiny_model("llama"), make_recipe(4))
    with pytest.raises(RuntimeConfigError, match="context limit of 256"):
        runtime.check_context(300)


def test_beam_search_reorders_the_compressed_cache():
    model = tiny_model("llama")
    recipe = dataclasses.replace(make_recipe(16, recent=0, float_dtype="model"), name="noop")
    input_ids, attention_mask = tiny_tokenizer_free_inputs(batch=1, seq=12)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=40, num_beams=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        reference = model.generate(**kwargs)
        ours = model.generate(**kwargs, past_key_values=CompressedRuntime.from_recipe(model, recipe).new_cache())
    assert torch.equal(ours, reference)


def pre_rope_recipe(bits: int, **kwargs) -> Recipe:
    recipe = make_recipe(bits, **kwargs)
    return dataclasses.replace(recipe, keys=dataclasses.replace(recipe.keys, pre_rope=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_pre_rope_storage_rotates_back_at_true_positions_with_left_padding(family):
    """Keys stored before RoPE (16-bit, so only rotation error remains) give the plain cache's scores and tokens."""
    model = tiny_model(family)
    kwargs = dict(do_sample=False, output_scores=True, return_dict_in_generate=True)
    reference = generate(model, DynamicCache(config=model.config), **kwargs)
    runtime = CompressedRuntime.from_recipe(model, pre_rope_recipe(16, sinks=0, recent=0, float_dtype="model"))
    cache = runtime.new_cache()
    ours = generate(model, cache, **kwargs)
    assert all(layer.body_blocks() >= 1 for layer in cache.layers)
    assert torch.equal(ours.sequences, reference.sequences)
    for step_ours, step_ref in zip(ours.scores, reference.scores):
        torch.testing.assert_close(step_ours, step_ref, rtol=1e-4, atol=1e-4)
    # row 1 is left-padded by 3: its real tokens start at position 0, as generate() numbered them
    positions = cache.tracker.positions
    assert positions[0, :5].tolist() == [0, 1, 2, 3, 4]
    assert positions[1, 3:6].tolist() == [0, 1, 2]
    assert cache.nbytes() == cache.expected_nbytes()


def test_pre_rope_quantization_is_really_applied_before_rope():
    """The body of a pre-RoPE cache decodes (before re-rotation) to the quantized pre-RoPE keys."""
    from kvtool.models.rope import unapply_rope

    model = tiny_model("llama")
    runtime = CompressedRuntime.from_recipe(model, pre_rope_recipe(8, sinks=0, recent=0))
    cache = runtime.new_cache()
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        model(input_ids=ids, past_key_values=plain, use_cache=True)
    layer = cache.layers[1]
    cos, sin = runtime.adapter.rope_cos_sin(torch.arange(64)[None], torch.float32)
    pre_rope = unapply_rope(plain.layers[1].keys.float(), cos, sin)  # (1, H, 64, D)
    decoded = layer.key_quantizer.decode(layer.body_k).reshape(1, 2, 64, 32).float()
    error = (decoded - pre_rope).norm() / pre_rope.norm()
    assert error < 0.01  # 8-bit of the pre-RoPE keys
    post_rope_error = (decoded - plain.layers[1].keys.float()).norm() / pre_rope.norm()
    assert post_rope_error > 0.1  # it is not the post-RoPE keys
