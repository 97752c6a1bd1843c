"""Budgeted eviction policies on sliding-window layers (Gemma 2/3, Mistral).

A sliding-window layer's own cache (transformers') holds its window; a policy that keeps a
fraction of everything seen used to *replace* the window rule there, so tokens that left the
window stayed until the policy evicted them (on Gemma-3-270M, H2O at 25% kept in a
prefill-only protocol held 1.69x the 16-bit cache). Now the window rule runs beside the
policy (`SlidingWindowRule` on its own schedule), the policy chooses among the tokens the
window still shows, and its budget is its share of the window (`WindowedBudget`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from kvtool.models.cache_argument import with_cache
from kvtool.plan_bytes import predict_layer_bytes
from kvtool.recipe import load_recipe
from kvtool.runtime.attach import CompressedRuntime
from kvtool.runtime.eviction import BudgetRule, WindowedBudget, quiet_steps
from tests.tiny_models import featured_model

WINDOW = 48  # the models' sliding window: longer than the policies' own recent windows (8)


def recipe(policy: str, quantization: str | None = None, budget: float = 0.5, interval: int = 16):
    """A bundled evicting recipe with a small recent window (so a share of 48 tokens is not all protected)."""
    r = load_recipe(policy)
    r = dataclasses.replace(r, eviction=dataclasses.replace(r.eviction, window=8, sink_tokens=2, budget=budget, interval=interval))
    if quantization is not None:
        q = load_recipe(quantization)
        r = dataclasses.replace(r, name=f"{policy}+{quantization}", keys=q.keys, values=q.values,
                                cache=dataclasses.replace(q.cache, block_size=32, recent_tokens=8, sink_tokens=2))
    return r


def decode(runtime, ids: torch.Tensor, prefill: int, each_step):
    """Prefill ``prefill`` tokens, then one token per step; ``each_step(cache, reference)`` after every forward, with
    transformers' own cache fed the same tokens."""
    cache, reference = runtime.new_cache(), DynamicCache(config=runtime.model.config)
    with torch.no_grad():
        for start, end in [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.shape[1])]:
            runtime.model(input_ids=ids[:, start:end], **with_cache(cache), use_cache=True)
            runtime.model(input_ids=ids[:, start:end], **with_cache(reference), use_cache=True)
            each_step(cache, reference)
    return cache


def prefilled(model, evicting, tokens: int, seed: int):
    """(cache, each layer's sliding window) after one prefill of ``tokens`` random tokens under ``evicting``."""
    runtime = CompressedRuntime.from_recipe(model, evicting)
    ids = torch.randint(3, 100, (1, tokens), generator=torch.Generator().manual_seed(seed))
    cache = runtime.new_cache()
    with torch.no_grad():
        model(input_ids=ids, **with_cache(cache), use_cache=True)
    return cache, runtime.adapter.geometry.sliding_windows


CASES = [("gemma3_text", "h2o", None), ("gemma3_text", "snapkv", None), ("gemma3_text", "tova", None),
         ("gemma3_text", "streamingllm", None), ("gemma3_text", "rocketkv", None), ("gemma3_text", "snapkv", "kivi-4bit"),
         ("gemma3_text", "cake", None), ("gemma3_text", "chunkkv", None), ("mistral", "h2o", None),
         ("mistral", "tova", "kivi-2bit")]


@pytest.mark.parametrize("family,policy,quantization", CASES, ids=[f"{f}-{p}-{q}" for f, p, q in CASES])
def test_sliding_layers_never_hold_more_than_transformers_cache(family, policy, quantization):
    """Every step: a sliding layer holds at most transformers' sliding layer's tokens (+ the eviction slack and one
    body block), nothing its window hides beyond that slack, and its budget is a share of the window."""
    model = featured_model(family, sliding_window=WINDOW)
    runtime = CompressedRuntime.from_recipe(model, recipe(policy, quantization))
    windows = runtime.adapter.geometry.sliding_windows
    assert any(windows)  # gemma3: sliding and global layers; mistral: every layer sliding
    block = 32 if quantization else 0
    ids = torch.randint(3, 100, (2, 200), generator=torch.Generator().manual_seed(0))
    sliding_peak = []

    def check(cache, reference):
        peak = 0
        for layer, theirs, window in zip(cache.layers, reference.layers, windows):
            held = layer.store.tokens()  # (S,)
            if window is None:
                continue
            assert held.max() <= theirs.keys.shape[-2] + 16 + block, (layer.index, held, theirs.keys.shape)  # it keeps W - 1
            budget = int(layer.budget(layer.index, layer.lengths[:1])[0])
            assert budget <= window
            assert held.max() <= max(budget + 15, window + block + 15)
            peak = max(peak, int(held.max()))
        sliding_peak.append(peak)

    cache = decode(runtime, ids, prefill=120, each_step=check)
    assert max(sliding_peak) > 0
    for layer, window in zip(cache.layers, windows):  # at the end: what a sliding layer holds, it can still see
        _, _, positions, valid = layer.decoded()
        newest = positions.masked_fill(~valid, -1).amax(dim=-1, keepdim=True)
        hidden = valid & (positions <= newest - window) if window else torch.zeros_like(valid)
        assert int(hidden.sum(dim=-1).max()) <= 15 + block, (layer.index, hidden.sum(dim=-1))


