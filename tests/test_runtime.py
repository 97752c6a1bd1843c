"""Runtime mechanics on tiny random models of every supported family.

* a no-op recipe generates exactly the tokens of transformers' own cache (greedy, sampling, beams, left padding);
* 8-bit keeps next-token logits close, and a broken or switched-off quantizer cannot meet the same bound;
* the bytes the cache holds equal the analytic size of its blocks, are fewer than a 16-bit cache's,
  and equal what a walk over every tensor reachable from the cache finds (no hidden copies);
* keys stored before RoPE are re-rotated at their true positions (left padding, gaps).
"""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from kvtool.models.cache_argument import with_cache
from kvtool.recipe import CacheSpec, QuantSpec, Recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe
from kvtool.runtime.store import FLOAT_BLOCK
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
            input_ids=input_ids, attention_mask=attention_mask, **with_cache(cache), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, pad_token_id=0, **kwargs,
        )


def pre_rope_recipe(bits: int, **kwargs) -> Recipe:
    recipe = make_recipe(bits, **kwargs)
    return dataclasses.replace(recipe, keys=dataclasses.replace(recipe.keys, pre_rope=True))


def body_blocks(cache) -> list[int]:
    return [int(layer.store.body_len.min()) for layer in cache.layers]


@pytest.mark.parametrize("family", FAMILIES)
def test_noop_recipe_generates_exactly_the_plain_cache_tokens(family):
    model = tiny_model(family)
    reference = generate(model, DynamicCache(config=model.config), do_sample=False)
    cache = CompressedRuntime.from_recipe(model, make_recipe(16, float_dtype="model")).new_cache()
    ours = generate(model, cache, do_sample=False)
    assert ours.shape[1] >= 12 + 32
    assert torch.equal(ours, reference)
    assert cache.nbytes() == cache.expected_nbytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_uncompressed_recipe_matches_plain_cache_with_sampling(family):
    model = tiny_model(family)
    torch.manual_seed(3)
    reference = generate(model, DynamicCache(config=model.config), do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(3)
    cache = CompressedRuntime.from_recipe(model, uncompressed_recipe("model")).new_cache()
    ours = generate(model, cache, do_sample=True, top_k=0, temperature=1.0)
    assert torch.equal(ours, reference)


def _next_token_logits(model, cache, ids):
    """Prefill ids[:, :-1] into the cache, then one decode step; returns (B, V) logits of the last step."""
    with torch.no_grad():
        model(input_ids=ids[:, :-1], **with_cache(cache), use_cache=True)
        return model(input_ids=ids[:, -1:], **with_cache(cache), use_cache=True).logits[:, -1].float()


def _relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_8bit_logits_stay_close_and_lower_bits_do_not(family):
    model = tiny_model(family)
    ids = torch.randint(3, 128, (2, 100), generator=torch.Generator().manual_seed(1))
    exact = _next_token_logits(model, CompressedRuntime.from_recipe(model, uncompressed_recipe()).new_cache(), ids)
    errors = {}
    for bits in (8, 4, 2):
        cache = CompressedRuntime.from_recipe(model, make_recipe(bits, sinks=0, recent=0)).new_cache()
        errors[bits] = _relative_error(_next_token_logits(model, cache, ids), exact)
        assert body_blocks(cache) == [3, 3]  # 99 tokens -> 3 quantized blocks of 32 per stream
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
    cache = CompressedRuntime.from_recipe(model, make_recipe(bits, sinks=2, recent=8)).new_cache()
    out = generate(model, cache, new_tokens=180, do_sample=False)
    tokens = out.shape[1] - 1  # the last generated token is never fed back
    assert cache.get_seq_length() == tokens
    per_layer = 0
    for real in (tokens, tokens - 3):  # row 1 is left-padded by 3: padding is never stored
        blocks = (real - 2 - 8) // 32
        floats = real - blocks * 32
        float_blocks = -(-floats // FLOAT_BLOCK)
        per_layer += 2 * (float_blocks * FLOAT_BLOCK * 2 * 32 * 2 + blocks * _uniform_block_bytes(bits, 32, 32, 32))
    layer = cache.layers[0]
    tables = layer.store.metadata_nbytes() + 8 * 2 + 8 * 4  # tables, lengths (B,), stream groups (S,)
    assert cache.nbytes() == cache.expected_nbytes() == 2 * (per_layer + tables)
    assert cache.fp16_nbytes() == 2 * 2 * 2 * (2 * tokens - 3) * 32 * 2
    assert cache.nbytes() < cache.fp16_nbytes()
    report = cache.memory_report()
    assert report["bits_per_element"] < 16 and report["compression_ratio"] > 1


def test_cache_holds_packed_codes_not_floats():
    model = tiny_model("qwen2")
    cache = CompressedRuntime.from_recipe(model, make_recipe(4, sinks=0, recent=0)).new_cache()
    generate(model, cache, new_tokens=60, do_sample=False)
    store = cache.layers[0].store
    assert store.body_pool.tensors["k.codes"].dtype == torch.uint8 and store.body_pool.tensors["v.codes"].dtype == torch.uint8
    assert store.body_pool.tensors["k.codes"].shape[1:] == (32 * 4 // 8, 32)  # 4-bit codes of 32 tokens x 32 channels
    assert int(store.float_len.max()) < 32, "tokens that filled a block must leave the float blocks"
    assert store.float_pool.used <= store.streams * 2


def test_batch_rows_match_running_each_sequence_alone():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(5))
    runtime = CompressedRuntime.from_recipe(model, make_recipe(4, sinks=0, recent=0))
    both = _next_token_logits(model, runtime.new_cache(), ids)
    for row in range(2):
        alone = _next_token_logits(model, runtime.new_cache(), ids[row : row + 1])
        torch.testing.assert_close(both[row : row + 1], alone, rtol=1e-4, atol=1e-4)


def test_gqa_storage_is_per_kv_head_not_expanded():
    model = tiny_model("mistral", heads=4, kv_heads=1)
    cache = CompressedRuntime.from_recipe(model, make_recipe(4)).new_cache()
    generate(model, cache, new_tokens=50, do_sample=False)
    store = cache.layers[0].store
    assert store.streams == 2  # 2 sequences x 1 KV head, not 4 query heads
    assert store.float_pool.tensors["k"].shape[1:] == (FLOAT_BLOCK, 1, 32)


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


def test_backend_switch_resolves_once_and_refuses_what_cannot_run(monkeypatch):
    from kvtool.errors import RuntimeConfigError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU without the interpreter cannot run the kernels
    model = tiny_model("llama")
    assert CompressedRuntime.from_recipe(model, make_recipe(4), backend="torch").new_cache().memory_report()["backend"] == "torch"
    from kvtool.runtime.kernels.cpu_decode import numba_available

    on_cpu = "numba" if numba_available() else "torch"  # auto on CPU: the Numba kernel, never Triton
    assert CompressedRuntime.from_recipe(model, make_recipe(4), backend="auto").backend == on_cpu
    with pytest.raises(RuntimeConfigError, match="triton"):
        CompressedRuntime.from_recipe(model, make_recipe(4), backend="triton")
    with pytest.raises(RuntimeConfigError, match="unknown"):
        CompressedRuntime.from_recipe(model, make_recipe(4), backend="cuda-magic")


@pytest.mark.parametrize("bits", [16, 4])
def test_beam_search_reorders_the_cache(bits):
    model = tiny_model("llama")
    recipe = make_recipe(bits, sinks=2, recent=0, float_dtype="model")
    input_ids, attention_mask = tiny_tokenizer_free_inputs(batch=1, seq=12)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=40, num_beams=3, do_sample=False, pad_token_id=0)
    cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
    with torch.no_grad():
        reference = model.generate(**kwargs)
        ours = model.generate(**kwargs, **with_cache(cache))
    if bits == 16:
        assert torch.equal(ours, reference)
    assert cache.nbytes() == cache.expected_nbytes()
    for layer in cache.layers:  # beams that were copies got their own blocks; nothing leaked
        for pool in (layer.store.float_pool, layer.store.body_pool):
            if pool is not None:
                assert pool.capacity <= 1.25 * pool.used + layer.store.streams + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_pre_rope_storage_rotates_back_at_true_positions_with_left_padding(family):
    """Keys stored before RoPE (16-bit, so only rotation error remains) give the plain cache's scores and tokens."""
    model = tiny_model(family)
    kwargs = dict(do_sample=False, output_scores=True, return_dict_in_generate=True)
    reference = generate(model, DynamicCache(config=model.config), **kwargs)
    cache = CompressedRuntime.from_recipe(model, pre_rope_recipe(16, sinks=0, recent=0, float_dtype="model")).new_cache()
    ours = generate(model, cache, **kwargs)
    assert all(n >= 1 for n in body_blocks(cache))
    assert torch.equal(ours.sequences, reference.sequences)
    for step_ours, step_ref in zip(ours.scores, reference.scores):
        torch.testing.assert_close(step_ours, step_ref, rtol=1e-4, atol=1e-4)
    # row 1 is left-padded by 3: its real tokens start at position 0, as generate() numbered them
    recorded = cache.context.sequence_positions
    assert recorded.table[0, :5].tolist() == [0, 1, 2, 3, 4]
    assert recorded.table[1, :3].tolist() == [0, 1, 2] and int(recorded.count[1]) == int(recorded.count[0]) - 3
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
        model(input_ids=ids, **with_cache(cache), use_cache=True)
        model(input_ids=ids, **with_cache(plain), use_cache=True)
    layer = cache.layers[1]
    cos, sin = runtime.adapter.rope_cos_sin(torch.arange(64)[None], torch.float32)
    pre_rope = unapply_rope(plain.layers[1].keys.float(), cos, sin)  # (1, H, 64, D)
    store = layer.store
    blocks = store.read_body("k", store.body_block_ids(0, 2))  # (S, 2, ...)
    decoded = layer.key_format._decode_chunk(blocks, layer.group_of_stream)  # (S, 1, 64, D), not re-rotated
    decoded = decoded.reshape(1, 2, 64, 32)
    error = (decoded - pre_rope).norm() / pre_rope.norm()
    assert error < 0.01  # 8-bit of the pre-RoPE keys
    post_rope_error = (decoded - plain.layers[1].keys.float()).norm() / pre_rope.norm()
    assert post_rope_error > 0.1  # it is not the post-RoPE keys
    keys, _, positions, valid = layer.decoded()  # the cache's own view: re-rotated at the true positions
    assert bool(valid.all()) and positions[0, 0].tolist() == list(range(64))
    assert ((keys - plain.layers[1].keys).norm() / plain.layers[1].keys.norm()) < 0.01


def test_positions_probe_is_not_overwritten_by_the_cache_and_pins_nothing():
    """kvtool's own RoPE never calls the rotary module, and the probes forget the forward's tensors."""
    model = tiny_model("llama")
    runtime = CompressedRuntime.from_recipe(model, pre_rope_recipe(8, sinks=0, recent=0))
    cache = runtime.new_cache()
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(100, 170)[None]
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, **with_cache(cache))
    recorded = cache.context.sequence_positions
    assert recorded.table[0, :70].tolist() == list(range(100, 170))
    assert runtime.probes.positions is None and runtime.probes.input_ids is None
