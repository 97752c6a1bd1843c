"""CAKE and PyramidInfer on tiny random models, checked against the model's own attention.

The oracle is an eager forward of the same weights with ``output_attentions`` (eviction happens
after a layer attends, so prefill attention is the uncompressed model's): preferences, budgets,
token scores and kept sets are recomputed from it here in plain code and compared with what the
cache holds. The generic matrix (bytes, batches, budget 1.0, absolute budgets) runs over both
policies in test_eviction_runtime.py.
"""

import copy
import dataclasses
import math

import pytest
import torch

from kvtool.errors import RecipeError
from kvtool.methods.budget.pyramid import pyramidinfer_weights
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import EvictionSpec
from kvtool.runtime.eviction import layer_fractions
from kvtool.runtime.memory import walked_nbytes
from kvtool.runtime.store import FLOAT_BLOCK
from tests.test_eviction_runtime import _generate, evicting, held, left_padded_pair, run_tokens, runtime
from tests.tiny_models import tiny_model

LAYERS, KV_HEADS, GROUP = 4, 2, 2  # tiny llama: 4 query heads on 2 KV heads
T, SINKS, WINDOW = 64, 2, 8


def shaped_model(gains=(20.0, 0.0, 100.0, 50.0)):
    """A 4-layer tiny Llama whose layers attend differently: q_proj scaled per layer (0 = uniform attention;
    random tiny models attend almost uniformly, the large gains make some layers sharp)."""
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    with torch.no_grad():
        for layer, gain in zip(model.model.layers, gains):
            layer.self_attn.q_proj.weight.mul_(gain)
    return model