def test_a_sliding_layer_keeps_its_share_of_the_window_and_a_global_layer_its_share_of_the_sequence():
    """After a 120-token prefill at 25% kept (float store): global layers hold ceil(0.25 x 120) = 30 tokens per stream,
    sliding layers ceil(0.25 x 48) = 12, all of them inside the window; the policy chose them (not the newest 12)."""
    cache, windows = prefilled(featured_model("gemma3_text", sliding_window=WINDOW), recipe("h2o", budget=0.25), 120, seed=1)
    chose_older = False
    for layer, window in zip(cache.layers, windows):
        held = layer.store.tokens()
        if window is None:
            assert (held == 30).all(), (layer.index, held)
            continue
        assert (held == 12).all(), (layer.index, held)
        _, _, positions, valid = layer.decoded()
        assert bool((positions[valid] > 119 - window).all())
        chose_older |= bool((positions[valid] < 120 - 12).any())  # not simply the newest tokens
    assert chose_older


@pytest.mark.parametrize("quantization", [None, "kivi-4bit"])
def test_sliding_budget_evicts_on_the_sliding_layers_only(quantization):
    """`eviction.sliding_budget`: with budget 1.0 and sliding_budget 0.5 the global layers hold every token of a
    120-token prompt and of the decoded ones, the sliding layers half of their 48-token window (24, + the eviction
    slack and one body block while decoding), chosen by the policy among the tokens the window shows."""
    r = recipe("h2o", quantization, budget=1.0)
    r = dataclasses.replace(r, eviction=dataclasses.replace(r.eviction, sliding_budget=0.5))
    model = featured_model("gemma3_text", sliding_window=WINDOW)
    runtime = CompressedRuntime.from_recipe(model, r)
    windows = runtime.adapter.geometry.sliding_windows
    assert any(windows) and not all(windows)
    ids = torch.randint(3, 100, (1, 160), generator=torch.Generator().manual_seed(5))
    block = 32 if quantization else 0
    steps, chose_older = [], []

    def check(cache, reference):
        held = [int(layer.store.tokens().max()) for layer in cache.layers]
        steps.append(held)
        for layer, h, window in zip(cache.layers, held, windows):
            if window is None:
                assert h == int(layer.lengths.max()), (layer.index, h)  # nothing evicted
            else:
                assert h <= 24 + 15 + block, (layer.index, h)
                if len(steps) == 1 and not quantization:  # after the prefill: inside the window, not just the newest
                    _, _, positions, valid = layer.decoded()
                    assert bool((positions[valid] > 119 - window).all())
                    chose_older.append(bool((positions[valid] < 120 - 24).any()))

    cache = decode(runtime, ids, prefill=120, each_step=check)
    for layer, window in zip(cache.layers, windows):  # a layer that evicts nothing runs without the policy
        assert (layer.policy is None and layer.store.layout.meta == ()) == (window is None), layer.index
    first = steps[0]  # right after the prefill: cut to the budgets exactly
    assert [h for h, w in zip(first, windows) if w is None] == [120] * windows.count(None)
    if not quantization:
        assert all(h == 24 for h, w in zip(first, windows) if w) and any(chose_older)
    assert all(int(layer.store.tokens().max()) == 160 for layer, w in zip(cache.layers, windows) if w is None)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_sliding_budget_layers_without_a_policy_rotate_pre_rope_keys_at_the_sequences_positions(backend):
    """8-bit keys stored before RoPE, every token kept (budget 1.0, sliding_budget 1.0 on a window longer than the
    text), a batch of two with row 1 left-padded and positions from 40 (explicit ``position_ids``): the global layers
    run without a policy, so their keys' positions come from the sequences' recorded ones (no per-slot positions).
    Step by step the logits follow transformers' own cache (measured: 6e-3; with the keys rotated at their slot
    index instead, 0.11)."""
    from transformers import DynamicCache

    from kvtool.recipe import CacheSpec, QuantSpec, Recipe
    from tests.tiny_models import tiny_tokenizer_free_inputs

    model = featured_model("gemma3_text", sliding_window=256)
    r = Recipe(name="prerope8-local", keys=QuantSpec(bits=8, pre_rope=True, path="keys"),
               values=QuantSpec(bits=8, axis="token", group_size=16, path="values"),
               cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
               eviction=dataclasses.replace(recipe("h2o").eviction, budget=1.0, sliding_budget=1.0))
    runtime = CompressedRuntime.from_recipe(model, r, backend=backend)
    windows = runtime.adapter.geometry.sliding_windows
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=120, vocab=100)
    positions = torch.arange(120)[None].expand(2, -1) + 40

    def stepwise(cache, prefill=60):
        with torch.no_grad():
            out = [model(ids[:, :prefill], attention_mask=mask[:, :prefill], position_ids=positions[:, :prefill],
                         **with_cache(cache)).logits[:, -1]]
            for i in range(prefill, ids.shape[1]):
                out.append(model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], position_ids=positions[:, i:i + 1],
                                 **with_cache(cache)).logits[:, -1])
        return torch.stack(out, 1)  # (B, steps, V)

    cache = runtime.new_cache()
    ours, theirs = stepwise(cache), stepwise(DynamicCache(config=model.config))
    assert cache.context.sequence_positions is not None
    assert all((layer.policy is None) == (w is None) for layer, w in zip(cache.layers, windows))
    assert all(int(layer.store.body_len.min()) >= 2 for layer in cache.layers)  # pre-RoPE body blocks read back
    torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=0)


