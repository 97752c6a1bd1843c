"""The evicting cache on tiny random models: real freeing, ragged streams, batches, RoPE after eviction.

* keeping everything (budget 1.0) reproduces the model's own logits for every policy and family;
* a batch of two sequences keeps different tokens per sequence and generates what each does alone;
* the bytes held equal the analytic size of the kept tokens, and fall with the budget;
* decoding past an absolute budget keeps memory flat;
* after eviction, attention equals full attention restricted (by a mask, in the test only) to the kept
  tokens at their original positions: RoPE stays right;
* kept tokens are quantized when the recipe quantizes (composition).
"""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from kvtool.errors import RecipeError
from kvtool.methods.evict.base import registered_policies
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import CacheSpec, EvictionSpec, QuantSpec, Recipe
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe
from kvtool.runtime.store import FLOAT_BLOCK
from tests.tiny_models import FAMILIES, tiny_model, tiny_tokenizer_free_inputs

BUDGET_POLICIES = [p for p in registered_policies() if p != "fastgen"]
PROMPT_ONLY = ("rocketkv",)  # cut the prompt once, keep every generated token (tested in test_rocketkv.py)
TINY_PROFILE = {  # a FastGen profile for the tiny 2-layer, 2-KV-head models: one head per policy kind
    "heads.policy": torch.tensor([[0, 2], [3, 4]]),
    "tokens.special": torch.tensor([1]),
    "tokens.punctuation": torch.tensor([5, 6, 7]),
}


def evicting(policy: str, *, bits: int = 16, float_dtype: str = "model", **eviction) -> Recipe:
    base = uncompressed_recipe(float_dtype)
    if bits != 16:
        base = Recipe(
            name="q",
            keys=QuantSpec(method="uniform", bits=bits, axis="channel", path="keys"),
            values=QuantSpec(method="uniform", bits=bits, axis="token", path="values"),
            cache=CacheSpec(sink_tokens=2, recent_tokens=8, float_dtype=float_dtype),
        )
    spec = EvictionSpec(policy=policy, **{"sink_tokens": 2, "window": 4, "interval": 1, **eviction})  # per-step eviction
    return dataclasses.replace(base, name=f"{policy}-test", eviction=spec)


def held(layer):
    """Per stream (sequence-major), the positions it holds, in the order it holds them."""
    _, _, positions, valid = layer.decoded()
    return [[int(p) for p, v in zip(row_p, row_v) if v] for seq_p, seq_v in zip(positions, valid) for row_p, row_v in zip(seq_p, seq_v)]


def held_scores(layer):
    """Per stream, the accumulated attention of the tokens it holds (float slots only)."""
    store = layer.store
    ids = store.float_block_ids(0, int(store.float_blocks().max()))
    scores = store.read_blocks(store.float_pool, ("score",), ids)["score"]
    return [scores[s, : int(store.float_len[s])] for s in range(store.streams)]


def runtime(model, recipe):
    profile = TINY_PROFILE if recipe.eviction.policy == "fastgen" else None
    return CompressedRuntime.from_recipe(model, recipe, profile=profile)


def run_tokens(model, cache, ids, prefill):
    """Prefill, then feed the rest one token at a time; logits (B, T, V) of every position."""
    with torch.no_grad():
        out = [model(ids[:, :prefill], **with_cache(cache)).logits]
        for i in range(prefill, ids.shape[1]):
            out.append(model(ids[:, i : i + 1], **with_cache(cache)).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", BUDGET_POLICIES)
def test_keeping_everything_reproduces_the_model(family, policy):
    model = tiny_model(family)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids).logits
    cache = runtime(model, evicting(policy, budget=1.0)).new_cache()
    logits = run_tokens(model, cache, ids, prefill=16)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-4)
    assert cache.kept_fraction() == 1.0


def _generate(model, cache, ids, mask, new_tokens=30):
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=mask, **with_cache(cache), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )


def left_padded_pair(seed: int):
    """(long (1, 48), short (1, 33), the two as one left-padded batch (2, 48), its attention mask)."""
    gen = torch.Generator().manual_seed(seed)
    long, short = torch.randint(3, 128, (1, 48), generator=gen), torch.randint(3, 128, (1, 33), generator=gen)
    ids = torch.zeros(2, 48, dtype=torch.long)
    ids[0], ids[1, 15:] = long[0], short[0]
    mask = torch.ones_like(ids)
    mask[1, :15] = 0
    return long, short, ids, mask


def decode_batch_like_alone(model, rt, seed: int, new_tokens: int = 30):
    """Greedy-decode a left-padded pair as one batch and each sequence alone; assert the same new tokens.

    Returns the batch's cache."""
    long, short, ids, mask = left_padded_pair(seed)
    batch_cache = rt.new_cache()
    together = _generate(model, batch_cache, ids, mask, new_tokens=new_tokens)
    alone = [_generate(model, rt.new_cache(), x, torch.ones_like(x), new_tokens=new_tokens) for x in (long, short)]
    assert torch.equal(together[0, 48:], alone[0][0, 48:])
    assert torch.equal(together[1, 48:], alone[1][0, 33:])
    return batch_cache


@pytest.mark.parametrize("bits", [16, 4])
@pytest.mark.parametrize("policy", registered_policies())
def test_batch_equals_each_sequence_alone(policy, bits):
    model = tiny_model("llama")
    batch_cache = decode_batch_like_alone(model, runtime(model, evicting(policy, bits=bits, budget=0.5)), seed=2)
    # the two sequences keep different numbers of tokens: storage is ragged, nothing is padded
    layer = batch_cache.layers[0]
    assert layer.lengths.tolist() == [48 + 29, 33 + 29]
    report = batch_cache.memory_report()
    assert report["cache_bytes"] == report["expected_cache_bytes"]
    if policy in PROMPT_ONLY:  # half of each prompt (48, 33 tokens) and every generated token
        assert report["kept_tokens"] == 2 * 2 * (24 + 29 + 17 + 29)  # x 2 layers x 2 KV heads
    elif policy != "fastgen":
        assert 0.4 < report["kept_fraction"] <= 0.55


@pytest.mark.parametrize("policy", ["h2o", "streamingllm", "snapkv", "tova"])
def test_an_eviction_interval_evicts_once_per_interval_and_keeps_batches_exact(policy):
    """interval 8: a stream grows to budget + 7 tokens, then is cut back to its budget; each stream of a
    batch is cut when it is due (so a batch decodes exactly as its sequences alone), and the cache really
    holds the tokens it reports (bytes = the kept tokens' blocks) at every step."""
    model = tiny_model("llama")
    rt = runtime(model, evicting(policy, budget_tokens=20, interval=8))
    decode_batch_like_alone(model, rt, seed=3, new_tokens=40)
    long, short, _, _ = left_padded_pair(3)
    cache = rt.new_cache()
    held = []
    with torch.no_grad():
        model(long, **with_cache(cache))
        assert set(cache.layers[0].store.tokens().tolist()) == {20}  # prefill: down to the budget
        token = long[:, -1:]
        for _ in range(24):
            token = model(token, **with_cache(cache)).logits[:, -1:].argmax(-1)
            held.append(int(cache.layers[0].store.tokens().max()))
            assert cache.nbytes() == cache.expected_nbytes()
    assert max(held) == 27 and min(held) == 20, held  # at most budget + interval - 1, then back to the budget
    assert held[:8] == list(range(21, 28)) + [20]
    with torch.no_grad():  # a multi-token forward between decode steps (a new chat turn): down to the budget again
        model(short[:, :5], **with_cache(cache))
        assert set(cache.layers[0].store.tokens().tolist()) == {20}
        for step in range(10):
            token = model(token, **with_cache(cache)).logits[:, -1:].argmax(-1)
            assert int(cache.layers[0].store.tokens().max()) == (21 + step if step < 7 else 20 + step - 7)


