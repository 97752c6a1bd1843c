"""Adapters, RoPE and loading, checked on tiny random models of every family."""

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from kvtool.errors import ModelError
from kvtool.models import (
    TESTED_FAMILIES,
    adapter_for,
    apply_rope,
    compare_fingerprints,
    load_model,
    loading,
    resolve_model_path,
    rotate_half,
    unapply_rope,
)
from kvtool.models.cache_argument import with_cache
from kvtool.models.verify import verify_adapter
from tests.tiny_models import ALL_FAMILIES, FAMILIES, featured_model, tiny_model, tiny_tokenizer_free_inputs

STORIES = Path("/work/shared/models/stories260K")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


# ----- geometry and weights ----------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_geometry_and_kv_weights(family):
    adapter = adapter_for(tiny_model(family))
    g = adapter.geometry
    assert (g.family, g.num_layers, g.num_heads, g.num_kv_heads) == (family, 2, 4, 2)
    assert (g.head_dim, g.rotary_dim, g.group_size, g.max_positions) == (32, 32, 2, 256)
    assert g.sliding_windows == (None, None)
    assert len(adapter.attention_modules()) == 2
    for layer in range(2):
        w_k, w_v = adapter.kv_projection_weights(layer)
        assert w_k.shape == w_v.shape == (2 * 32, 64)  # (H_kv*D, d_model)
        assert adapter.kv_projection_inputs_module(layer).in_features == 64


