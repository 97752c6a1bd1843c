"""Every tested decoder family, read generically, checked against the model's own forward and run through the runtime.

One tiny model per family (`tests.tiny_models.featured_model`: 2 layers, hidden 64, with the
family's distinctive attention features on). Per family:

* the adapter's reading (K/V projections, norms, per-layer RoPE, windows, soft-cap, sinks,
  scaling) reproduces what the model caches and asks its attention function to do;
* `RopeSpec.cos_sin` equals the model's rotary module output, per layer type, without calling it;
* the paged runtime end to end (kvtool's own attention over its store applies the family's
  sliding windows, soft-capping, sink logits, scaling and per-layer RoPE): the no-op recipe
  generates exactly transformers' tokens, 4-bit keeps next-token logits within a tolerance, a
  left-padded batch of two generates transformers' tokens, keys stored before RoPE (re-rotated
  with each layer's own RoPE, interleaved for Cohere) come back exactly, and an evicting cache
  keeping every token reproduces the model.
"""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from kvtool.models import adapter_for
from kvtool.models.cache_argument import with_cache
from kvtool.models.verify import check_adapter
from kvtool.recipe import CacheSpec, EvictionSpec, QuantSpec, Recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe
from tests.tiny_models import ALL_FAMILIES, WINDOW, featured_model, tiny_tokenizer_free_inputs

# What each featured model must be read as: per layer (sliding_window, logit_softcap, has_sinks, scaling, rotary_dim).
_PLAIN = (None, None, False, 32**-0.5, 32)
EXPECTED_SPECS = {
    "llama": [_PLAIN] * 2,
    "mistral": [(WINDOW, None, False, 32**-0.5, 32)] * 2,
    "mixtral": [(WINDOW, None, False, 32**-0.5, 32)] * 2,
    "qwen2": [_PLAIN, (WINDOW, None, False, 32**-0.5, 32)],
    "qwen2_moe": [_PLAIN] * 2,
    "qwen3": [_PLAIN] * 2,
    "qwen3_moe": [_PLAIN] * 2,
    "phi3": [(None, None, False, 32**-0.5, 16)] * 2,  # partial rotary 0.5
    "gemma": [_PLAIN] * 2,
    "gemma2": [(WINDOW, 1.0, False, 0.25, 32), (None, 1.0, False, 0.25, 32)],  # query_pre_attn_scalar 16
    "gemma3_text": [(WINDOW, None, False, 0.25, 32), (None, None, False, 0.25, 32)],
    "olmo2": [_PLAIN] * 2,
    "granite": [(None, None, False, 0.05, 32)] * 2,  # attention_multiplier
    "starcoder2": [(WINDOW, None, False, 32**-0.5, 32)] * 2,
    "cohere": [_PLAIN] * 2,
    "gpt_oss": [(WINDOW, None, True, 32**-0.5, 32), (None, None, True, 32**-0.5, 32)],
}

def _matrix(check: str):
    """Every family, one test id each (kept as a hook: a family the runtime cannot run gets its xfail here, by name)."""
    return [pytest.param(family, id=family) for family in ALL_FAMILIES]


@pytest.fixture(scope="module")
def models():
    """One featured tiny model per family, built once for the module."""
    return {family: featured_model(family) for family in ALL_FAMILIES}


# ----- the adapter's reading -------------------------------------------------------------------


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_reading_matches_what_the_model_caches_and_asks_attention_to_do(family, models):
    model = models[family]
    adapter = adapter_for(model)
    with torch.no_grad():  # make zero-initialised biases matter where a family has them
        for layer in range(adapter.geometry.num_layers):
            for bias in adapter.kv_projection_biases(layer):
                if bias is not None:
                    bias.normal_()
    try:
        assert check_adapter(model, adapter) == []
    finally:
        with torch.no_grad():
            for layer in range(adapter.geometry.num_layers):
                for bias in adapter.kv_projection_biases(layer):
                    if bias is not None:
                        bias.zero_()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_layer_specs_read_the_family_features(family, models):
    adapter = adapter_for(models[family])
    got = []
    for i in range(adapter.geometry.num_layers):
        spec = adapter.layer_spec(i)
        got.append((spec.sliding_window, spec.logit_softcap, spec.has_sinks, round(spec.scaling, 6), spec.rope.rotary_dim))
    want = [(w, c, s, round(scale, 6), r) for w, c, s, scale, r in EXPECTED_SPECS[family]]
    assert got == want
    assert adapter.geometry.sliding_windows == tuple(w for w, *_ in EXPECTED_SPECS[family])
    assert (adapter.attention_sinks(0) is not None) == (family == "gpt_oss")


