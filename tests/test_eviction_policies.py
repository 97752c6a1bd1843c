"""TOVA, ChunkKV and AdaKV head-adaptive budgets on tiny random models: what each keeps, per stream.

The generic matrix (frees memory, batch with left padding, flat memory past an absolute
budget, budget 1.0 reproduces the model) runs over every registered policy in
test_eviction_runtime.py; here: the rules that make each policy itself, and the adaptive
budgets (which are a spec option, not a policy) through the same matrix checks.
"""

import dataclasses
import math

import pytest
import torch

from kvtool.errors import RecipeError
from kvtool.methods.evict.base import StreamView, policy_class
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import EvictionSpec
from tests.test_eviction_runtime import decode_batch_like_alone, evicting, held, run_tokens, runtime
from tests.tiny_models import tiny_model


def spy_views(cache):
    """Record every StreamView the cache's policy sees (layer, view, budget, keep)."""
    policy, seen = cache.policy, []
    original = policy.keep

    def keep(view, budget):
        out = original(view, budget)
        seen.append((view.layer, view, budget.clone(), out.clone()))
        return out

    policy.keep = keep
    return seen


def synthetic_view(attention, current, positions=None):
    s, n = attention.shape
    positions = torch.arange(n).expand(s, n) if positions is None else positions
    return StreamView(
        positions=positions, valid=torch.ones(s, n, dtype=torch.bool), length=torch.full((s,), n), attention=attention,
        window_attention=None, feature=None, is_special=torch.zeros(s, n, dtype=torch.bool),
        is_punct=torch.zeros(s, n, dtype=torch.bool), units=torch.arange(n).expand(s, n), unit_count=n, layer=0,
        heads=torch.arange(s) % 2, current_attention=current,
    )


def test_tova_keeps_by_the_current_query_not_the_history():
    attention = torch.tensor([[0.0, 9.0, 8.0, 1.0, 2.0, 0.0]])  # accumulated: tokens 1 and 2 were heavy hitters
    current = torch.tensor([[0.0, 0.1, 0.0, 0.5, 0.3, 0.1]])  # the current query wants 3 and 4
    view = synthetic_view(attention, current)
    spec = EvictionSpec(policy="tova", sink_tokens=1, window=1)
    keep = policy_class("tova")(spec).keep(view, torch.tensor([4]))
    assert keep[0].nonzero().flatten().tolist() == [0, 3, 4, 5]
    h2o = policy_class("h2o")(dataclasses.replace(spec, policy="h2o")).keep(view, torch.tensor([4]))
    assert h2o[0].nonzero().flatten().tolist() == [0, 1, 2, 5]


def test_current_attention_while_decoding_is_this_steps_alone():
    model = tiny_model("llama")  # 4 query heads on 2 KV heads: each KV stream sums 2 queries' attention
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(11))
    cache = runtime(model, evicting("tova", budget_tokens=12, sink_tokens=2, window=1)).new_cache()
    views = spy_views(cache)
    run_tokens(model, cache, ids, prefill=20)
    decoding = [v for _, v, _, _ in views if v.valid.shape[1] - 1 < 20][-4:]
    assert decoding, "the policy was never asked while decoding"
    for view in decoding:
        current = view.current_attention.masked_fill(~view.valid, 0).sum(dim=1)
        torch.testing.assert_close(current, torch.full_like(current, 2.0), atol=1e-4, rtol=0)  # one query, 2 heads
        assert bool((view.attention.sum(dim=1) > 2.5).all())  # the history is more than this step
    for layer in cache.layers:
        assert layer.store.tokens().tolist() == [12, 12]