def test_a_kept_fraction_is_checked_once_per_cut_and_cuts_exactly_when_due(monkeypatch):
    """50% kept, interval 8: the budget grows half a token per step, so a stream cut to its budget is due
    again about 2 x 8 steps later; the runtime skips the budget check until then (`quiet_steps`), yet cuts at
    the very step a stream first holds more than budget + 7 tokens (checked against a step-by-step
    simulation), and asks the budget rule at most three times per cut (the cut, the step after it, one step of margin)."""
    from kvtool.methods.evict.base import ratio_budget
    from kvtool.runtime.eviction import BudgetRule

    model = tiny_model("llama")
    rt = runtime(model, evicting("h2o", budget=0.5, interval=8))
    asked = {"layer 0": 0}
    original = BudgetRule.__call__

    def counted(self, layer, length):
        asked["layer 0"] += layer == 0
        return original(self, layer, length)

    monkeypatch.setattr(BudgetRule, "__call__", counted)
    ids, _ = tiny_tokenizer_free_inputs(batch=1, seq=40)
    cache = rt.new_cache()
    held, expected = [], []
    with torch.no_grad():
        token = model(ids, **with_cache(cache)).logits[:, -1:].argmax(-1)
        length, tokens = 40, int(cache.layers[0].store.tokens().max())
        asked["layer 0"] = 0
        for _ in range(96):
            token = model(token, **with_cache(cache)).logits[:, -1:].argmax(-1)
            length, tokens = length + 1, tokens + 1
            budget = int(ratio_budget(0.5, torch.tensor(length)))
            tokens = budget if tokens > budget + 7 else tokens
            expected.append(tokens)
            held.append(int(cache.layers[0].store.tokens().max()))
    assert held == expected
    cuts = sum(1 for a, b in zip(held, held[1:]) if b < a)
    assert cuts >= 5 and asked["layer 0"] <= 3 * cuts + 2, (cuts, asked)


@pytest.mark.parametrize("growth", [0.0, 0.1, 0.25, 1 / 3, 0.5, 0.75, 0.9, 1.0])
def test_quiet_steps_never_pass_the_first_step_that_may_be_due(growth):
    """quiet_steps(room, g): every step it allows keeps k - floor(g k) <= room (never late); at most one step
    short of the exact count (the float-rounding margin)."""
    import math

    from kvtool.runtime.eviction import quiet_steps

    for room in (-3, 0, 1, 5, 15, 100):
        exact = 0
        while exact < 4096 and (exact + 1) - math.floor(growth * (exact + 1)) <= room:
            exact += 1
        assert exact - 1 <= quiet_steps(room, growth) <= exact, (room, growth)