def test_geometry_follows_overrides():
    assert adapter_for(tiny_model("qwen3", kv_heads=4)).geometry.group_size == 1
    assert adapter_for(tiny_model("phi3", partial_rotary_factor=0.5)).geometry.rotary_dim == 16
    assert adapter_for(tiny_model("mistral", sliding_window=16)).geometry.sliding_windows == (16, 16)
    qwen2 = tiny_model("qwen2", use_sliding_window=True, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    geometry = adapter_for(qwen2).geometry
    assert geometry.layer_types == ("sliding_attention", "full_attention")
    assert geometry.sliding_windows == (16, None)


def test_missing_layer_names_the_range():
    with pytest.raises(ModelError, match="has 2 layers"):
        adapter_for(tiny_model("llama")).kv_projection_weights(5)


# ----- fingerprints -------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_fingerprint_stable_dtype_independent_and_weight_sensitive(family):
    model = tiny_model(family)
    adapter = adapter_for(model)
    first = adapter.fingerprint()
    assert json.loads(json.dumps(first)) == first
    assert adapter.fingerprint() == first
    for dtype in (torch.bfloat16, torch.float16):  # the same weights in another float dtype: the same model
        assert compare_fingerprints(first, adapter_for(copy.deepcopy(model).to(dtype)).fingerprint()) == []
    with torch.no_grad():
        adapter.kv_projection_weights(1)[0][3, 5] += 0.5  # a view: edits the model's own weight
    changed = adapter.fingerprint()
    assert changed["kv_weights_sha256"] != first["kv_weights_sha256"]
    [line] = compare_fingerprints(first, changed)
    assert line.startswith("kv_weights: the K/V projection weights differ (layer 1 keys: ")


def test_compare_fingerprints_names_fields():
    expected = adapter_for(tiny_model("llama")).fingerprint()
    actual = adapter_for(tiny_model("llama", kv_heads=4)).fingerprint()
    assert compare_fingerprints(expected, expected) == []
    lines = compare_fingerprints(expected, actual)
    assert "num_kv_heads: artifact has 2, model has 4" in lines
    assert any(line.startswith("kv_weights: artifact has 4 K/V projection weights") for line in lines) or any(
        line.startswith("kv_weights: the K/V projection weights differ") for line in lines)
    del actual["rope"]
    assert "rope: artifact has {'rope_theta': 10000.0, 'rope_type': 'default'}, model has (missing)" in (
        compare_fingerprints(expected, actual)
    )


# ----- where keys live: the adapter + RoPE reproduce the model's own cache -------------------


def _check_cache_matches(model):
    """Run the model with a DynamicCache on a left-padded batch; rebuild every layer's cached K/V from the adapter."""
    adapter = adapter_for(model)
    with torch.no_grad():  # make biases (zero-initialised) matter where a family has them
        for layer in range(adapter.geometry.num_layers):
            for bias in adapter.kv_projection_biases(layer):
                if bias is not None:
                    bias.normal_()
    input_ids, attention_mask = tiny_tokenizer_free_inputs()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    hidden = {}
    hooks = [
        adapter.kv_projection_inputs_module(i).register_forward_hook(
            lambda module, args, output, i=i: hidden.__setitem__(i, args[0])
        )
        for i in range(adapter.geometry.num_layers)
    ]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **with_cache(cache), use_cache=True)
    for hook in hooks:
        hook.remove()
    for layer in range(adapter.geometry.num_layers):
        rope = adapter.layer_spec(layer).rope
        cos, sin = adapter.rope_cos_sin(position_ids, torch.float32, layer=layer)  # (B, T, R)
        assert cos.shape == (2, 12, adapter.geometry.rotary_dim)
        keys, values = adapter.project_kv(layer, hidden[layer])  # (B, H_kv, T, D), pre-RoPE
        torch.testing.assert_close(apply_rope(keys, cos, sin, rope.interleaved), cache.layers[layer].keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rope.apply(keys, position_ids), cache.layers[layer].keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values, cache.layers[layer].values, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rope.unapply(cache.layers[layer].keys, position_ids), keys, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_reproduces_cached_keys_and_values(family):
    _check_cache_matches(tiny_model(family))


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_adapter_reproduces_cached_keys_and_values_with_family_features(family):
    _check_cache_matches(featured_model(family))


@pytest.mark.parametrize(
    "family, overrides",
    [("phi3", {"partial_rotary_factor": 0.5}), ("llama", {"rope_parameters": YARN}), ("mistral", {"sliding_window": 64})],
    ids=["phi3-partial-rotary", "llama-yarn-scaled", "mistral-sliding"],
)
def test_adapter_reproduces_cache_with_unusual_rope(family, overrides):
    _check_cache_matches(tiny_model(family, **overrides))


# ----- RoPE math ------------------------------------------------------------------------------


def _cos_sin(rotary_dim: int, scale: float = 1.0, interleaved: bool = False):
    """Random-angle cos/sin, each (2, 5, rotary_dim), in the cat(freqs, freqs) (or interleaved f0 f0 f1 f1) layout."""
    angles = torch.rand(2, 5, rotary_dim // 2, generator=torch.Generator().manual_seed(1)) * 50
    angles = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return angles.cos() * scale, angles.sin() * scale


@pytest.mark.parametrize("rotary_dim, scale, interleaved", [(32, 1.0, False), (16, 1.0, False), (32, 1.2, False), (32, 1.0, True)])
def test_rope_round_trip(rotary_dim, scale, interleaved):
    x = torch.randn(2, 3, 5, 32, generator=torch.Generator().manual_seed(0))  # (B, H, T, D)
    cos, sin = _cos_sin(rotary_dim, scale, interleaved)
    rotated = apply_rope(x, cos, sin, interleaved)
    assert rotated.shape == x.shape
    torch.testing.assert_close(rotated[..., rotary_dim:], x[..., rotary_dim:], atol=0, rtol=0)
    torch.testing.assert_close(unapply_rope(rotated, cos, sin, interleaved), x, atol=1e-6, rtol=1e-6)


def test_rotate_half_and_pairs():
    from kvtool.models.rope import rotate_pairs

    assert rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [-3.0, -4.0, 1.0, 2.0]
    assert rotate_pairs(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [-2.0, 1.0, -4.0, 3.0]


# ----- unsupported and untested families ----------------------------------------------------------


def _auto_tiny(model_type: str, **fields):
    """A tiny random model of any transformers model_type, from its config class (no downloads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=128, max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**base, **fields})).eval()


def test_unsupported_architecture_names_what_is_missing_and_the_tested_families():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64))
    with pytest.raises(ModelError, match="gpt2.*no decoder layers") as info:
        adapter_for(gpt2)
    assert all(family in str(info.value) for family in TESTED_FAMILIES)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_mla_models_are_refused_with_the_reason(model_type):
    model = _auto_tiny(model_type, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    with pytest.raises(ModelError, match="latent attention.*compress that latent"):
        adapter_for(model)


def test_an_untested_family_goes_through_the_generic_reading():
    model = _auto_tiny("olmo")  # OLMo (v1): not in TESTED_FAMILIES, nothing family-specific in kvtool
    assert model.config.model_type not in TESTED_FAMILIES
    adapter = adapter_for(model)
    assert type(adapter).__name__ == "ModelAdapter" and adapter.geometry.num_kv_heads == 2
    verify_adapter(model, adapter)  # reading == what the model computes


def test_generic_reading_that_does_not_match_the_model_is_refused_with_the_mismatch():
    model = _auto_tiny("hunyuan_v1_dense", head_dim=16)  # normalises keys *after* RoPE: cached keys are not RoPE(projection)
    with pytest.raises(ModelError, match="hunyuan_v1_dense.*keys rebuilt from the projections differ"):
        verify_adapter(model)


# ----- loading --------------------------------------------------------------------------------


needs_stories = pytest.mark.skipif(not STORIES.is_dir(), reason=f"{STORIES} not present")


@needs_stories
def test_load_model_local_dir():
    model, tokenizer = load_model(str(STORIES))
    assert not model.training and model.dtype == torch.float32
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    batch = tokenizer(["Once upon a time", "Hi"], return_tensors="pt", padding=True)
    assert batch["attention_mask"][1, 0] == 0  # the short row is padded on the left
    assert adapter_for(model).geometry.num_kv_heads == 4


@needs_stories
def test_fingerprint_same_for_fp32_and_bf16_loads():
    fp32, _ = load_model(str(STORIES))
    bf16, _ = load_model(str(STORIES), dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    assert compare_fingerprints(adapter_for(fp32).fingerprint(), adapter_for(bf16).fingerprint()) == []


def test_load_model_errors(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="config.json"):
        load_model(str(tmp_path))  # a directory without config.json
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="not a .gguf file"):
        load_model(str(tmp_path / "weights.bin"))
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64)).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="gpt2.*llama"):
        load_model(str(tmp_path), tokenizer=False)


def test_load_model_refuses_mla_before_loading_weights(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("deepseek_v3", num_hidden_layers=1, kv_lora_rank=16).save_pretrained(tmp_path)  # no weights
    with pytest.raises(ModelError, match="latent attention"):
        load_model(str(tmp_path), tokenizer=False)


def test_load_model_checks_an_untested_family_on_a_forward(tmp_path):
    _auto_tiny("olmo").save_pretrained(tmp_path / "olmo")
    model, _ = load_model(str(tmp_path / "olmo"), tokenizer=False)
    assert model.config.model_type == "olmo"
    _auto_tiny("hunyuan_v1_dense", head_dim=16).save_pretrained(tmp_path / "hunyuan")
    with pytest.raises(ModelError, match="does not match what the model computes"):
        load_model(str(tmp_path / "hunyuan"), tokenizer=False)


@needs_stories
def test_load_model_bad_options():
    with pytest.raises(ModelError, match="unknown dtype"):
        load_model(str(STORIES), dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="CUDA is not available"):
            load_model(str(STORIES), device="cuda")


def test_resolve_model_path_default(monkeypatch, tmp_path):
    monkeypatch.setattr(loading, "DEFAULT_MODEL_DIR", tmp_path / "missing")
    monkeypatch.delenv("KVTOOL_DEFAULT_MODEL", raising=False)
    with pytest.raises(ModelError, match="KVTOOL_DEFAULT_MODEL"):
        resolve_model_path(None)
    monkeypatch.setenv("KVTOOL_DEFAULT_MODEL", str(tmp_path))
    assert resolve_model_path(None) == str(tmp_path.resolve())
    monkeypatch.setattr(loading, "check_hub_reachable", lambda model_id: None)  # offline here; tested in test_cli
    assert resolve_model_path("org/name") == "org/name"  # a hub id passes through