def _chunks_of(positions, chunk):
    return {p // chunk for p in positions}


def test_chunkkv_keeps_whole_chunks():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 96), generator=torch.Generator().manual_seed(12))
    cache = runtime(model, evicting("chunkkv", budget=0.5, sink_tokens=0, window=1, chunk_size=8)).new_cache()
    with torch.no_grad():
        model(ids, **with_cache(cache))
    for layer in cache.layers:
        for kept in held(layer):
            assert len(kept) == 48
            counts = {c: sum(1 for p in kept if p // 8 == c) for c in _chunks_of(kept, 8)}
            partial = [c for c, k in counts.items() if k < 8 and c != 95 // 8]  # the window's chunk may be partial
            assert len(partial) <= 1, f"chunks kept in pieces: {counts}"


def test_chunkkv_reuses_the_anchor_layers_selection():
    model = tiny_model("llama", num_hidden_layers=4)
    ids = torch.randint(3, 128, (1, 80), generator=torch.Generator().manual_seed(13))
    rt = runtime(model, evicting("chunkkv", budget=0.5, chunk_size=4, reuse_layers=2))
    cache = rt.new_cache()
    run_tokens(model, cache, ids, prefill=60)
    kept = [held(layer) for layer in cache.layers]
    assert kept[1] == kept[0] and kept[3] == kept[2]  # every layer of a group holds the anchor's positions
    alone = runtime(model, evicting("chunkkv", budget=0.5, chunk_size=4)).new_cache()
    run_tokens(model, alone, ids, prefill=60)
    assert held(alone.layers[1]) != kept[1]  # ... which is not what layer 1 would choose for itself
    with pytest.raises(RecipeError, match="reuse_layers"):
        EvictionSpec(policy="chunkkv", reuse_layers=2, layer_budgets="pyramid")
    with pytest.raises(RecipeError, match="reuse_layers"):
        EvictionSpec(policy="snapkv", reuse_layers=2)


def test_adaptive_budgets_share_a_layers_budget_among_its_heads():
    sharp = torch.tensor([0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # one token matters
    broad = torch.tensor([0.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 0.0])  # many do
    view = synthetic_view(torch.stack([sharp, broad, broad, sharp]), None)  # sequences (sharp, broad), (broad, sharp)
    spec = EvictionSpec(policy="h2o", sink_tokens=1, window=1, head_budgets="adaptive", head_floor=0.25)
    keep = policy_class("h2o")(spec).keep(view, torch.tensor([4, 4, 4, 4]))
    assert keep.sum(dim=1).tolist() == [3, 5, 5, 3]  # sinks + window + floor (1 token) for the sharp head
    assert keep[0].nonzero().flatten().tolist() == [0, 2, 7]
    assert keep[1].nonzero().flatten().tolist() == [0, 4, 5, 6, 7]
    uniform = policy_class("h2o")(dataclasses.replace(spec, head_budgets="uniform")).keep(view, torch.tensor([4, 4, 4, 4]))
    assert uniform.sum(dim=1).tolist() == [4, 4, 4, 4]
    with pytest.raises(RecipeError, match="head_budgets"):
        EvictionSpec(policy="streamingllm", head_budgets="adaptive")


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "tova", "chunkkv"])
def test_adaptive_budgets_free_memory_and_batch_like_alone(policy):
    model = tiny_model("llama")
    rt = runtime(model, evicting(policy, budget=0.5, head_budgets="adaptive", float_dtype="float16"))
    cache = decode_batch_like_alone(model, rt, seed=14, new_tokens=12)
    report = cache.memory_report()
    assert report["cache_bytes"] == report["expected_cache_bytes"]  # bytes held = the kept tokens' bytes
    assert 0.4 < report["kept_fraction"] <= 0.55
    uneven = False
    for layer in cache.layers:
        tokens = torch.from_numpy(layer.store.tokens()).reshape(2, 2)  # (sequence, KV head)
        budget = [math.ceil(0.5 * n) for n in layer.lengths.tolist()]
        assert all(int(t) <= 2 * b for t, b in zip(tokens.sum(dim=1), budget))  # the layer's budget, shared
        assert int(tokens.min()) >= 2 + 4  # sinks + window at least
        uneven |= bool((tokens[:, 0] != tokens[:, 1]).any())
    if policy == "snapkv":  # window attention differs per head even in a random model (H2O's sums mostly follow age)
        assert uneven, "adaptive budgets never moved room between heads"