@pytest.mark.parametrize("policy", registered_policies())
def test_bytes_held_match_the_kept_tokens(policy):
    model = tiny_model("llama")
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=40)
    sizes, kept = {}, {}
    for budget in (1.0, 0.5, 0.25):
        cache = runtime(model, evicting(policy, budget=budget, float_dtype="float16")).new_cache()
        _generate(model, cache, ids, mask, new_tokens=10)
        total = cache.nbytes()
        assert total == cache.expected_nbytes()
        per_token = 2 * 32 * 2 + 4 + (4 if cache.policy.uses_attention else 0) + (4 if cache.policy.uses_feature else 0)
        per_token += 1 if policy == "fastgen" else 0
        blocks, metadata = 0, 0
        for layer in cache.layers:
            tokens = layer.store.tokens()  # every stream holds exactly its own tokens, in whole float blocks
            blocks += int(((tokens + FLOAT_BLOCK - 1) // FLOAT_BLOCK).sum())
            metadata += layer.store.metadata_nbytes() + 8 * 2 + 8 * 4
            assert tokens.tolist() == [len(h) for h in held(layer)]
        assert total == blocks * FLOAT_BLOCK * per_token + metadata  # K + V fp16, per-token metadata, tables: nothing else
        assert total - metadata < (cache.kept_tokens() + FLOAT_BLOCK * 8) * per_token  # < one block per stream unused
        sizes[budget] = total
        kept[budget] = cache.kept_tokens()
    if policy in PROMPT_ONLY:  # the budget cuts the prompt only: 10 / 20 / 40 prompt tokens + 10 generated, 2-3 blocks
        assert kept[0.25] < kept[0.5] < kept[1.0] and sizes[0.25] <= sizes[0.5] < sizes[1.0]
    elif policy != "fastgen":  # fastgen ignores the budget: its profile sets the sizes
        assert sizes[0.25] < sizes[0.5] < sizes[1.0]


@pytest.mark.parametrize("policy", [p for p in BUDGET_POLICIES if p not in PROMPT_ONLY])
def test_decoding_past_an_absolute_budget_keeps_memory_flat(policy):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = runtime(model, evicting(policy, budget_tokens=16)).new_cache()
    held = []
    with torch.no_grad():
        model(ids, **with_cache(cache))
        token = ids[:, -1:]
        for _ in range(40):
            token = model(token, **with_cache(cache)).logits[:, -1:].argmax(-1)
            held.append(cache.nbytes())
    assert len(set(held)) == 1, "memory grew while decoding past the budget"
    assert all(layer.store.tokens().tolist() == [16, 16] for layer in cache.layers)
    assert cache.get_seq_length() == 60  # logical length keeps counting for positions


def test_attention_after_eviction_equals_masked_full_attention_at_original_positions():
    """StreamingLLM keeps sinks + recent tokens; the next token must see exactly them, at their old positions."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 41), generator=torch.Generator().manual_seed(4))
    cache = runtime(model, evicting("streamingllm", budget_tokens=12, sink_tokens=3)).new_cache()
    with torch.no_grad():
        model(ids[:, :40], **with_cache(cache))
        kept = held(cache.layers[0])[0]
        assert kept == [0, 1, 2] + list(range(31, 40))
        logits = model(ids[:, 40:], **with_cache(cache)).logits[:, -1]
        visible = torch.ones(41, 41, dtype=torch.bool).tril()
        visible[40] = False
        visible[40, kept + [40]] = True
        reference = model(ids, attention_mask=visible[None, None]).logits[:, -1]  # bool 4-D mask: True = attend
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-4)


def test_kept_tokens_are_quantized_when_the_recipe_quantizes():
    model = tiny_model("llama")
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=200)
    float_cache = runtime(model, evicting("h2o", budget=0.5, float_dtype="float16")).new_cache()
    quant_cache = runtime(model, evicting("h2o", bits=4, budget=0.5, float_dtype="float16")).new_cache()
    _generate(model, float_cache, ids, mask, new_tokens=20)
    out = _generate(model, quant_cache, ids, mask, new_tokens=20)
    assert out.shape == (2, 220)
    blocks = [int(layer.store.body_len.min()) for layer in quant_cache.layers]
    assert min(blocks) >= 1, "kept tokens were not encoded into 4-bit blocks"
    assert quant_cache.nbytes() == quant_cache.expected_nbytes()
    assert quant_cache.nbytes() < 0.7 * float_cache.nbytes()
    assert abs(quant_cache.kept_fraction() - float_cache.kept_fraction()) < 0.15


def test_pre_rope_quantized_keys_compose_with_eviction():
    model = tiny_model("llama")
    recipe = evicting("snapkv", bits=8, budget=0.5)
    recipe = dataclasses.replace(recipe, keys=dataclasses.replace(recipe.keys, pre_rope=True))
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=70)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits[:, -1]
        cache = CompressedRuntime.from_recipe(model, dataclasses.replace(recipe, eviction=EvictionSpec(budget=1.0))).new_cache()
        kept_all = model(ids, attention_mask=mask, **with_cache(cache)).logits[:, -1]
    torch.testing.assert_close(kept_all, full, atol=1e-4, rtol=1e-3)
    out = _generate(model, runtime(model, recipe).new_cache(), ids, mask, new_tokens=10)
    assert out.shape == (2, 80)


def test_pre_rope_keys_encoded_while_decoding_an_evicting_cache_rotate_at_their_true_positions():
    """Decode steps that flush float tokens into pre-RoPE body blocks read their positions from the evicting
    store's per-slot ``pos``: with every token kept, 8-bit pre-RoPE keys follow the full-precision model
    step by step (a wrong position would rotate the re-rotated keys by the wrong angle)."""
    model = tiny_model("llama")
    recipe = evicting("snapkv", bits=8, budget=1.0)
    recipe = dataclasses.replace(recipe, keys=dataclasses.replace(recipe.keys, pre_rope=True))
    ids = torch.randint(3, 128, (2, 110), generator=torch.Generator().manual_seed(3))
    exact = run_tokens(model, DynamicCache(config=model.config), ids, prefill=40)
    cache = runtime(model, recipe).new_cache()
    logits = run_tokens(model, cache, ids, prefill=40)
    assert min(int(layer.store.body_len.min()) for layer in cache.layers) >= 3  # blocks encoded while decoding
    # measured: 7.5e-4 (8-bit keys); positions read as 0 at the flush: 3.6e-3 (logits of this model are below 0.7)
    assert float((logits - exact).abs().max()) < 1.5e-3


def test_beam_search_runs_with_eviction():
    model = tiny_model("llama")
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=20)
    cache = runtime(model, evicting("h2o", budget=0.5)).new_cache()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **with_cache(cache), max_new_tokens=8,
                             num_beams=2, do_sample=False, pad_token_id=0)
    assert out.shape[0] == 2
    assert cache.kept_fraction() < 0.7


def test_fastgen_heads_keep_what_their_policy_says():
    model = tiny_model("llama")
    ids = torch.randint(8, 128, (1, 50), generator=torch.Generator().manual_seed(5))
    ids[0, 0], ids[0, 10], ids[0, 20] = 1, 5, 6  # BOS and two punctuation tokens
    cache = runtime(model, evicting("fastgen", sink_tokens=1)).new_cache()
    with torch.no_grad():
        model(ids, **with_cache(cache))
    special, local = held(cache.layers[0])
    assert special == [0]  # special only: BOS
    assert local == [0, 10, 20] + list(range(35, 50))  # + punctuation + last ceil(0.3*50)
    frequent, full = held(cache.layers[1])
    assert len(full) == 50 and 18 < len(frequent) <= 33


def test_fastgen_without_a_profile_is_refused():
    with pytest.raises(RecipeError, match="needs a profile"):
        CompressedRuntime.from_recipe(tiny_model("llama"), evicting("fastgen"))
    with pytest.raises(RecipeError, match="heads.policy"):
        CompressedRuntime.from_recipe(tiny_model("llama"), evicting("fastgen"), profile={"heads.policy": torch.zeros(3, 2)})


def test_an_evicting_cache_on_a_model_without_kvtool_attention_fails_clearly_and_recovers():
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(7))
    cache = runtime(model, evicting("h2o", budget=0.5)).new_cache()
    other.set_attn_implementation("sdpa")
    with torch.no_grad(), pytest.raises(RuntimeError, match="did not run kvtool attention"):
        other(ids, **with_cache(cache))  # built for `model`, used with a model that never calls it back
    with torch.no_grad():
        model(ids, **with_cache(runtime(model, evicting("h2o", budget=0.5)).new_cache()))  # a stale claim does not linger


def test_layer_fractions_keep_the_uniform_mean_when_a_layer_is_capped():
    from kvtool.runtime.eviction import layer_fractions

    weights = torch.tensor([2.2, 1.2, 0.7, 0.7, 0.7, 0.5], dtype=torch.float64)  # mean 1.0
    fractions = layer_fractions(0.5, weights)
    assert float(fractions.max()) <= 1.0 and float(fractions[0]) == 1.0
    assert abs(float(fractions.mean()) - 0.5) < 1e-9
    assert bool((fractions[1:-1] >= fractions[2:]).all())  # order of the weights is kept
    torch.testing.assert_close(layer_fractions(0.25, torch.ones(4, dtype=torch.float64)), torch.full((4,), 0.25, dtype=torch.float64))


def test_attention_scores_accumulate_over_prefill_and_every_decoded_token():
    model = tiny_model("llama")  # 4 query heads on 2 KV heads: G = 2 query rows per query and KV head
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(8))
    cache = runtime(model, evicting("h2o", budget=1.0)).new_cache()
    run_tokens(model, cache, ids, prefill=20)
    for layer in cache.layers:
        for scores in held_scores(layer):
            # every query's attention sums to 1 per query head; nothing evicted, so nothing was lost
            assert abs(float(scores.sum()) - 2 * 30) < 1e-3
            assert float(scores[0]) > 0