def eager_attention(model, ids):
    """Per layer (B, H_q, T, T): the attention of a plain eager forward of the same weights."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    with torch.no_grad():
        return reference(ids, output_attentions=True).attentions


def window_rows(attention):
    """(B, H_kv, G x w, T): the last WINDOW queries' rows of each KV head's group of query heads."""
    b, _, t, _ = attention.shape
    return attention[:, :, -WINDOW:, :].reshape(b, KV_HEADS, GROUP * WINDOW, t)


def protected(n):
    """Positions always kept when the newest token is at n - 1: sinks and the window."""
    return set(range(SINKS)) | set(range(n - WINDOW, n))


def top_kept(scores, candidates, must, budget):
    """``must`` plus the best-scored candidates (not in must) while the budget allows."""
    rest = sorted((p for p in candidates if p not in must), key=lambda p: -float(scores[p]))
    return must | set(rest[: max(budget - len(must), 0)])


def water_fill(weights, room, cap):
    """Shares proportional to weights, capped at cap, the excess handed on, summing to room (plain floats)."""
    shares, open_ = [0.0] * len(weights), set(range(len(weights)))
    while open_ and room - sum(shares) > 1e-9:
        missing, total = room - sum(shares), sum(weights[i] for i in open_)
        for i in list(open_):
            shares[i] = min(cap, shares[i] + missing * weights[i] / total)
            if shares[i] >= cap - 1e-9:
                open_.discard(i)
    return shares


def held_sets(cache):
    return [[set(positions) for positions in held(layer)] for layer in cache.layers]


# ----- CAKE ------------------------------------------------------------------------------------------------
def cake_reference(attention, gamma=200.0, tau1=1.0, tau2=1.0, pooling=3, pooling_mode="auto"):
    """(preference (B,), pooled token scores (B, H_kv, T)) of one layer, as the paper defines them (pooling_mode max:
    SnapKV's max over the kernel instead of the paper's average)."""
    rows = window_rows(attention).double()
    b, _, _, t = rows.shape
    older = torch.arange(t) < t - WINDOW
    dispersion = torch.special.entr(rows)[..., older].sum(dim=(1, 2, 3))  # (B,) the rows' entropy
    variance = rows.var(dim=2)  # (B, H_kv, T) over the rows, unbiased
    shift = variance[..., older].sum(dim=(1, 2))
    score = (rows.mean(dim=2) + gamma * variance).reshape(b * KV_HEADS, 1, t)
    pool = torch.nn.functional.max_pool1d if pooling_mode == "max" else torch.nn.functional.avg_pool1d
    pooled = pool(score, pooling, stride=1, padding=pooling // 2).reshape(b, KV_HEADS, t)
    return dispersion ** (1 / tau1) * shift ** (1 / tau2), pooled


def cake_recipe(**fields):
    return evicting("cake", budget=0.5, sink_tokens=SINKS, window=WINDOW, pooling=3, float_dtype="float16", **fields)


@pytest.mark.parametrize(("interval", "pooling_mode"), [(1, "auto"), (1000, "auto"), (1, "max")])
def test_cake_budgets_scores_and_cascade_follow_the_models_attention(interval, pooling_mode):
    # interval 1000: no cut while decoding, but the trim to the final shares
    model = shaped_model()
    ids = torch.randint(3, 128, (2, T + 1), generator=torch.Generator().manual_seed(21))
    cache = runtime(model, cake_recipe(interval=interval, pooling_mode=pooling_mode)).new_cache()
    with torch.no_grad():
        model(ids[:, :T], **with_cache(cache))
        after_prefill = held_sets(cache)
        model(ids[:, T:], **with_cache(cache))
    after_decode = held_sets(cache)
    refs = [cake_reference(a, pooling_mode=pooling_mode) for a in eager_attention(model, ids[:, :T])]
    for seq in range(2):
        pref = [float(p[seq]) for p, _ in refs]
        assert max(pref) > 1.5 * min(pref), "the shaped layers should differ in preference"
        # prefill: layer l keeps its cascade share of the total (4 layers x (32 - 10) tokens) among layers 0..l
        room, cap = LAYERS * (math.ceil(0.5 * T) - 10), T - 10
        cascade = [10 + math.ceil(water_fill(pref[: l + 1], room, cap)[l] - 1e-9) for l in range(LAYERS)]
        # first decoded token: every layer trimmed to its final share at 65 tokens, the total exactly 4 x 33
        room, cap = LAYERS * (math.ceil(0.5 * (T + 1)) - 10), T + 1 - 10
        shares = water_fill(pref, room, cap)
        final = [math.floor(s) for s in shares]
        for i in sorted(range(LAYERS), key=lambda i: -(shares[i] - final[i]))[: room - sum(final)]:
            final[i] += 1
        final = [10 + f for f in final]
        assert sum(final) == LAYERS * math.ceil(0.5 * (T + 1))
        at_prefill = water_fill(pref, LAYERS * (math.ceil(0.5 * T) - 10), T - 10)
        assert all(10 + share <= c for share, c in zip(at_prefill, cascade))  # cascade shares only shrink to the final
        for layer, (_, scores) in enumerate(refs):
            for head in range(KV_HEADS):
                stream = seq * KV_HEADS + head
                s = scores[seq, head]
                expected = top_kept(s, range(T), protected(T), cascade[layer])
                assert after_prefill[layer][stream] == expected, (layer, stream)
                expected = top_kept(s, expected, protected(T + 1) - {T}, final[layer] - 1) | {T}
                assert after_decode[layer][stream] == expected, (layer, stream)
    report = cache.memory_report()
    assert report["cache_bytes"] == report["expected_cache_bytes"]
    assert abs(report["kept_fraction"] - 0.5) < 0.01


def test_cake_gives_layers_with_more_dispersed_attention_more():
    model = shaped_model()  # layer 1: uniform attention, layer 2: the sharpest
    ids = torch.randint(3, 128, (1, T + 1), generator=torch.Generator().manual_seed(22))
    cache = runtime(model, cake_recipe(tau1=0.5, tau2=1e6)).new_cache()  # tau2 huge: the dispersion alone (squared)
    run_tokens(model, cache, ids, prefill=T)
    kept = [int(layer.store.tokens()[0]) for layer in cache.layers]
    entropy = [float(cake_reference(a, tau2=1e6)[0]) for a in eager_attention(model, ids[:, :T])]
    assert sorted(range(LAYERS), key=lambda i: kept[i]) == sorted(range(LAYERS), key=lambda i: entropy[i])
    assert kept[1] == max(kept) and kept[2] == min(kept) and kept[1] > kept[2] + 10
    assert sum(kept) == LAYERS * math.ceil(0.5 * (T + 1))


def test_cake_bytes_held_are_the_kept_tokens_bytes():
    model = shaped_model()
    ids = torch.randint(3, 128, (2, T + 8), generator=torch.Generator().manual_seed(23))
    cache = runtime(model, cake_recipe()).new_cache()
    run_tokens(model, cache, ids, prefill=T)
    assert walked_nbytes(cache) == cache.reserved_nbytes() + cache.constant_nbytes()
    assert not cache.policy._prefill_scores, "the prefill scores outlived the first decode steps"
    per_token = 2 * 32 * 2 + 4 + 4  # K + V fp16 (head_dim 32), position, accumulated attention
    tokens = [layer.store.tokens() for layer in cache.layers]
    blocks = sum(int(((t + FLOAT_BLOCK - 1) // FLOAT_BLOCK).sum()) for t in tokens)
    metadata = sum(layer.store.metadata_nbytes() + 8 * 2 + 8 * 4 for layer in cache.layers)
    assert cache.nbytes() == blocks * FLOAT_BLOCK * per_token + metadata
    assert len({tuple(t.tolist()) for t in tokens}) > 1, "every layer kept the same: no layer budgets"


# ----- PyramidInfer ------------------------------------------------------------------------------------------
def pyramid_budgets(n, decay, budget=0.5):
    fractions = layer_fractions(budget, pyramidinfer_weights(LAYERS, decay).double())
    return [math.ceil(float(f) * n - 1e-9) for f in fractions]


def test_pyramidinfer_keeps_nested_shrinking_sets_by_recent_attention():
    model = shaped_model()
    ids = torch.randint(3, 128, (2, T), generator=torch.Generator().manual_seed(24))
    recipe = evicting("pyramidinfer", budget=0.5, sink_tokens=SINKS, window=WINDOW, retention_decay=0.5, distance_weight=1.5)
    cache = runtime(model, recipe).new_cache()
    with torch.no_grad():
        model(ids, **with_cache(cache))
    kept = held_sets(cache)
    budgets = pyramid_budgets(T, 0.5)
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1] + 10  # deeper layers keep fewer
    weights = torch.linspace(1.0, 1.5, WINDOW, dtype=torch.float64)  # oldest .. newest window query
    for seq in range(2):
        allowed = set(range(T))
        for layer, attention in enumerate(eager_attention(model, ids)):
            scores = (attention[seq, :, -WINDOW:, :].double() * weights[:, None]).sum(dim=(0, 1))  # (T,) all heads
            expected = top_kept(scores, allowed, protected(T), budgets[layer])
            for head in range(KV_HEADS):  # one set per layer, shared by its KV heads
                assert kept[layer][seq * KV_HEADS + head] == expected, (layer, seq, head)
            assert expected <= allowed and protected(T) <= expected  # nested; sinks and window in every layer
            allowed = expected
    assert abs(cache.kept_fraction() - 0.5) < 0.02


def test_pyramidinfer_decoding_keeps_each_layers_budget():
    model = shaped_model()
    ids = torch.randint(3, 128, (1, T + 20), generator=torch.Generator().manual_seed(25))
    recipe = evicting("pyramidinfer", budget_tokens=24, sink_tokens=SINKS, window=WINDOW, retention_decay=0.5)
    cache = runtime(model, recipe).new_cache()
    run_tokens(model, cache, ids, prefill=T)
    expected = [round(24 * float(w)) for w in pyramidinfer_weights(LAYERS, 0.5)]
    assert [layer.store.tokens().tolist() for layer in cache.layers] == [[n, n] for n in expected]
    assert expected[0] > expected[-1]
    for layer in held_sets(cache):
        assert layer[0] == layer[1] and protected(T + 20) <= layer[0]


# ----- both ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["cake", "pyramidinfer"])
def test_left_padded_batch_keeps_what_each_sequence_keeps_alone(policy):
    model = shaped_model()
    long, short, ids, mask = left_padded_pair(26)
    rt = runtime(model, evicting(policy, budget=0.5, sink_tokens=SINKS, window=WINDOW))
    batch = rt.new_cache()
    _generate(model, batch, ids, mask, new_tokens=6)
    alone = []
    for x in (long, short):
        cache = rt.new_cache()
        _generate(model, cache, x, torch.ones_like(x), new_tokens=6)
        alone.append(held_sets(cache))
    for layer, kept in enumerate(held_sets(batch)):
        assert kept[:KV_HEADS] == alone[0][layer] and kept[KV_HEADS:] == alone[1][layer], layer
    tokens = [layer.store.tokens().tolist() for layer in batch.layers]
    assert len({tuple(t) for t in tokens}) > 1, "no per-layer budgets"
    assert batch.nbytes() == batch.expected_nbytes()


@pytest.mark.parametrize(("field", "value", "fix"), [
    ("tau1", 0.0, "positive number"), ("tau2", -1.0, "positive number"), ("tau1", float("inf"), "positive number"),
    ("gamma", -5.0, ">= 0"), ("gamma", True, ">= 0"), ("retention_decay", 0.0, r"\(0, 1\]"),
    ("retention_decay", 1.5, r"\(0, 1\]"), ("distance_weight", 0.5, ">= 1"), ("pooling_mode", "median", "not one of"),
])
def test_invalid_values_name_the_field_and_the_fix(field, value, fix):
    with pytest.raises(RecipeError, match=rf"eviction\.{field}'.*{fix}"):
        EvictionSpec(policy="cake", **{field: value})


def test_own_layer_budgets_and_a_one_query_window_are_refused():
    for policy in ("cake", "pyramidinfer"):
        with pytest.raises(RecipeError, match=r"eviction\.layer_budgets'.*set layer_budgets: uniform"):
            EvictionSpec(policy=policy, layer_budgets="pyramid")
    with pytest.raises(RecipeError, match=r"eviction\.window'.*window >= 2"):
        EvictionSpec(policy="cake", window=1)
    assert dataclasses.replace(EvictionSpec(policy="pyramidinfer"), window=1).window == 1  # PyramidInfer may use one