def test_sliding_budget_is_a_share_of_the_window_whatever_the_other_layers_keep():
    """The rule: sliding layers at their fraction of what they can see (at most the window), the others at
    ``budget`` or ``budget_tokens``; growth per kind."""
    rule = BudgetRule(0.25, None, torch.ones(3), frozenset({0, 2}), 0.5)
    lengths = torch.tensor([10, 48, 200])
    assert WindowedBudget(rule, 48)(0, lengths).tolist() == [5, 24, 24]
    assert rule(1, lengths).tolist() == [3, 12, 50]
    assert rule.growth(0) == 0.5 and rule.growth(1) == 0.25
    tokens = BudgetRule(0.5, 100, torch.ones(3), frozenset({1}), 0.75)
    assert WindowedBudget(tokens, 48)(1, lengths).tolist() == [8, 36, 36] and tokens(0, lengths).tolist() == [100] * 3
    assert BudgetRule(0.5, None, torch.ones(2), frozenset({0}), None)(0, lengths).tolist() == [5, 24, 100]  # unset


def test_the_prefill_only_protocol_still_frees_what_the_window_hides():
    """With an interval longer than the generation (the policy never cuts while decoding, as in the peers'
    prefill-only protocol) a sliding layer still drops what left its window, as transformers' cache does."""
    model = featured_model("gemma3_text", sliding_window=WINDOW)
    runtime = CompressedRuntime.from_recipe(model, recipe("h2o", budget=0.25, interval=1000))
    ids = torch.randint(3, 100, (1, 200), generator=torch.Generator().manual_seed(2))

    def check(cache, reference):
        for layer, theirs, window in zip(cache.layers, reference.layers, runtime.adapter.geometry.sliding_windows):
            if window:
                assert layer.store.tokens().max() <= theirs.keys.shape[-2] + 16

    cache = decode(runtime, ids, prefill=60, each_step=check)
    globals_held = [int(layer.store.tokens().max()) for layer, w in zip(cache.layers, runtime.adapter.geometry.sliding_windows) if not w]
    assert globals_held and all(h == 15 + 140 for h in globals_held)  # ceil(0.25 x 60) at prefill, then every decoded token


