"""SnapKV's observation window at small budgets (`EvictionSpec.window_share`), on tiny random models.

The window's queries score the older tokens and the window itself is kept; the recipes' 32 tokens
were made for budgets of 1024+ tokens. At a small budget the window is capped at an eighth of it
(issue 13: at 64 kept tokens a 32-token window held half the cache, the filler before the question,
and its filler queries scored the rest). The oracle is an eager forward of the same weights: the
kept set after prefill is recomputed from its attention in plain code.
"""

import torch

from kvtool.methods.evict.base import policy_class
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import EvictionSpec
from tests.test_cake_pyramidinfer import GROUP, KV_HEADS, T, eager_attention, shaped_model, top_kept
from tests.test_eviction_runtime import decode_batch_like_alone, evicting, held, runtime
from tests.tiny_models import tiny_model

SINKS = 2


def test_a_small_budget_observes_and_keeps_an_eighth_of_it():
    """Budget 0.25 of 64 tokens = 16 per stream: window min(16, 16 / 8) = 2 queries observed and kept, 2 sinks and
    the 12 best-scored older tokens by those 2 queries' attention (summed over the KV head's query heads).

    Before the cap the 16-token window and the sinks (18) did not fit the 16-token budget: the stream kept the
    sinks and the newest tokens, whatever their scores."""
    model = shaped_model()
    recipe = evicting("snapkv", budget=0.25, sink_tokens=SINKS, window=16, pooling=1, interval=16)
    ids = torch.randint(3, 100, (2, T), generator=torch.Generator().manual_seed(5))
    cache = runtime(model, recipe).new_cache()
    with torch.no_grad():
        model(ids, **with_cache(cache))
    window, budget = 2, 16
    must = set(range(SINKS)) | set(range(T - window, T))
    for layer, attention in enumerate(eager_attention(model, ids)):  # (B, H_q, T, T)
        kept = held(cache.layers[layer])
        for seq in range(2):
            for head in range(KV_HEADS):
                rows = attention[seq, head * GROUP : (head + 1) * GROUP, -window:, :].double()  # (G, w, T)
                expected = top_kept(rows.sum(dim=(0, 1)), range(T), must, budget)
                assert set(kept[seq * KV_HEADS + head]) == expected, (layer, seq, head)


def test_the_window_stays_whole_at_large_budgets_and_for_recency_guards():
    def window(policy, visible, **spec):
        return policy_class(policy)(EvictionSpec(policy=policy, **spec)).recent_window(torch.tensor([visible])).item()

    assert window("snapkv", 512, budget=0.125) == 8  # 64 kept: an eighth
    assert window("snapkv", 512, budget=0.25) == 16
    assert window("snapkv", 512, budget=0.5) == 32  # 256 kept: the recipe's 32, as before
    assert window("snapkv", 100_000, budget=0.5) == 32  # never more than ``window``
    assert window("chunkkv", 512, budget=0.125) == 8
    assert window("rocketkv", 512, budget=0.125) == 8
    assert window("snapkv", 512, budget=0.5, budget_tokens=64) == 8  # an absolute budget: an eighth of it
    assert window("snapkv", 6, budget=0.5) == 1  # at least one query observes
    assert window("snapkv", 512, budget=0.125, window_share=None) == 32  # opt out: the recipe's window
    assert window("h2o", 512, budget=0.125) == 32  # a recency guard against scores that favour old tokens: whole
    assert window("cake", 512, budget=0.125) == 32


def test_sequences_of_a_batch_observe_their_own_windows():
    """A left-padded pair (48 and 33 tokens) at half: budgets of 24 and 17, windows of 3 and 2 queries at prefill
    (each sequence's own, not the batch's longest): the batch generates what each sequence generates alone."""
    model = tiny_model("llama")
    rt = runtime(model, evicting("snapkv", budget=0.5, window=16, float_dtype="float16"))
    decode_batch_like_alone(model, rt, seed=3, new_tokens=12)


def test_decode_steps_protect_the_recipes_whole_window():
    """The cap is the observation window's, at prefill. A decode step scores by attention summed over every query,
    which favours old tokens (H2O's regime): it keeps the recipe's whole recent window, as H2O does."""
    model = shaped_model()
    recipe = evicting("snapkv", budget=0.5, sink_tokens=SINKS, window=16, pooling=1, interval=1)
    ids = torch.randint(3, 100, (2, T + 4), generator=torch.Generator().manual_seed(6))
    cache = runtime(model, recipe).new_cache()
    with torch.no_grad():
        model(ids[:, :T], **with_cache(cache))  # budget 32: a 4-token window observes and is kept
        prefill = [[set(stream) for stream in held(layer)] for layer in cache.layers]
        for i in range(T, T + 4):  # every step cut back to the budget
            model(ids[:, i : i + 1], **with_cache(cache))
    recent = set(range(T + 4 - 16, T + 4))  # the whole window at the end
    assert any(not set(range(T - 16, T)) <= stream for layer in prefill for stream in layer)  # prefill: only 4 sure
    for layer, before in zip(cache.layers, prefill):
        for stream, kept in zip(held(layer), before):
            assert (kept | set(range(T, T + 4))) & recent <= set(stream)  # what the window holds was never cut
            assert len(stream) == 34  # ceil(0.5 x 68)
