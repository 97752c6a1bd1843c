"""Every tested decoder family, read generically, checked against the model's own forward and run through the runtime.

One tiny model per family (`tests.tiny_models.featured_model`: 2 layers, hidden 64, with the
family's distinctive attention features on). Per family:

* the adapter's reading (K/V projections, norms, per-layer RoPE, windows, soft-cap, sinks,
  scaling) reproduces what the model caches and asks its attention function to do;
* `RopeSpec.cos_sin` equals the model's rotary module output, per layer type, without calling it;
* today's runtime end to end: the no-op recipe generates exactly transformers' tokens, 4-bit
  keeps next-token logits within a tolerance, a left-padded batch of two generates transformers'
  tokens, keys stored before RoPE come back exactly, and kvtool's own attention (the evicting
  cache keeping every token) reproduces the model. Combinations the runtime does not handle yet
  are marked xfail with the runtime feature they need (`RUNTIME_GAPS`).
"""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from kvtool.models import adapter_for
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

# family -> {runtime check: the runtime feature it needs}. Checks: noop, 4bit, batch, pre_rope, kvtool_attention.
# Today's CompressedCache hands float K/V back to the model's own attention, which applies windows, soft-caps and
# sinks itself; kvtool's own attention (the evicting cache, and the paged runtime for every recipe) must apply them.
_WINDOW = "sliding-window attention in kvtool's attention (a query at q sees keys at p > q - window)"
_SOFTCAP = "attention-logit soft-capping in kvtool's attention (Gemma 2: cap * tanh(scores / cap))"
_SINKS = "learned attention-sink logits in kvtool's attention (GPT-OSS s_aux: one extra logit per query head in the softmax)"
RUNTIME_GAPS: dict[str, dict[str, str]] = {
    "mistral": {"kvtool_attention": _WINDOW},
    "mixtral": {"kvtool_attention": _WINDOW},
    "qwen2": {"kvtool_attention": _WINDOW},
    "starcoder2": {"kvtool_attention": _WINDOW},
    "gemma2": {"kvtool_attention": f"{_WINDOW}; {_SOFTCAP}"},
    "gemma3_text": {
        "kvtool_attention": _WINDOW,
        "pre_rope": "per-layer RoPE for keys stored before RoPE (Gemma 3: local base 10k, global 1M): "
        "rotate with adapter.layer_spec(i).rope, not one rope_cos_sin for all layers",
    },
    "gpt_oss": {"kvtool_attention": f"{_WINDOW}; {_SINKS}"},
    "cohere": {"pre_rope": "interleaved RoPE for keys stored before RoPE (Cohere rotates pairs (2i, 2i+1)): "
               "rotate with adapter.layer_spec(i).rope.apply/unapply, not the rotate-half apply_rope"},
}


def _gap(family: str, check: str):
    """The xfail mark for a (family, check) the runtime does not handle yet, else no mark."""
    reason = RUNTIME_GAPS.get(family, {}).get(check)
    return [pytest.mark.xfail(strict=False, reason=f"runtime needs: {reason}")] if reason else []


def _matrix(check: str):
    return [pytest.param(family, marks=_gap(family, check), id=family) for family in ALL_FAMILIES]


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


# ----- today's runtime, end to end ----------------------------------------------------------------


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
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, max_new_tokens=new_tokens,
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
    """The evicting cache computes attention itself (kvtool attention function), as the new runtime will for every recipe."""
    spec = EvictionSpec(policy="streamingllm", budget=1.0, sink_tokens=2, window=4)
    recipe = dataclasses.replace(uncompressed_recipe("model"), name="keep-all", eviction=spec)
    _same_tokens_as_transformers(models[family], recipe, batch=2)


def _next_token_logits(model, cache, ids):
    """Prefill ids[:, :-1], then one decode step; (B, V) float32 logits of that step."""
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
        return model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits[:, -1].float()


@pytest.mark.parametrize("family", _matrix("4bit"))
def test_4bit_logits_stay_within_tolerance(family, models):
    model = models[family]
    ids = torch.randint(3, 128, (2, 100), generator=torch.Generator().manual_seed(1))
    exact = _next_token_logits(model, DynamicCache(config=model.config), ids)
    errors = {}
    for bits in (8, 4):
        cache = CompressedRuntime.from_recipe(model, quant_recipe(bits)).new_cache()
        errors[bits] = ((_next_token_logits(model, cache, ids) - exact).norm() / exact.norm()).item()
        assert all(layer.body_blocks() == 3 for layer in cache.layers)  # 99 tokens -> 3 quantized blocks of 32
    assert errors[8] < 0.02 and errors[4] < 0.2, errors
    assert errors[4] > 4 * errors[8] > 0, errors  # compression is active and bits matter