def test_gemma3_local_and_global_layers_have_their_own_rope(models):
    adapter = adapter_for(models["gemma3_text"])
    local, global_ = adapter.layer_spec(0).rope, adapter.layer_spec(1).rope
    assert not local.same_as(global_)
    base = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    torch.testing.assert_close(local.inv_freq, base)
    torch.testing.assert_close(global_.inv_freq, 1.0 / (1e6 ** (torch.arange(0, 32, 2).float() / 32)) / 8.0)  # linear x8
    assert adapter.geometry.num_kv_heads == 1  # MQA
    assert not adapter.keys_linear_in_input  # k_norm before RoPE


def test_generic_reading_without_the_gemma3_override_claims_a_softcap_the_model_never_applies():
    from kvtool.models.adapter import ModelAdapter

    model = featured_model("gemma3_text", attn_logit_softcapping=5.0)
    assert check_adapter(model, adapter_for(model)) == []  # the registered override
    problems = check_adapter(model, ModelAdapter(model))
    assert problems and all("softcap None vs spec 5.0" in line for line in problems)


# ----- RoPE: the spec against the model's own rotary module -------------------------------------


def _module_cos_sin(rotary, positions, layer_type=None):
    """The rotary module's own cos/sin (called normally), widened to (..., R) for half-width layouts."""
    args = (layer_type,) if layer_type else ()
    with torch.no_grad():
        cos, sin = rotary(torch.empty(0), positions, *args)
    return cos, sin


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_rope_spec_equals_the_rotary_module(family, models):
    model = models[family]
    adapter = adapter_for(model)
    positions = torch.tensor([[0, 1, 2, 3, 40, 41, 200], [5, 6, 7, 8, 9, 10, 255]])  # (B, T): beyond yarn/llama3's 64
    for i in range(adapter.geometry.num_layers):
        layer_type = model.config.layer_types[i] if isinstance(adapter.rotary_emb.rope_type, dict) else None
        cos, sin = adapter.layer_spec(i).rope.cos_sin(positions)
        theirs_cos, theirs_sin = _module_cos_sin(adapter.rotary_emb, positions, layer_type)
        if theirs_cos.shape[-1] * 2 == cos.shape[-1]:  # GPT-OSS: half-width, rotated as halves
            theirs_cos, theirs_sin = theirs_cos.repeat(1, 1, 2), theirs_sin.repeat(1, 1, 2)
        assert torch.equal(cos, theirs_cos) and torch.equal(sin, theirs_sin), f"layer {i}"


@pytest.mark.parametrize(
    "family, rope, lengths",
    [
        ("phi3", {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                  "original_max_position_embeddings": 64, "short_factor": [1.0 + i / 10 for i in range(4)],
                  "long_factor": [2.0 + i for i in range(4)]}, (50, 200)),
        ("llama", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, (100, 400)),
        ("llama", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}, (100,)),
    ],
    ids=["phi3-longrope", "llama-dynamic", "llama-yarn"],
)
def test_rope_spec_follows_length_dependent_frequencies(family, rope, lengths):
    # head_dim = hidden / heads: transformers validates longrope factors against that (R/2 = 16 * 0.5 / 2)
    adapter = adapter_for(featured_model(family, rope_parameters=rope, head_dim=16))
    spec = adapter.layer_spec(0).rope
    for length in lengths:  # short then long: the module switches frequencies (longrope) or grows them (dynamic)
        positions = torch.arange(length)[None]
        cos, sin = _module_cos_sin(adapter.rotary_emb, positions)
        ours_cos, ours_sin = spec.cos_sin(positions)
        assert torch.equal(ours_cos, cos) and torch.equal(ours_sin, sin), length
    if rope["rope_type"] == "yarn":
        assert spec.attention_scaling > 1.0  # yarn scales cos and sin


def test_rope_spec_never_calls_the_rotary_module(models):
    """The runtime hooks the rotary module to learn each forward's position_ids: kvtool's own RoPE must not fire it."""
    model = models["gemma3_text"]
    calls = []
    handle = model.model.rotary_emb.register_forward_hook(lambda *args: calls.append(1))
    try:
        adapter = adapter_for(model)
        positions = torch.arange(20)[None]
        adapter.layer_spec(1).rope.cos_sin(positions)
        adapter.rope_cos_sin(positions, layer=0)
        adapter.layer_spec(0).rope.unapply(adapter.layer_spec(0).rope.apply(torch.randn(1, 1, 20, 32), positions), positions)
    finally:
        handle.remove()
    assert calls == []


