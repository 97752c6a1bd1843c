"""RocketKV: stage 1 (prompt-only SnapKV++ eviction) and stage 2 (sparse attention from key summaries).

Mechanics on tiny random models: the key summaries are the exact per-channel max/min of each
group's valid slots after prefill, decoding and eviction; the approximate group logits bound the
true logits from above (one query row, every channel); a needle's group is always read; a step
reading every token reproduces the model exactly, one reading a quarter really differs and reads
what it reports; bytes include the summaries and match the walk; batches equal each sequence
alone; stage 1 keeps what SnapKV keeps at prefill and every generated token after. Quality on
SmolLM2-135M: the pass-key floor in test_eviction_passkey.py, perplexity in benchmarks/RESULTS.md.
"""

import dataclasses
import math

import pytest
import torch

from kvtool.errors import RecipeError, RuntimeConfigError
from kvtool.methods.sparse.rocketkv import (
    Selection, approximate_group_logits, groups_to_read, partial_logits, select_groups, unread_blocks_term,
    unread_logsumexp, unread_term,
)
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import EvictionSpec, QuantSpec, SparseAttentionSpec, load_recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe
from kvtool.runtime.backend import resolve_backend
from kvtool.runtime.memory import walked_nbytes
from kvtool.runtime.store import FLOAT_BLOCK
from tests.test_eviction_runtime import _generate, decode_batch_like_alone, evicting, held, run_tokens
from tests.tiny_models import ALL_FAMILIES, featured_model, tiny_model


def sparse(recipe, **fields):
    spec = SparseAttentionSpec(method="rocketkv", **{"min_tokens": 1, **fields})
    return dataclasses.replace(recipe, name=f"{recipe.name}+sparse", sparse_attention=spec)


