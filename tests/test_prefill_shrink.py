"""PyramidInfer's prefill with ``compute_kept_only``: each layer computes only what the layer below kept.

The oracle for the arithmetic is a second copy of the weights run by hand with transformers' own
attention: layer 0 over the whole prompt, layer 1 over the tokens the cache's layer 0 kept (at their
true positions, causal among themselves), the last token through the final norm and head.
"""

import copy
import dataclasses

import pytest
import torch

from kvtool.errors import RecipeError
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import EvictionSpec
from kvtool.runtime.attach import CompressedRuntime
from tests.test_eviction_runtime import _generate, evicting, held, left_padded_pair, run_tokens
from tests.tiny_models import ALL_FAMILIES, featured_model, tiny_model


def pyramid(compute_kept_only=True, **eviction):
    return evicting("pyramidinfer", budget=0.5, window=8, compute_kept_only=compute_kept_only, **eviction)


def rows_per_layer(model):
    return model._kvtool_prefill_shrink.rows_per_layer


def test_each_layer_computes_only_the_tokens_the_layer_below_kept():
    model = tiny_model("llama", num_hidden_layers=4)
    cache = CompressedRuntime.from_recipe(model, pyramid()).new_cache()
    ids = torch.randint(3, 128, (2, 96), generator=torch.Generator().manual_seed(0))
    computed = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, k, o: computed.append(k["hidden_states"].shape[1]),
                                                   with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        logits = model(ids, **with_cache(cache)).logits
    for hook in hooks:
        hook.remove()
    kept = [len(held(layer)[0]) for layer in cache.layers]  # after prefill: what each layer kept (one set per sequence)
    assert computed == rows_per_layer(model) == [96, *kept[:-1]]
    assert computed[1] < 96 and computed == sorted(computed, reverse=True)
    assert logits.shape == (2, 96, 128) and torch.isfinite(logits).all()  # the output keeps the prompt's length
    for below, above in zip(cache.layers, cache.layers[1:]):  # nested, at true positions
        for stream_below, stream_above in zip(held(below), held(above)):
            assert set(stream_above) <= set(stream_below)
    assert cache.get_seq_length() == 96 and all(layer.seen == 96 for layer in cache.layers)
    assert cache.nbytes() == cache.expected_nbytes()


def test_the_last_token_is_what_the_shortened_layers_compute():
    """Two layers: layer 1 over layer 0's kept tokens only, at their positions; the logits of a dropped position are
    layer 0's output through the final norm and head (layer 1 is the identity for it)."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    cache = CompressedRuntime.from_recipe(model, pyramid()).new_cache()
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids, **with_cache(cache)).logits
        kept = torch.tensor(sorted(held(cache.layers[0])[0]))  # what layer 0 kept, by position
        assert 8 < len(kept) < 80
        inner = reference.model
        positions = torch.arange(80)[None]
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, positions)
        h0 = inner.layers[0](h, position_embeddings=(cos, sin), position_ids=positions, attention_mask=None)
        h1 = inner.layers[1](h0[:, kept], position_embeddings=(cos[:, kept], sin[:, kept]), position_ids=kept[None],
                             attention_mask=None)
        want_last = reference.lm_head(inner.norm(h1[:, -1]))
        dropped = int(next(p for p in range(80) if p not in set(kept.tolist())))
        want_dropped = reference.lm_head(inner.norm(h0[:, dropped]))
    torch.testing.assert_close(logits[:, -1], want_last, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits[:, dropped], want_dropped, rtol=1e-4, atol=1e-5)


def test_decoding_after_a_shortened_prefill_continues_at_the_true_positions():
    model = tiny_model("llama", num_hidden_layers=3)
    ids = torch.randint(3, 128, (2, 90), generator=torch.Generator().manual_seed(2))
    cache = CompressedRuntime.from_recipe(model, pyramid()).new_cache()
    logits = run_tokens(model, cache, ids, prefill=70)
    assert torch.isfinite(logits).all() and cache.nbytes() == cache.expected_nbytes()
    for layer in cache.layers:
        for positions in held(layer):
            assert set(range(82, 90)) <= set(positions) and max(positions) == 89  # the window, at true positions
    plain = CompressedRuntime.from_recipe(model, pyramid(compute_kept_only=False)).new_cache()
    run_tokens(model, plain, ids, prefill=70)
    assert held(plain.layers[0]) == held(cache.layers[0])  # layer 0 computes the whole prompt either way


def test_padding_a_second_prompt_and_other_runtimes_compute_every_token():
    model = tiny_model("llama", num_hidden_layers=3)
    shrinking = CompressedRuntime.from_recipe(model, pyramid())
    _, _, ids, mask = left_padded_pair(seed=3)
    cache = shrinking.new_cache()
    with torch.no_grad():
        model(ids, attention_mask=mask, **with_cache(cache))  # left padding: not shortened
    assert rows_per_layer(model) in ([], [48, 48, 48])
    computed = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, k, o: computed.append(k["hidden_states"].shape[1]),
                                                   with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(ids[:, 20:40], **with_cache(cache))  # a second multi-token forward: the cache is not empty
        plain = CompressedRuntime.from_recipe(model, pyramid(compute_kept_only=False)).new_cache()  # same model, hooks on
        model(ids[:1], **with_cache(plain))
    for hook in hooks:
        hook.remove()
    assert computed == [20, 20, 20, 48, 48, 48]


def test_only_pyramidinfer_can_skip_computation():
    with pytest.raises(RecipeError, match="eviction.compute_kept_only.*only PyramidInfer"):
        EvictionSpec(policy="h2o", compute_kept_only=True)
    with pytest.raises(RecipeError, match="eviction.compute_kept_only"):
        EvictionSpec(policy="pyramidinfer", compute_kept_only="yes")


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_family_generates_with_a_shortened_prefill(family):
    """Sliding-window layers (Mistral, Gemma 2/3, GPT-OSS) keep every token their window cannot judge open to the
    next layer; every family's decoder layers take the gathered rows and generate."""
    model = featured_model(family)
    cache = CompressedRuntime.from_recipe(model, dataclasses.replace(pyramid(), name="shrink")).new_cache()
    ids = torch.randint(3, 100, (2, 60), generator=torch.Generator().manual_seed(4))
    out = _generate(model, cache, ids, torch.ones_like(ids), new_tokens=6)
    assert out.shape == (2, 66)
    rows = rows_per_layer(model)
    assert rows[0] == 60 and min(rows) < 60 and rows == sorted(rows, reverse=True)
    report = cache.memory_report()
    assert report["cache_bytes"] == report["expected_cache_bytes"]