def test_rope_cos_sin_without_a_layer_is_refused_where_layers_differ(models):
    from kvtool.errors import ModelError

    adapter = adapter_for(models["gemma3_text"])
    with pytest.raises(ModelError, match="layer=i"):
        adapter.rope_cos_sin(torch.arange(4)[None])
    cos, _ = adapter_for(models["llama"]).rope_cos_sin(torch.arange(4)[None], torch.bfloat16)
    assert cos.dtype == torch.bfloat16 and cos.shape == (1, 4, 32)


# ----- the runtime, end to end ----------------------------------------------------------------


def quant_recipe(bits: int) -> Recipe:
    method = "none" if bits == 16 else "uniform"
    return Recipe(
        name=f"families-{bits}",
        keys=QuantSpec(method=method, bits=bits, axis="channel", path="keys"),
        values=QuantSpec(method=method, bits=bits, axis="token", group_size=32, path="values"),
        cache=CacheSpec(block_size=32, sink_tokens=0, recent_tokens=0, float_dtype="model" if bits == 16 else "float16"),
    )


def _generate(model, cache, batch: int, new_tokens: int = 40):
    input_ids, attention_mask = tiny_tokenizer_free_inputs(batch=batch, seq=12)
    with torch.no_grad():
        return model.generate(
            input_ids=input_ids, attention_mask=attention_mask, **with_cache(cache), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
        )