def brute_summaries(store, n):
    """(S, N, g, D) max and min of every held group of n slots (valid slots only), from the keys themselves."""
    blocks = store.float_blocks()
    ids = store.float_block_ids(0, int(blocks.max()))
    keys = store.read_blocks(store.float_pool, ("k",), ids)["k"].float()  # (S, F*fbs, g, D)
    shape = (ids.shape[0], keys.shape[1] // n, *keys.shape[2:])
    maxes, mins = torch.full(shape, -math.inf), torch.full(shape, math.inf)
    for s in range(ids.shape[0]):
        for j in range(-(-int(store.float_len[s]) // n)):
            end = min(int(store.float_len[s]), (j + 1) * n)
            maxes[s, j] = keys[s, j * n : end].amax(dim=0)
            mins[s, j] = keys[s, j * n : end].amin(dim=0)
    return maxes, mins


def check_summaries(cache, n):
    for layer in cache.layers:
        store = layer.store
        want_max, want_min = brute_summaries(store, n)
        kmax, kmin = store.key_summaries()
        held_groups = torch.arange(kmax.shape[1])[None] < -(-torch.from_numpy(store.float_len) // n)[:, None]
        assert torch.equal(kmax.float()[held_groups], want_max[held_groups])
        assert torch.equal(kmin.float()[held_groups], want_min[held_groups])


# --- the selection, on its own -------------------------------------------------------------------
def test_approximate_group_logits_bound_every_token_of_a_group_from_above():
    gen = torch.Generator().manual_seed(0)
    s, f, d = 3, 5, 16
    keys = torch.randn(s, f, 4, 1, d, generator=gen)  # (S, N, n, g, D): groups of 4 tokens
    q = torch.randn(s, 1, 1, d, generator=gen) * d ** -0.5  # one row, already scaled
    approx = approximate_group_logits(q, keys.amax(dim=2), keys.amin(dim=2), channels=1.0, scaling=d ** -0.5)
    exact = torch.einsum("sgrd,sftgd->sgrft", q, keys).amax(dim=-1)  # (S, g, R, N) best token per group
    assert (approx >= exact - 1e-5).all()
    assert (approx > exact + 1e-3).any()  # a bound, not the max itself


def test_a_needle_group_is_always_read():
    gen = torch.Generator().manual_seed(1)
    s, groups, n, d, rows = 4, 64, 2, 64, 3
    q = torch.randn(s, 1, rows, d, generator=gen)
    keys = 0.1 * torch.randn(s, groups, n, 1, d, generator=gen)
    spec = SparseAttentionSpec(method="rocketkv", read_fraction=0.125, summary_tokens=n, min_tokens=1, channels=0.5)
    held = torch.tensor([128, 80, 127, 18])  # tokens
    needle = torch.minimum(torch.randint(0, groups, (s,), generator=gen), (held - 1) // n)
    keys[torch.arange(s), needle, 1, 0] = 3 * q.mean(dim=2)[:, 0]  # one token every row of the group attends to
    selection = select_groups(spec, q * d ** -0.5, keys.amax(dim=2), keys.amin(dim=2), held, d ** -0.5)
    chosen, count = selection.groups, selection.count
    assert count.tolist() == [8, 5, 7, 1]  # floor(tokens / 8 / 2) groups of 2
    for stream in range(s):
        picked = chosen[stream, : count[stream]].tolist()
        assert int(needle[stream]) in picked and max(picked) <= (int(held[stream]) - 1) // n


def test_groups_to_read_take_the_fraction_rounded_down_at_least_min_tokens_at_most_all():
    spec = SparseAttentionSpec(method="rocketkv", read_fraction=0.25, summary_tokens=4, min_tokens=16)
    tokens = torch.tensor([0, 1, 7, 16, 64, 65, 100, 160, 1000])
    assert groups_to_read(spec, tokens).tolist() == [0, 1, 2, 4, 4, 4, 6, 10, 62]  # 65 / 4 / 4 -> 4, 1000 -> 62
    spec = SparseAttentionSpec(method="rocketkv", read_fraction=0.3, summary_tokens=2, min_tokens=3)
    assert groups_to_read(spec, torch.tensor([1, 5, 20, 21])).tolist() == [1, 2, 3, 3]  # min 2 groups; 6.3 -> 3


# --- the runtime --------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4, 16])
def test_summaries_are_exact_after_prefill_decoding_and_eviction(n):
    model = tiny_model("llama")
    recipe = sparse(evicting("rocketkv", budget=0.5, float_dtype="float16"), summary_tokens=n)
    cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
    ids = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(2))
    run_tokens(model, cache, ids[:, :45], prefill=40)  # prefill evicts (holes refilled), 5 decode steps in place
    check_summaries(cache, n)
    with torch.no_grad():
        model(ids[:, 45:60], **with_cache(cache))  # a second chat turn evicts again
    check_summaries(cache, n)
    run_tokens(model, cache, ids[:, 60:70], prefill=1)
    check_summaries(cache, n)


def test_reading_every_block_reproduces_the_model_exactly():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model(ids).logits
    cache = CompressedRuntime.from_recipe(model, sparse(uncompressed_recipe("model"), read_fraction=1.0)).new_cache()
    logits = run_tokens(model, cache, ids, prefill=20)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-4)
    assert cache.memory_report()["sparse_read_fraction"] == 1.0


def test_reading_a_quarter_really_skips_tokens_and_reports_what_it_read():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 130), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = model(ids).logits
    cache = CompressedRuntime.from_recipe(model, sparse(uncompressed_recipe("model"), read_fraction=0.25)).new_cache()
    logits = run_tokens(model, cache, ids, prefill=64)
    assert torch.equal(logits[:, :64], reference[:, :64]) or torch.allclose(logits[:, :64], reference[:, :64], atol=1e-5)
    assert (logits[:, 66:] - reference[:, 66:]).abs().max() > 1e-3  # decode steps attended to a subset
    # stored tokens before each of the 66 decode steps: 64 .. 129; each step reads floor(tokens / 4 / 2) groups of 2
    held_tokens = range(64, 130)
    most = sum(2 * math.floor(t / 8) for t in held_tokens)
    least = most - sum(t % 2 for t in held_tokens)  # the last group of an odd count holds one token
    report = cache.memory_report()
    assert least / sum(held_tokens) <= report["sparse_read_fraction"] <= most / sum(held_tokens)  # 0.2344..0.2352
    assert 0.23 <= report["sparse_read_fraction"] <= 0.25


def test_bytes_include_the_summaries_and_match_the_walk():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 50), generator=torch.Generator().manual_seed(5))
    caches = {}
    for with_summaries in (False, True):
        recipe = evicting("rocketkv", budget=0.5, float_dtype="float16")
        recipe = sparse(recipe) if with_summaries else recipe
        cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
        run_tokens(model, cache, ids, prefill=40)
        assert cache.nbytes() == cache.expected_nbytes()
        assert walked_nbytes(cache) >= cache.reserved_nbytes() >= cache.nbytes()
        caches[with_summaries] = cache
    blocks = sum(int(layer.store.float_blocks().sum()) for layer in caches[True].layers)
    summaries = blocks * (FLOAT_BLOCK // 2) * 2 * 32 * 2  # 8 groups of 2 slots per block; kmax + kmin, head_dim 32, fp16
    assert caches[True].memory_report()["key_summary_bytes"] == summaries
    assert caches[True].nbytes() - caches[False].nbytes() == summaries
    assert "key_summary_bytes" not in caches[False].memory_report()


def test_one_token_groups_read_the_keys_themselves_and_hold_nothing_more():
    """summary_tokens 1: the keys are their own summaries: no kmax / kmin pool, no summary bytes, and the same
    tokens and logits as 1-token max/min summaries would give (they equal the keys)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 90), generator=torch.Generator().manual_seed(9))
    recipe = sparse(evicting("rocketkv", budget=0.5, float_dtype="float16"), summary_tokens=1, read_fraction=0.25)
    plain = CompressedRuntime.from_recipe(model, evicting("rocketkv", budget=0.5, float_dtype="float16")).new_cache()
    cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
    logits = run_tokens(model, cache, ids, prefill=60)
    run_tokens(model, plain, ids, prefill=60)
    for layer in cache.layers:
        assert "kmax" not in layer.store.float_pool.tensors
    report = cache.memory_report()
    assert report["key_summary_bytes"] == 0 and cache.nbytes() == plain.nbytes() == cache.expected_nbytes()
    assert walked_nbytes(cache) >= cache.reserved_nbytes() >= cache.nbytes()
    assert 0.2 <= report["sparse_read_fraction"] <= 0.25
    check_summaries(cache, 1)
    # with every channel scored, one-token groups select exactly the tokens with the most attention
    layer = cache.layers[0]
    keys, _ = layer.store.key_summaries()  # (S, N, 1, D)
    d = keys.shape[-1]
    q = torch.randn(keys.shape[0], 1, 2, d, generator=torch.Generator().manual_seed(1)) * d ** -0.5  # scaled rows
    held_tokens = layer.store.lengths("float_len")
    spec = dataclasses.replace(recipe.sparse_attention, channels=1.0)
    selection = select_groups(spec, q, keys, keys, held_tokens, d ** -0.5)
    chosen, count = selection.groups, selection.count
    for stream in range(keys.shape[0]):
        n_held, k = int(held_tokens[stream]), int(count[stream])
        probs = torch.softmax(q[stream, 0] @ keys[stream, :n_held, 0].float().T, dim=-1).mean(dim=0)  # (n_held,)
        assert set(chosen[stream, :k].tolist()) == set(probs.topk(k).indices.tolist())
    assert (logits[:, 62:] - run_tokens(model, CompressedRuntime.from_recipe(model, sparse(
        evicting("rocketkv", budget=0.5, float_dtype="float16"), summary_tokens=1, read_fraction=1.0)).new_cache(),
        ids, prefill=60)[:, 62:]).abs().max() > 1e-4  # a quarter really skips tokens


def test_stage_one_keeps_what_snapkv_keeps_at_prefill_and_every_generated_token():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(6))
    kept = {}
    for policy in ("rocketkv", "snapkv"):
        cache = CompressedRuntime.from_recipe(model, evicting(policy, budget=0.5)).new_cache()
        with torch.no_grad():
            model(ids[:, :48], **with_cache(cache))
        kept[policy] = [sorted(h) for layer in cache.layers for h in held(layer)]
        if policy == "rocketkv":
            run_tokens(model, cache, ids[:, 48:], prefill=1)
            for layer, after in zip(cache.layers, [held(layer) for layer in cache.layers]):
                for stream, positions in enumerate(after):
                    assert set(range(48, 64)) <= set(positions)  # generated tokens are never evicted
                    assert len(positions) == 24 + 16
    assert kept["rocketkv"] == kept["snapkv"]


@pytest.mark.parametrize("read_fraction", [0.25, 1.0])
def test_a_left_padded_batch_decodes_like_each_sequence_alone(read_fraction):
    model = tiny_model("llama")
    rt = CompressedRuntime.from_recipe(model, sparse(evicting("rocketkv", budget=0.5), read_fraction=read_fraction))
    cache = decode_batch_like_alone(model, rt, seed=7)
    assert cache.nbytes() == cache.expected_nbytes()


def test_the_bundled_recipe_composes_both_stages():
    recipe = load_recipe("rocketkv")
    assert recipe.eviction.policy == "rocketkv" and recipe.sparse_attention.method == "rocketkv"
    assert recipe.sparse_attention.read_fraction == 0.25 and recipe.sparse_attention.summary_tokens == 1  # the keys
    assert recipe.sparse_attention.unread == "estimate_blocks" and recipe.sparse_attention.channel_score == "query_key"
    assert recipe.sparse_attention.read_budget == "shared"


def test_impossible_combinations_are_refused_with_the_fix():
    base = sparse(uncompressed_recipe("float16"))
    with pytest.raises(RecipeError, match="sparse_attention.method.*float blocks only"):
        dataclasses.replace(base, keys=QuantSpec(method="uniform", bits=4, axis="channel", path="keys"))
    with pytest.raises(RecipeError, match="policy 'h2o' scores tokens"):
        dataclasses.replace(base, eviction=EvictionSpec(policy="h2o"))
    for field, value in (("read_fraction", 0.0), ("read_fraction", 1.5), ("summary_tokens", 3), ("summary_tokens", 32),
                         ("min_tokens", 0), ("channels", 0.0), ("method", "quest"), ("unread", "ignore"),
                         ("channel_score", "key")):
        with pytest.raises(RecipeError, match=f"sparse_attention.{field}"):
            SparseAttentionSpec(**{"method": "rocketkv", field: value})
    with pytest.raises(RecipeError, match="sparse_attention.unread.*summary_tokens: 1"):
        SparseAttentionSpec(method="rocketkv", summary_tokens=2, unread="estimate")
    assert resolve_backend("triton", torch.device("cuda"), base) == "triton"  # the sparse read has a kernel
    assert resolve_backend("auto", torch.device("cpu"), base) == "torch"


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_family_decodes_with_both_stages(family):
    """Sliding-window layers (Mistral, Gemma 2/3, GPT-OSS) attend to their window as before; full-attention
    layers read a quarter; softcapping (Gemma 2) and learned sinks (GPT-OSS) go through the sparse step."""
    model = featured_model(family)
    recipe = sparse(evicting("rocketkv", budget=0.5, float_dtype="float16"), read_fraction=0.25)
    cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
    ids = torch.randint(3, 100, (2, 60), generator=torch.Generator().manual_seed(8))
    _generate(model, cache, ids, torch.ones_like(ids), new_tokens=20)
    report = cache.memory_report()
    assert report["cache_bytes"] == report["expected_cache_bytes"]
    all_sliding = all(layer.context.sliding_window(layer.index) for layer in cache.layers)
    if all_sliding:  # every layer is a sliding-window layer: nothing is read sparsely
        assert report["sparse_read_fraction"] == 1.0
    else:
        assert 0.18 <= report["sparse_read_fraction"] <= 0.25


# --- unread: estimate ---------------------------------------------------------------------------
def estimating(read_fraction=0.25, unread="estimate", **eviction):
    recipe = evicting("rocketkv", budget=0.5, float_dtype="float16", **eviction)
    return sparse(recipe, summary_tokens=1, read_fraction=read_fraction, unread=unread)


def check_token_sums(cache):
    for layer in cache.layers:
        store = layer.store
        ids = store.float_block_ids(0, int(store.float_blocks().max()))
        sums = store.token_sums()
        assert len(sums) == (3 if store.layout.key_squares else 2)
        for part, got in zip(("k", "v", "k2"), sums):
            x = store.read_blocks(store.float_pool, (part[0],), ids)[part[0]].float()  # (S, F*fbs, g, D)
            x = x.square() if part == "k2" else x
            held_slots = torch.arange(x.shape[1])[None] < torch.from_numpy(store.float_len)[:, None]
            want = (x * held_slots[..., None, None]).sum(dim=1)  # (S, g, D)
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-3)  # fp16 block sums


def test_unread_logsumexp_is_over_the_held_groups_not_read():
    gen = torch.Generator().manual_seed(10)
    s, g, r, n = 3, 1, 2, 12
    partial = torch.randn(s, g, r, n, generator=gen)
    held = torch.tensor([12, 7, 3])
    partial = partial.masked_fill(torch.arange(n)[None, None, None] >= held[:, None, None, None], -math.inf)
    groups = torch.tensor([[4, 0, 9, 1], [6, 2, 5, 0], [1, 0, 2, 5]])  # ranked; entries past count are ignored
    count = torch.tensor([3, 4, 3])
    lse, unread = unread_logsumexp(partial, groups, count)
    for stream in range(s):
        chosen = set(groups[stream, : count[stream]].tolist())
        rest = [j for j in range(int(held[stream])) if j not in chosen]
        assert int(unread[stream]) == len(rest)
        want = torch.logsumexp(partial[stream, :, :, rest], dim=-1) if rest else torch.full((g, r), -math.inf)
        torch.testing.assert_close(lse[stream], want)


def test_the_unread_term_completes_the_partial_logits_with_the_unread_keys_mean():
    """With every token but one read, the term is that token: its value, and a logit that is exact on the scored
    channels and q . k on the others (the mean of one key is the key)."""
    gen = torch.Generator().manual_seed(16)
    d, n = 8, 5
    q = torch.randn(1, 1, 2, d, generator=gen)
    keys, values = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    used = torch.zeros(1, 1, 1, d, dtype=torch.bool)
    used[..., :3] = True  # the selection scored channels 0-2
    partial = (q[..., :3] @ keys[:, :3].T)  # (1, 1, 2, n)
    selection = Selection(torch.tensor([[0, 1, 3, 4]]), torch.tensor([4]), partial, used)
    held = (keys.sum(dim=0)[None, None], values.sum(dim=0)[None, None])
    read = (keys[[0, 1, 3, 4]].sum(dim=0)[None, None], values[[0, 1, 3, 4]].sum(dim=0)[None, None])
    logit, mean, unread = unread_term(selection, q, held, read)
    assert unread.tolist() == [1]
    torch.testing.assert_close(mean[0, 0], values[2])
    torch.testing.assert_close(logit[0, 0], q[0, 0] @ keys[2])  # partial on 0-2, completed by the mean on 3-7
    nothing_left = Selection(torch.tensor([[0, 1, 2, 3, 4]]), torch.tensor([5]), partial, used)
    logit, _, unread = unread_term(nothing_left, q, held, held)
    assert unread.tolist() == [0] and torch.isinf(logit).all() and (logit < 0).all()


def brute_blocks_term(q, keys, values, read, used, fbs):
    """The per-block estimate written out token by token: q (R, D), keys / values (N, D) of one stream, read (N,)."""
    n = keys.shape[0]
    logits, weights = [], []
    for i in range(n):
        if read[i]:
            continue
        block = slice(i // fbs * fbs, min(n, (i // fbs + 1) * fbs))
        mean_key, mean_value = keys[block].mean(dim=0), values[block].mean(dim=0)
        key = torch.where(used, keys[i], mean_key)  # the scored channels its own, the rest its block's mean
        logits.append(q @ key)  # (R,)
        weights.append(mean_value)
    logits = torch.stack(logits, dim=-1)  # (R, unread)
    return torch.logsumexp(logits, dim=-1), torch.softmax(logits, dim=-1) @ torch.stack(weights)  # (R,), (R, D)


def test_the_block_estimate_completes_each_token_with_its_block_and_weights_the_block_values():
    """``estimate_blocks`` against its definition written token by token: two streams of 3 blocks of 4 slots (the
    last partly held), half the channels scored, some tokens read; a stream with everything read has no term."""
    gen = torch.Generator().manual_seed(19)
    fbs, f, d, r = 4, 3, 8, 2
    q = torch.randn(2, 1, r, d, generator=gen)
    keys, values = torch.randn(2, f * fbs, d, generator=gen), torch.randn(2, f * fbs, d, generator=gen)
    held = torch.tensor([10, 6])
    used = torch.zeros(2, 1, 1, d, dtype=torch.bool)
    used[0, ..., :4], used[1, ..., 2:6] = True, True
    partial = torch.matmul(q.masked_fill(~used, 0.0), keys[:, None].transpose(-1, -2))  # (S, 1, R, N)
    partial = partial.masked_fill(torch.arange(f * fbs)[None, None, None] >= held[:, None, None, None], -math.inf)
    groups = torch.tensor([[9, 2, 5, 0, 0, 0], [0, 1, 2, 3, 4, 5]])
    count = torch.tensor([3, 6])
    slots_held = torch.arange(f * fbs)[None] < held[:, None]  # (S, N)
    block_sums = tuple((x * slots_held[..., None]).reshape(2, f, fbs, d).sum(dim=2)[:, :, None] for x in (keys, values))
    tokens = (held[:, None] - torch.arange(f)[None] * fbs).clamp(min=0, max=fbs)  # (S, F)
    logit, value, unread = unread_blocks_term(Selection(groups, count, partial, used), q, block_sums, tokens)
    assert unread.tolist() == [7, 0]
    read = torch.zeros(10, dtype=torch.bool)
    read[[9, 2, 5]] = True
    want_logit, want_value = brute_blocks_term(q[0, 0], keys[0, :10], values[0, :10], read, used[0, 0, 0], fbs)
    torch.testing.assert_close(logit[0, 0], want_logit)
    torch.testing.assert_close(value[0, 0], want_value)
    assert torch.isinf(logit[1]).all() and (logit[1] < 0).all() and torch.equal(value[1], torch.zeros_like(value[1]))


def test_the_block_estimate_with_every_channel_scored_has_the_exact_unread_mass():
    """Every channel scored: the term's logit is the exact logsumexp of the unread tokens' logits, and each block's
    share of it takes the block's mean value."""
    gen = torch.Generator().manual_seed(20)
    fbs, f, d = 4, 2, 8
    q = torch.randn(1, 1, 3, d, generator=gen)
    keys, values = torch.randn(1, f * fbs, d, generator=gen), torch.randn(1, f * fbs, d, generator=gen)
    partial = torch.matmul(q, keys[:, None].transpose(-1, -2))  # (1, 1, 3, N): exact logits
    read = [0, 1, 3, 4, 5, 6]  # unread: 2 (block 0), 7 (block 1)
    selection = Selection(torch.tensor([read]), torch.tensor([6]), partial, None)
    block_sums = tuple(x.reshape(1, f, fbs, d).sum(dim=2)[:, :, None] for x in (keys, values))
    logit, value, _ = unread_blocks_term(selection, q, block_sums, torch.full((1, f), fbs))
    unread_logits = partial[0, 0, :, [2, 7]]  # (3, 2)
    torch.testing.assert_close(logit[0, 0], torch.logsumexp(unread_logits, dim=-1))
    means = values[0].reshape(f, fbs, d).mean(dim=1)  # (F, D)
    torch.testing.assert_close(value[0, 0], torch.softmax(unread_logits, dim=-1) @ means)


# --- read_budget: shared ------------------------------------------------------------------------------
def test_a_shared_read_budget_moves_reads_from_a_sharp_head_to_a_broad_one():
    """Two sequences x 2 KV heads of 64 tokens, a quarter read (16 each): head 0 puts its attention on 4 tokens,
    head 1 spreads it evenly; shared, head 0 reads only what beats head 1's even share and gives the rest to head 1,
    down to min_tokens; the sequence reads what it would have read in total."""
    d, n = 8, 64
    q = torch.zeros(4, 1, 1, d)
    q[..., 0] = 1.0
    keys = torch.zeros(4, n, 1, d)
    keys[0::2, :4, 0, 0] = 20.0  # the sharp heads (streams 0, 2): 4 tokens take nearly all the attention
    held = torch.full((4,), n)
    for min_tokens, sharp in ((1, 4), (8, 8)):
        spec = SparseAttentionSpec(method="rocketkv", summary_tokens=1, channels=1.0, read_fraction=0.25,
                                   min_tokens=min_tokens)
        own = select_groups(spec, q, keys, keys, held, 1.0)
        shared = select_groups(dataclasses.replace(spec, read_budget="shared"), q, keys, keys, held, 1.0,
                               streams_per_sequence=2)
        assert own.count.tolist() == [16] * 4
        assert shared.count.tolist() == [sharp, 32 - sharp, sharp, 32 - sharp]
        for stream in (0, 2):  # the sharp head still reads its four needles
            assert set(range(4)) <= set(shared.groups[stream, :sharp].tolist())


def test_a_shared_read_budget_reads_the_same_fraction_and_decodes_batches_like_alone():
    model = tiny_model("llama", kv_heads=2)
    ids = torch.randint(3, 128, (2, 90), generator=torch.Generator().manual_seed(21))
    recipe = estimating(unread="estimate_blocks")
    recipe = dataclasses.replace(recipe, sparse_attention=dataclasses.replace(recipe.sparse_attention,
                                                                              read_budget="shared"))
    reads, logits = {}, {}
    for label, r in (("per_head", estimating(unread="estimate_blocks")), ("shared", recipe)):
        cache = CompressedRuntime.from_recipe(model, r).new_cache()
        logits[label] = run_tokens(model, cache, ids, prefill=60)
        report = cache.memory_report()
        reads[label] = report["sparse_read_fraction"]
        assert report["cache_bytes"] == report["expected_cache_bytes"]
    assert reads["shared"] == reads["per_head"] <= 0.25
    assert not torch.allclose(logits["shared"][:, 61:], logits["per_head"][:, 61:])  # the heads' reads moved
    decode_batch_like_alone(model, CompressedRuntime.from_recipe(model, recipe), seed=9)


def test_token_sums_are_exact_after_prefill_decoding_eviction_and_batch_selection():
    model = tiny_model("llama")
    cache = CompressedRuntime.from_recipe(model, estimating()).new_cache()
    ids = torch.randint(3, 128, (3, 80), generator=torch.Generator().manual_seed(11))
    run_tokens(model, cache, ids[:, :50], prefill=40)  # prefill evicts, then 10 decode steps add one value each
    check_token_sums(cache)
    with torch.no_grad():
        model(ids[:, 50:62], **with_cache(cache))  # a second chat turn evicts again (holes refilled)
    check_token_sums(cache)
    run_tokens(model, cache, ids[:, 62:70], prefill=1)
    check_token_sums(cache)
    cache.batch_select_indices(torch.tensor([2, 0]))
    check_token_sums(cache)
    run_tokens(model, cache, ids[[2, 0], 70:80], prefill=1)
    check_token_sums(cache)


@pytest.mark.parametrize("unread", ["estimate", "estimate_blocks"])
def test_an_estimate_with_nothing_unread_reproduces_the_model_exactly(unread):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        reference = model(ids).logits
    recipe = sparse(uncompressed_recipe("model"), read_fraction=1.0, summary_tokens=1, unread=unread)
    cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
    torch.testing.assert_close(run_tokens(model, cache, ids, prefill=20), reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("unread", ["estimate", "estimate_blocks"])
def test_the_estimate_attends_closer_to_the_kept_cache_than_dropping_the_unread(unread):
    """Reading a quarter: with the unread tokens' estimated mass and mean value the decoded logits are nearer those
    of stage 1 alone (every kept token read) than with the unread tokens left out, and the same tokens are read."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 140), generator=torch.Generator().manual_seed(13))
    logits, reads = {}, {}
    for label, recipe in (("stage1", evicting("rocketkv", budget=0.5, float_dtype="float16")),
                          ("drop", sparse(evicting("rocketkv", budget=0.5, float_dtype="float16"), summary_tokens=1,
                                          read_fraction=0.25)),
                          ("estimate", estimating(unread=unread))):
        cache = CompressedRuntime.from_recipe(model, recipe).new_cache()
        logits[label] = run_tokens(model, cache, ids, prefill=100)[:, 101:]
        reads[label] = cache.memory_report().get("sparse_read_fraction")
    error = {label: (logits[label] - logits["stage1"]).norm() for label in ("drop", "estimate")}
    assert error["estimate"] < 0.7 * error["drop"], error
    assert reads["drop"] == reads["estimate"] <= 0.25


def test_token_sums_are_counted_in_the_bytes_and_match_the_walk():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 50), generator=torch.Generator().manual_seed(14))
    recipe = sparse(evicting("rocketkv", budget=0.5, float_dtype="float16"), summary_tokens=1, read_fraction=0.25)
    plain = CompressedRuntime.from_recipe(model, recipe).new_cache()
    cache = CompressedRuntime.from_recipe(model, estimating()).new_cache()
    run_tokens(model, plain, ids, prefill=40)
    run_tokens(model, cache, ids, prefill=40)
    blocks = sum(int(layer.store.float_blocks().sum()) for layer in cache.layers)
    report = cache.memory_report()
    assert report["token_sum_bytes"] == blocks * 2 * 32 * 2  # a key and a value fp16 sum of head_dim 32 per float block
    assert cache.nbytes() - plain.nbytes() == report["token_sum_bytes"] and report["key_summary_bytes"] == 0
    assert cache.nbytes() == cache.expected_nbytes() and walked_nbytes(cache) >= cache.reserved_nbytes() >= cache.nbytes()
    assert "token_sum_bytes" not in plain.memory_report()


@pytest.mark.parametrize("unread", ["estimate", "estimate_blocks"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss", "gemma2"])
def test_the_estimate_decodes_every_feature_and_refuses_soft_capping(family, unread):
    """Sliding windows (Gemma 3) read whole, learned sinks (GPT-OSS) stay their own softmax term; Gemma 2's
    soft-capped logits cannot be estimated: a clear error with the fix."""
    model = featured_model(family)
    cache = CompressedRuntime.from_recipe(model, estimating(unread=unread)).new_cache()
    ids = torch.randint(3, 100, (2, 60), generator=torch.Generator().manual_seed(15))
    if family == "gemma2":
        with pytest.raises(RuntimeConfigError, match="soft-capped.*unread: drop"):
            _generate(model, cache, ids, torch.ones_like(ids), new_tokens=4)
        return
    _generate(model, cache, ids, torch.ones_like(ids), new_tokens=12)
    report = cache.memory_report()
    assert report["cache_bytes"] == report["expected_cache_bytes"] and report["sparse_read_fraction"] < 1.0


# --- channel_score: query_key -----------------------------------------------------------------------
def test_channels_ranked_by_query_and_key_spread_skip_channels_whose_keys_hardly_vary():
    """The query is largest on channels 0-3, but the keys hardly vary there (a large constant offset, as outlier
    channels have): ``query`` scores channels 0-3, ``query_key`` (|q| x the keys' standard deviation) channels 4-7,
    which decide which token the logits prefer."""
    gen = torch.Generator().manual_seed(17)
    d, n = 8, 20
    q = torch.cat([torch.full((1, 1, 1, 4), 3.0), torch.full((1, 1, 1, 4), 1.0)], dim=-1)  # (S, g, R, D)
    keys = torch.randn(1, n, 1, d, generator=gen)
    keys[..., :4] = 5.0 + 1e-3 * keys[..., :4]  # the same for every token: no say in the ranking
    _, _, by_query = partial_logits(q, keys, keys, channels=0.5)
    partial, _, by_both = partial_logits(q, keys, keys, channels=0.5, key_scale=keys.std(dim=1))
    assert by_query[0, 0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert by_both[0, 0, 0].nonzero().flatten().tolist() == [4, 5, 6, 7]
    torch.testing.assert_close(partial[0, 0, 0], keys[0, :, 0, 4:] @ q[0, 0, 0, 4:])  # q_hat . k_hat on 4-7


def test_a_query_key_channel_score_keeps_key_sums_and_reads_a_quarter():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 90), generator=torch.Generator().manual_seed(18))
    base = evicting("rocketkv", budget=0.5, float_dtype="float16")
    caches = {}
    for score in ("query", "query_key"):
        recipe = sparse(base, summary_tokens=1, read_fraction=0.25, channel_score=score)
        caches[score] = CompressedRuntime.from_recipe(model, recipe).new_cache()
        run_tokens(model, caches[score], ids, prefill=60)
    report = caches["query_key"].memory_report()
    assert "token_sum_bytes" in report and "token_sum_bytes" not in caches["query"].memory_report()
    assert 0.2 <= report["sparse_read_fraction"] <= 0.25 and report["cache_bytes"] == report["expected_cache_bytes"]
    check_token_sums(caches["query_key"])
