"""The short decode step (`KvtoolLayer._stores_first` + `paged_attention.attend_stored`) computes what the
general path computes.

A decode step that evicts and encodes nothing writes its token into the store first and attends over the
store alone with one softmax; every other step (prefill, a step where a policy may cut, a step that encodes a
block, sliding windows, sparse reads) takes the general path (new tokens as a separate piece, online softmax).
Both paths run on the same tiny models with the short one switched off, and must give the same logits at
every generated step, with the short path really taken (counted) and the general one still taken where it must.
"""

import dataclasses

import pytest
import torch

import kvtool.runtime.layer as layer_module
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import Recipe, load_recipe
from kvtool.runtime.attach import CompressedRuntime
from kvtool.runtime.layer import KvtoolLayer
from tests.test_runtime import make_recipe
from tests.tiny_models import featured_model, tiny_model, tiny_tokenizer_free_inputs


def _model_dtype(recipe: Recipe) -> Recipe:
    """The recipe storing floats in the model's dtype: the new token reads back exactly in both paths."""
    return dataclasses.replace(recipe, cache=dataclasses.replace(recipe.cache, float_dtype="model"))


def _kivi(bits: int) -> Recipe:
    return make_recipe(bits, sinks=2, recent=8, float_dtype="model")


def _generate(model, recipe, new_tokens=40, batch=2):
    input_ids, attention_mask = tiny_tokenizer_free_inputs(batch=batch, seq=20)
    cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, **with_cache(cache), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, pad_token_id=0, do_sample=False, output_scores=True, return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.scores)  # (B, T), (steps, B, vocab)


def _count_short_steps(monkeypatch) -> dict:
    calls = {"short": 0}
    original = layer_module.attend_stored

    def counted(*args, **kwargs):
        calls["short"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(layer_module, "attend_stored", counted)
    return calls


def _evicting(name: str, policy: str | None = None) -> Recipe:
    """A bundled eviction recipe with a 4-token window and 2 sinks: on 60-token sequences the kept set then
    depends on the scores, not only on the window."""
    recipe = _model_dtype(load_recipe(name))
    eviction = dataclasses.replace(recipe.eviction, window=4, sink_tokens=2, policy=policy or recipe.eviction.policy)
    return dataclasses.replace(recipe, eviction=eviction)


RECIPES = {
    "uncompressed": lambda: _model_dtype(load_recipe("uncompressed")),
    "kivi-4bit": lambda: _kivi(4),
    "kivi-2bit": lambda: _kivi(2),
    "h2o": lambda: _evicting("h2o"),  # scores every step: the short step accumulates them
    "streamingllm": lambda: _evicting("streamingllm"),
    "tova": lambda: _evicting("tova"),
    "snapkv": lambda: _evicting("snapkv"),
    "knorm": lambda: _evicting("streamingllm", policy="knorm"),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_short_decode_step_equals_the_general_path(name, monkeypatch):
    model = tiny_model("llama")
    recipe = RECIPES[name]()
    calls = _count_short_steps(monkeypatch)
    tokens, logits = _generate(model, recipe)
    short_steps = calls["short"]
    monkeypatch.setattr(KvtoolLayer, "_stores_first", lambda self, options, rows: False)
    general_tokens, general_logits = _generate(model, recipe)
    assert calls["short"] == short_steps  # switched off: the second run took the general path only
    layers = model.config.num_hidden_layers
    assert short_steps >= layers * 20, f"{name}: the short decode step ran {short_steps} times in 39 decode steps"
    if recipe.eviction.enabled or recipe.quantizes:  # cuts and block encodings still take the general path
        assert short_steps < layers * 39
    torch.testing.assert_close(logits, general_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, general_tokens)


@pytest.mark.parametrize("name", ["h2o", "tova", "uncompressed"])
def test_short_decode_step_of_one_sequence_equals_the_general_path(name, monkeypatch):
    """One sequence: every stream's float region ends at the same slot, so the short step reads its last
    block only up to there (no mask) and scored policies add a partial block's attention (`_accumulate`)."""
    model = tiny_model("llama")
    recipe = RECIPES[name]()
    calls = _count_short_steps(monkeypatch)
    tokens, logits = _generate(model, recipe, batch=1)
    assert calls["short"] >= model.config.num_hidden_layers * 20
    monkeypatch.setattr(KvtoolLayer, "_stores_first", lambda self, options, rows: False)
    general_tokens, general_logits = _generate(model, recipe, batch=1)
    torch.testing.assert_close(logits, general_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, general_tokens)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_short_decode_step_applies_softcap_and_learned_sinks(family, monkeypatch):
    """Gemma 2's logit soft-capping and GPT-OSS's learned sink logits on the short path (full-attention layers)."""
    model = featured_model(family)
    recipe = _kivi(4)
    calls = _count_short_steps(monkeypatch)
    _, logits = _generate(model, recipe, new_tokens=24)
    assert calls["short"] > 0
    monkeypatch.setattr(KvtoolLayer, "_stores_first", lambda self, options, rows: False)
    _, general_logits = _generate(model, recipe, new_tokens=24)
    torch.testing.assert_close(logits, general_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bound", ["CHUNK_ELEMENTS", "REUSE_ELEMENTS"])
def test_short_decode_step_is_refused_when_its_temporaries_would_be_large(bound, monkeypatch):
    """Rows x tokens held above the logits bound, or the values read above the reuse bound: the general path
    (online softmax over bounded chunks)."""
    model = tiny_model("llama")
    calls = _count_short_steps(monkeypatch)
    monkeypatch.setattr(layer_module, bound, 64)
    _generate(model, _kivi(4), new_tokens=8)
    assert calls["short"] == 0