def test_windowed_budget_is_a_share_of_the_window_that_stops_growing():
    rule = BudgetRule(0.25, None, torch.ones(2))
    windowed = WindowedBudget(rule, 48)
    lengths = torch.tensor([1, 10, 47, 48, 49, 200, 10_000])
    assert windowed(0, lengths).tolist() == [1, 3, 12, 12, 12, 12, 12]
    assert windowed.growth(0) == 0.0 and windowed.never_shrinks
    tokens = WindowedBudget(BudgetRule(0.5, 100, torch.ones(2)), 48)  # a token budget larger than the window
    assert tokens(1, lengths).tolist() == [48] * 7
    assert quiet_steps(5, windowed.growth(0)) == 5  # no growth: exactly the room


@pytest.mark.parametrize("policy,quantization,sliding_budget", [("h2o", None, None), ("snapkv", "kivi-4bit", None),
                                                                 ("h2o", "kivi-4bit", 0.5)])
def test_the_plan_bounds_what_sliding_layers_hold(policy, quantization, sliding_budget):
    """`predict_layer_bytes` on a model with sliding-window layers: never below what any step holds, and within 5%
    of the largest step at the context where decoding ends (the rule's limit is reached). With ``sliding_budget``
    (budget 1.0: the global layers evict nothing and hold no per-slot metadata) the global layers too."""
    model = featured_model("gemma3_text", sliding_window=WINDOW)
    evicting = recipe(policy, quantization)
    if sliding_budget is not None:
        evicting = dataclasses.replace(evicting, eviction=dataclasses.replace(evicting.eviction, budget=1.0, sliding_budget=sliding_budget))
    runtime = CompressedRuntime.from_recipe(model, evicting)
    ids = torch.randint(3, 100, (2, 160), generator=torch.Generator().manual_seed(3))
    windows = runtime.adapter.geometry.sliding_windows
    steps = []
    decode(runtime, ids, prefill=100, each_step=lambda cache, _: steps.append(
        [layer.store.used_nbytes() + 8 * (layer.lengths.numel() + layer.group_of_stream.numel()) for layer in cache.layers]))
    for length, held in zip(range(100, 161), steps):
        predicted = predict_layer_bytes(runtime, length, 2)
        assert all(h <= 1.02 * p for h, p in zip(held, predicted)), (length, held, predicted)
    predicted = predict_layer_bytes(runtime, 160, 2)
    for index, window in enumerate(windows):
        if window:
            most = max(step[index] for step in steps[-32:])
            assert most >= 0.95 * predicted[index] / 1.02, (index, most, predicted[index])
        elif sliding_budget is not None:  # every token held, no per-slot metadata: the prediction is the bytes held
            assert abs(steps[-1][index] - predicted[index]) <= 0.002 * predicted[index], (index, steps[-1][index], predicted[index])


def test_cake_splits_the_layers_visible_tokens():
    """CAKE (window-aware budgets): after a 120-token prompt and one decoded token at 25%, the layers together hold
    exactly the sum of their uniform budgets at 121 tokens: ceil(0.25 x 121) = 31 for the global layer, ceil(0.25 x 48)
    = 12 for the sliding one (its window), split by preference; the sliding layer holds only tokens it can see."""
    model = featured_model("gemma3_text", sliding_window=WINDOW)
    runtime = CompressedRuntime.from_recipe(model, recipe("cake", budget=0.25, interval=1000))
    windows = runtime.adapter.geometry.sliding_windows
    ids = torch.randint(3, 100, (1, 121), generator=torch.Generator().manual_seed(4))
    cache = runtime.new_cache()
    with torch.no_grad():
        model(input_ids=ids[:, :120], **with_cache(cache), use_cache=True)
        model(input_ids=ids[:, 120:], **with_cache(cache), use_cache=True)
    held = [int(layer.store.tokens()[0]) for layer in cache.layers]
    assert sum(held) == 31 + 12, held
    for layer, window, n in zip(cache.layers, windows, held):
        if window:
            _, _, positions, valid = layer.decoded()
            assert bool((positions[valid] > 120 - window).all()) and n <= window
    assert held[0] != 12 or held[1] != 31  # the preferences moved tokens between the layers