def _same_tokens_as_transformers(model, recipe, batch: int):
    """Greedy tokens equal transformers' own (DynamicCache), and every step's scores agree to 1e-4."""
    reference = _generate(model, DynamicCache(config=model.config), batch)
    ours = _generate(model, CompressedRuntime.from_recipe(model, recipe).new_cache(), batch)
    assert ours.sequences.shape[1] == 12 + 40  # longer than the sliding windows (16) and one full 32-token block
    assert torch.equal(ours.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(reference.scores), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", _matrix("noop"))
def test_noop_recipe_generates_transformers_tokens(family, models):
    _same_tokens_as_transformers(models[family], uncompressed_recipe("model"), batch=1)


@pytest.mark.parametrize("family", _matrix("batch"))
def test_left_padded_batch_of_two_generates_transformers_tokens(family, models):
    _same_tokens_as_transformers(models[family], quant_recipe(16), batch=2)  # body blocks through the `none` quantizer


@pytest.mark.parametrize("family", _matrix("pre_rope"))
def test_keys_stored_before_rope_come_back_exactly(family, models):
    recipe = quant_recipe(16)
    recipe = dataclasses.replace(recipe, keys=dataclasses.replace(recipe.keys, pre_rope=True))
    _same_tokens_as_transformers(models[family], recipe, batch=2)


@pytest.mark.parametrize("family", _matrix("kvtool_attention"))
def test_kvtool_attention_keeping_every_token_reproduces_the_model(family, models):
    """The eviction path (scored attention, per-slot positions) keeping every token reproduces the model."""
    spec = EvictionSpec(policy="streamingllm", budget=1.0, sink_tokens=2, window=4)
    recipe = dataclasses.replace(uncompressed_recipe("model"), name="keep-all", eviction=spec)
    _same_tokens_as_transformers(models[family], recipe, batch=2)


def _next_token_logits(model, cache, ids):
    """Prefill ids[:, :-1], then one decode step; (B, V) float32 logits of that step."""
    with torch.no_grad():
        model(input_ids=ids[:, :-1], **with_cache(cache), use_cache=True)
        return model(input_ids=ids[:, -1:], **with_cache(cache), use_cache=True).logits[:, -1].float()


@pytest.mark.parametrize("family", _matrix("4bit"))
def test_4bit_logits_stay_within_tolerance(family, models):
    model = models[family]
    ids = torch.randint(3, 128, (2, 100), generator=torch.Generator().manual_seed(1))
    exact = _next_token_logits(model, DynamicCache(config=model.config), ids)
    errors = {}
    for bits in (8, 4):
        cache = CompressedRuntime.from_recipe(model, quant_recipe(bits)).new_cache()
        errors[bits] = ((_next_token_logits(model, cache, ids) - exact).norm() / exact.norm()).item()
        for layer, window in zip(cache.layers, cache.context.sliding_windows or [None] * len(cache.layers)):
            if window is None:  # 100 tokens -> 3 quantized blocks of 32 + 4 in float
                assert (layer.store.body_len == 3).all(), (layer.index, layer.store.body_len)
            else:  # a sliding-window layer frees what its window no longer sees (a body block whole)
                assert (layer.store.tokens() <= window + 32 + 15).all() and (layer.store.tokens() < 100).all()
    assert errors[8] < 0.02 and errors[4] < 0.2, errors
    windows = cache.context.sliding_windows or [None]
    if any(w is None or w > 64 for w in windows):
        assert errors[4] > 4 * errors[8] > 0, errors  # compression is active and bits matter
    else:  # every layer slides over fewer tokens than a block plus its slack: they stay in float, nothing to quantize
        assert all((layer.store.body_len == 0).all() for layer in cache.layers)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_attention_profiling_keeps_softcap_and_sinks(family, models):
    """Profiling runs the model unchanged (soft-capping, sink logits) and sees the probabilities the model uses."""
    from kvtool.attention_profile import AttentionProfiler
    from kvtool.models.attention_hook import attention_handler, install

    model = models[family]
    ids, _ = tiny_tokenizer_free_inputs(batch=2, seq=40)
    model.set_attn_implementation("eager")
    weights = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: weights.__setitem__(i, out[1]))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            reference = model(input_ids=ids, use_cache=False, output_attentions=True).logits
    finally:
        for hook in hooks:
            hook.remove()
    geometry = adapter_for(model).geometry
    profiler = AttentionProfiler(geometry.num_layers, geometry.num_kv_heads, EvictionSpec(policy="fastgen"))
    seen = {}
    profiler.observe_probabilities = lambda layer, probs, positions, acc: seen.setdefault(layer, []).append(probs) or acc
    install(model)
    profiler.begin_batch(torch.zeros(2, 40, dtype=torch.bool), torch.zeros(2, 40, dtype=torch.bool))
    with torch.no_grad(), attention_handler(profiler):
        profiled = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(profiled, reference, rtol=1e-4, atol=1e-4)
    for layer, probs in seen.items():
        b, h, g, _, t = probs[0].shape
        observed = torch.cat(probs, dim=3).reshape(b, h * g, t, t)  # (B, H_q, T, T)
        torch.testing.assert_close(observed, weights[layer].float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family, recipe_bits", [("gemma3_text", 16), ("gemma3_text", 4), ("mistral", 16)])
def test_sliding_window_layers_free_what_no_later_query_sees(family, recipe_bits, models):
    """Sliding-window layers hold the window (+ at most one body block and the 15-token eviction slack),
    not the whole sequence; global layers hold everything; generation still equals transformers' own
    (checked over 80 generated tokens, five windows); the bytes held are the tokens held, walked from outside;
    per layer at most transformers' own sliding cache's tokens plus the eviction slack (and one body block)."""
    from kvtool.runtime.memory import walked_nbytes

    model = models[family]
    recipe = uncompressed_recipe("model") if recipe_bits == 16 else quant_recipe(recipe_bits)
    reference = _generate(model, DynamicCache(config=model.config), batch=2, new_tokens=80)
    cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
    ours = _generate(model, cache, batch=2, new_tokens=80)
    if recipe_bits == 16:
        assert torch.equal(ours.sequences, reference.sequences)
    windows = cache.context.sliding_windows
    assert any(w is not None for w in windows)
    for layer, window in zip(cache.layers, windows):
        held = layer.store.tokens()  # (S,) per stream
        if window is None:
            assert (held == layer.lengths.repeat_interleave(layer.groups).cpu().numpy()).all()
        else:
            assert (held <= window + (32 if recipe_bits != 16 else 0) + 15).all(), (layer.index, held)
            _, _, positions, valid = layer.decoded()
            newest = positions.masked_fill(~valid, -1).amax(dim=-1, keepdim=True)
            inside = valid & (positions > newest - window)
            assert (inside.sum(dim=-1) == torch.minimum(torch.full_like(newest[..., 0], window),
                                                        valid.sum(dim=-1))).all()  # every token in the window is held
    assert cache.nbytes() == cache.expected_nbytes()
    assert walked_nbytes(cache) - cache.constant_nbytes() == cache.reserved_nbytes()
    reference_cache = DynamicCache(config=model.config)
    _generate(model, reference_cache, batch=2, new_tokens=80)
    for layer, theirs in zip(cache.layers, reference_cache.layers):  # tokens held: transformers' + the 16-token slack
        assert layer.store.tokens().max() <= theirs.keys.shape[-2] + 16 + (32 if recipe_bits != 16 else 0)