def test_pyramidinfer_over_a_sliding_layer_may_keep_what_that_layer_could_not_see():
    """PyramidInfer nests each layer's kept set in the layer below's; a sliding layer below saw only its window, so a
    global layer above it still chooses among the older tokens (it kept only the local window's tokens before)."""
    types = ["sliding_attention", "full_attention"] * 2  # local, global, local, global
    model = featured_model("gemma3_text", sliding_window=WINDOW, num_hidden_layers=4, layer_types=types)
    cache, windows = prefilled(model, recipe("pyramidinfer", budget=0.5), 160, seed=3)
    over_sliding = [i for i in range(1, len(windows)) if windows[i] is None and windows[i - 1]]
    assert over_sliding  # the tiny Gemma 3 has a global layer right above a local one
    for index in over_sliding:
        _, _, positions, valid = cache.layers[index].decoded()
        kept = positions[valid]
        older = kept[(kept >= 2) & (kept <= 159 - WINDOW)]  # past the sinks, outside the local layer's window
        assert older.numel() > 0, (index, sorted(kept.tolist()))
        _, _, below, below_valid = cache.layers[index - 1].decoded()
        inside = kept[(kept > 159 - WINDOW) & (kept < 160 - 8)]  # judged by the local layer, not the recent window
        assert set(inside.tolist()) <= set(below[below_valid].tolist())  # still nested where the layer below chose
        earlier = [i for i in range(index) if windows[i] is None]
        if earlier:  # older tokens: only those the last global layer below kept (the last layer that saw them)
            _, _, previous, previous_valid = cache.layers[earlier[-1]].decoded()
            assert set(older.tolist()) <= set(previous[previous_valid].tolist())
    assert any(any(windows[i] is None for i in range(index)) for index in over_sliding)  # that case is exercised


def test_per_layer_sliding_budgets_from_layer_overrides():
    """``layer_overrides`` with ``eviction: {sliding_budget: f}``: each named sliding-window layer keeps its own share
    of the window (the others the recipe's), one given its whole window runs without the policy (the window rule
    alone, no per-slot metadata), the global layers keep everything; the plan predicts the bytes; the summary names
    the shares; entries on full-attention layers, or without a recipe-wide ``sliding_budget``, are refused."""
    from kvtool.errors import RecipeError
    from kvtool.recipe import dump_recipe, recipe_from_dict
    from kvtool.recipe_summary import eviction_summary

    model = featured_model("gemma3_text", sliding_window=WINDOW, num_hidden_layers=4,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"])
    raw = recipe("h2o", budget=1.0).to_dict()
    raw["eviction"]["sliding_budget"] = 0.5
    raw["layer_overrides"] = [{"layers": [0], "eviction": {"sliding_budget": 0.25}},
                              {"layers": [2], "eviction": {"sliding_budget": 1.0}}]
    r = recipe_from_dict(raw)
    assert recipe_from_dict(__import__("yaml").safe_load(dump_recipe(r))) == r
    assert "layers [0]: 25.0%; layers [2]: 100.0%" in eviction_summary(r)
    runtime = CompressedRuntime.from_recipe(model, r)
    assert runtime.adapter.geometry.sliding_windows[:3] == (WINDOW,) * 3 and not runtime.adapter.geometry.sliding_windows[3]
    ids = torch.randint(3, 100, (1, 120), generator=torch.Generator().manual_seed(4))
    cache = runtime.new_cache()
    with torch.no_grad():
        model(input_ids=ids, **with_cache(cache), use_cache=True)
    held = [int(layer.store.tokens().max()) for layer in cache.layers]
    assert held[0] == 12 and held[1] == 24 and WINDOW - 1 <= held[2] <= WINDOW + 15 and held[3] == 120, held
    from kvtool.runtime.eviction import SlidingWindowRule
    assert [type(layer.policy).__name__ for layer in cache.layers][2:] == [SlidingWindowRule.__name__, "NoneType"]
    assert [layer.store.layout.meta for layer in cache.layers] == [("pos", "score")] * 2 + [("pos",), ()]  # no scores
    assert predict_layer_bytes(runtime, 120, 1)[0] < predict_layer_bytes(runtime, 120, 1)[1]

    for overrides, match in (
        ([{"layers": [3], "eviction": {"sliding_budget": 0.25}}], r"layers \[3\], which have no sliding window"),
        ([{"layers": "full", "eviction": {"sliding_budget": 0.25}}], r"full-attention layers, which have none"),
        ([{"layers": [0], "eviction": {"sliding_budget": 0.0}}], r"sliding_budget.*fraction"),
        ([{"layers": [0], "eviction": {"budget": 0.5}}], r"eviction.budget.*cannot be set per layer"),
    ):
        with pytest.raises(RecipeError, match=match):
            CompressedRuntime.from_recipe(model, recipe_from_dict({**raw, "layer_overrides": overrides}))
    raw["eviction"]["sliding_budget"] = None
    with pytest.raises(RecipeError, match=r"layer_overrides\[0\]\.eviction.*no eviction.sliding_budget"):
        recipe_from_dict(raw)
