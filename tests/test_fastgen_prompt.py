"""FastGen choosing each (sequence, KV head)'s policy from the prompt's own attention (``profile_source: prompt``).

* the choice equals a brute-force reference: on hand-made attention, and end to end on a tiny GQA
  model against its eager attention (the last ``window`` queries, the group's query heads summed);
* different prompts in one batch get different policies (a fixed map cannot pass);
* a left-padded batch decodes and keeps what each sequence does alone;
* the bytes held are the kept tokens' blocks plus one int64 per stream, and fewer than a full cache's;
* T = 1 keeps everything and generates what transformers does; T < 1 really evicts;
* a second multi-token forward re-chooses and never re-admits an evicted token (a sequence that
  is only padding in it keeps its choice); beam search carries each stream's choice;
* on a sliding-window layer it also frees what the window hides;
* bad values and a missing tokenizer give clear errors.
"""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from kvtool.errors import RecipeError
from kvtool.methods.evict.base import StreamView
from kvtool.methods.evict.fastgen import (
    FASTGEN_POLICIES, FULL, LOCAL, PUNCTUATION, FastGen, choose_from_prompt, fastgen_keep, kept_sets,
)
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import EvictionSpec, load_recipe, recipe_from_dict
from kvtool.runtime.attach import CompressedRuntime, uncompressed_recipe
from kvtool.runtime.store import FLOAT_BLOCK
from tests.test_eviction_runtime import held, left_padded_pair
from tests.tiny_models import WINDOW, featured_model, tiny_model

CLASSES = {"tokens.special": torch.tensor([1]), "tokens.punctuation": torch.tensor([5, 6, 7])}
R_L, R_F = 0.3, 0.3


def per_prompt(threshold: float, float_dtype: str = "model", **eviction):
    spec = EvictionSpec(policy="fastgen", profile_source="prompt", threshold=threshold,
                        **{"sink_tokens": 1, "window": 8, **eviction})
    return dataclasses.replace(uncompressed_recipe(float_dtype), name="fastgen-prompt-test", eviction=spec)


def runtime(model, threshold: float, **kwargs):
    return CompressedRuntime.from_recipe(model, per_prompt(threshold, **kwargs), profile=CLASSES)


def greedy(model, cache, ids: torch.Tensor, new_tokens: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **with_cache(cache), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def reference_choice(window: torch.Tensor, accumulated: torch.Tensor, is_special, is_punct, threshold: float) -> int:
    """Brute force for one stream of n tokens (positions 0..n-1): each policy's kept set by `fastgen_keep`, in order."""
    for policy in range(len(FASTGEN_POLICIES)):
        kept = fastgen_keep(policy, is_special, is_punct, accumulated, R_L, R_F)
        if policy == FULL or float(window[kept].sum() / window.sum()) >= threshold:
            return policy
    raise AssertionError("full always qualifies")


def hand_made_view(lengths: list[int], width: int, seed: int) -> StreamView:
    """Streams holding positions 0..n-1 (then empty slots), random attention peaked on a few tokens."""
    gen = torch.Generator().manual_seed(seed)
    s = len(lengths)
    valid = torch.arange(width)[None] < torch.tensor(lengths)[:, None]  # (S, N)
    attention = torch.rand(s, width, generator=gen) ** 4 * 10  # (S, N) heavy-tailed
    return StreamView(
        positions=torch.arange(width).expand(s, -1).clone(), valid=valid, length=torch.tensor(lengths),
        attention=attention.masked_fill(~valid, 0.0),
        window_attention=(torch.rand(s, width, generator=gen) ** 6).masked_fill(~valid, 0.0),
        feature=None, is_special=(torch.arange(width) < 2).expand(s, -1) | (torch.rand(s, width, generator=gen) < 0.05),
        is_punct=torch.rand(s, width, generator=gen) < 0.15, units=torch.arange(width).expand(s, -1),
        unit_count=width, layer=0, heads=torch.arange(s) % 2,
    )


def test_the_choice_equals_a_brute_force_reference_on_hand_made_attention():
    lengths = [40, 33, 17, 40, 25, 8]
    seen = set()
    for seed, threshold in enumerate([0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99]):
        view = hand_made_view(lengths, 40, seed)
        kept = kept_sets(view, R_L, R_F)  # (S, 5, N)
        chosen = choose_from_prompt(view.window_attention, kept, view.valid, threshold)
        expected = []
        for s, n in enumerate(lengths):
            for policy in range(len(FASTGEN_POLICIES)):  # the batched kept sets are the reference's
                reference = fastgen_keep(policy, view.is_special[s, :n], view.is_punct[s, :n], view.attention[s, :n], R_L, R_F)
                assert torch.equal(kept[s, policy, :n], reference) and not kept[s, policy, n:].any()
            expected.append(reference_choice(view.window_attention[s, :n], view.attention[s, :n], view.is_special[s, :n],
                                             view.is_punct[s, :n], threshold))
        assert chosen.tolist() == expected, threshold
        seen |= set(expected)
    assert len(seen) >= 4, seen  # the grid exercises the policies, not only `full`


def test_the_runtime_chooses_what_the_models_own_attention_says():
    """End to end on a GQA model (4 query heads, 2 KV heads): the reference reads transformers' eager attention."""
    model = tiny_model("llama")
    eager = tiny_model("llama")
    eager.set_attn_implementation("eager")
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(8, 128, (2, 48), generator=gen)
    ids[:, 0] = 1
    ids[0, 1::3], ids[0, 2::3] = 5, 7  # punctuation: two tokens in three of the first prompt, a few in the second
    ids[1, torch.randint(1, 48, (4,), generator=gen)] = 6
    threshold, window = 0.5, 8
    cache = runtime(model, threshold).new_cache()
    with torch.no_grad():
        model(ids, **with_cache(cache))
        attentions = eager(ids, output_attentions=True).attentions  # per layer (B, H_q, T, T)
    is_special, is_punct = ids == 1, ids == 5
    is_special[:, 0] = True  # the sink
    is_punct |= (ids == 6) | (ids == 7)
    choices = set()
    for layer, probs in enumerate(attentions):
        b, hq, t, _ = probs.shape
        group = probs.reshape(b, 2, hq // 2, t, t)  # (B, H_kv, G, T, T): the query heads of each KV head
        window_sum = group[:, :, :, -window:].sum(dim=(2, 3))  # (B, H_kv, T)
        accumulated = group.sum(dim=(2, 3))  # (B, H_kv, T)
        expected = [reference_choice(window_sum[i, h], accumulated[i, h], is_special[i], is_punct[i], threshold)
                    for i in range(b) for h in range(2)]
        assert cache.layers[layer].stream_state.tolist() == expected, layer
        choices |= set(expected)
    assert len(choices) > 1, choices  # several policies, not all full


def mostly_punctuation(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 8, (1, n), generator=gen)  # the punctuation ids
    ids[0, torch.randint(0, n, (n // 10,), generator=gen)] = torch.randint(8, 128, (n // 10,), generator=gen)
    return ids


def test_each_sequence_of_a_batch_gets_its_own_policies():
    model = tiny_model("llama")
    plain = torch.randint(8, 128, (1, 60), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([mostly_punctuation(60, 4), plain])  # (2, 60)
    cache = runtime(model, 0.8).new_cache()
    with torch.no_grad():
        model(ids, **with_cache(cache))
    for layer in cache.layers:
        punct_seq, plain_seq = layer.stream_state.reshape(2, -1).tolist()  # (B, H_kv)
        assert max(punct_seq) <= PUNCTUATION and min(plain_seq) >= LOCAL, (punct_seq, plain_seq)
    tokens = cache.layers[0].store.tokens().reshape(2, -1)
    assert (tokens[0] < tokens[1]).all()


@pytest.mark.parametrize("window", [8, 40])  # 40: padding rows of the short prompt (33 tokens) fall in the window
def test_a_left_padded_batch_keeps_and_generates_what_each_sequence_does_alone(window):
    model = tiny_model("llama")
    rt = runtime(model, 0.6, window=window)
    long, short, ids, mask = left_padded_pair(seed=2)
    ids[1, 15 + 5 : 15 + 20] = 6  # the short prompt has a run of punctuation: the two choose differently
    short = ids[1:, 15:]

    together_cache = rt.new_cache()
    together = greedy(model, together_cache, ids, 12, mask)
    alone_caches = [rt.new_cache(), rt.new_cache()]
    alone = [greedy(model, c, x, 12, torch.ones_like(x)) for c, x in zip(alone_caches, (long, short))]
    assert torch.equal(together[0, 48:], alone[0][0, 48:]) and torch.equal(together[1, 48:], alone[1][0, 33:])
    for index, layer in enumerate(together_cache.layers):
        states = [c.layers[index].stream_state.tolist() for c in alone_caches]
        assert layer.stream_state.tolist() == states[0] + states[1]
        assert held(layer) == held(alone_caches[0].layers[index]) + held(alone_caches[1].layers[index])
    assert together_cache.kept_fraction() < 0.9


def test_bytes_held_are_the_kept_tokens_and_fewer_than_the_full_cache():
    model = tiny_model("llama")
    ids = torch.randint(8, 128, (2, 64), generator=torch.Generator().manual_seed(9))
    sizes = {}
    for threshold in (1.0, 0.6):
        cache = runtime(model, threshold, float_dtype="float16").new_cache()
        greedy(model, cache, ids, 6)
        per_token = 2 * 32 * 2 + 4 + 4 + 1  # K + V fp16, position, accumulated attention, token class
        blocks, metadata = 0, 0
        for layer in cache.layers:
            tokens = layer.store.tokens()
            blocks += int(((tokens + FLOAT_BLOCK - 1) // FLOAT_BLOCK).sum())
            metadata += layer.store.metadata_nbytes() + 8 * 2 + 8 * 4 + 8 * 4  # lengths, group of stream, chosen policy
            assert tokens.tolist() == [len(h) for h in held(layer)]
        assert cache.nbytes() == cache.expected_nbytes() == blocks * FLOAT_BLOCK * per_token + metadata
        sizes[threshold] = cache.nbytes()
    assert sizes[0.6] < 0.8 * sizes[1.0]


def test_at_threshold_one_it_generates_what_transformers_does_and_below_it_evicts():
    model = tiny_model("llama")
    ids = torch.randint(8, 128, (2, 40), generator=torch.Generator().manual_seed(4))
    reference = greedy(model, DynamicCache(config=model.config), ids, 16)
    full = runtime(model, 1.0).new_cache()
    assert torch.equal(greedy(model, full, ids, 16), reference)
    assert full.kept_fraction() == 1.0
    assert all(set(layer.stream_state.tolist()) == {FULL} for layer in full.layers)
    evicting = runtime(model, 0.5).new_cache()
    greedy(model, evicting, ids, 16)
    assert evicting.kept_fraction() < 0.75  # compression is on below T = 1
    assert all(max(layer.stream_state.tolist()) < FULL for layer in evicting.layers)


def test_a_second_prompt_chunk_rechooses_and_never_readmits_evicted_tokens():
    model = tiny_model("llama")
    first = torch.randint(8, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    second = mostly_punctuation(200, seed=7)
    cache = runtime(model, 0.65).new_cache()
    with torch.no_grad():
        model(first, **with_cache(cache))
        before = [layer.stream_state.clone() for layer in cache.layers]
        held_before = [held(layer) for layer in cache.layers]
        model(second, **with_cache(cache))
    for layer, chosen, kept in zip(cache.layers, before, held_before):
        assert chosen.min() >= LOCAL and layer.stream_state.max() <= PUNCTUATION  # re-chosen from the new chunk
        for stream, positions in enumerate(held(layer)):
            old = {p for p in positions if p < 40}
            assert old <= set(kept[stream])  # nothing evicted comes back
    assert cache.layers[0].lengths.tolist() == [240]


def test_bad_values_and_a_missing_tokenizer_give_clear_errors():
    with pytest.raises(RecipeError, match=r"eviction.profile_source.*'calibration' is not one of \['offline', 'prompt'\]"):
        EvictionSpec(policy="fastgen", profile_source="calibration")
    with pytest.raises(RecipeError, match="profile_source.*policy is 'h2o'.*set policy: fastgen"):
        EvictionSpec(policy="h2o", profile_source="prompt")
    with pytest.raises(RecipeError, match="needs the tokenizer's special and punctuation token ids"):
        CompressedRuntime.from_recipe(tiny_model("llama"), per_prompt(0.9))
    with pytest.raises(RecipeError, match="needs a profile"):  # the offline mode still needs its profile
        CompressedRuntime.from_recipe(tiny_model("llama"), dataclasses.replace(per_prompt(0.9), eviction=EvictionSpec(policy="fastgen")))


def test_the_bundled_recipe_needs_no_profile_and_round_trips():
    recipe = load_recipe("fastgen-prompt-t95")
    assert recipe.eviction.fastgen_per_prompt and not recipe.eviction.needs_profile
    assert (recipe.eviction.threshold, recipe.eviction.local_ratio, recipe.eviction.frequent_ratio) == (0.95, 0.3, 0.3)
    assert recipe_from_dict(recipe.to_dict()) == recipe
    assert not load_recipe("fastgen-t95").eviction.fastgen_per_prompt


def test_beam_search_carries_each_streams_choice():
    model = tiny_model("llama")
    ids = torch.cat([mostly_punctuation(40, 8), torch.randint(8, 128, (1, 40), generator=torch.Generator().manual_seed(8))])
    cache = runtime(model, 0.8).new_cache()
    with torch.no_grad():
        model.generate(input_ids=ids, **with_cache(cache), max_new_tokens=4, num_beams=2, do_sample=False, pad_token_id=0)
    for layer in cache.layers:  # (B x beams x H_kv,): each beam keeps its sequence's choice
        punct_beams, plain_beams = layer.stream_state.reshape(2, 2, -1)
        assert punct_beams.max() <= PUNCTUATION < LOCAL <= plain_beams.min()


def test_on_a_sliding_window_layer_it_also_frees_what_the_window_hides():
    """Gemma 3 (layer 0 slides over 16 tokens, layer 1 is global): at T = 1 everything visible stays, nothing else."""
    model = featured_model("gemma3_text")
    ids = torch.randint(8, 128, (1, 40), generator=torch.Generator().manual_seed(12))
    cache = runtime(model, 1.0).new_cache()
    assert torch.equal(greedy(model, cache, ids, 8), greedy(model, DynamicCache(config=model.config), ids, 8))
    sliding, full = (held(layer)[0] for layer in cache.layers)
    assert sliding == list(range(47 - WINDOW, 47)) and full == list(range(47))  # the last token generated is not fed


@pytest.mark.slow
def test_kvtool_load_takes_the_token_classes_from_the_models_tokenizer(smollm2):
    import kvtool

    model, tokenizer = smollm2
    cache = kvtool.load(model, "fastgen-prompt-t95").new_cache()
    ids = tokenizer("The pass key is 41235. Remember it, and then, later, say it back. " * 12, return_tensors="pt").input_ids
    with torch.no_grad():
        model(ids, **with_cache(cache))
    assert set(cache.context.punct_ids.tolist()) >= set(tokenizer.convert_tokens_to_ids([".", ","]))
    assert cache.kept_fraction() < 0.9


def test_a_stream_whose_sequence_is_only_padding_in_a_later_forward_keeps_its_choice():
    view = hand_made_view([40, 40], 40, seed=3)
    view.window_attention[1] = 0.0  # the second sequence had only padding in this forward
    view.stream_state = torch.tensor([LOCAL, LOCAL])
    policy = FastGen(per_prompt(0.5).eviction)
    keep = policy.keep(view, torch.tensor([40, 40]))
    expected = choose_from_prompt(view.window_attention[:1], kept_sets(view, R_L, R_F)[:1], view.valid[:1], 0.5)
    assert view.stream_state.tolist() == [int(expected), LOCAL]
    assert torch.equal(keep[1], kept_sets(view, R_L, R_F)[1, LOCAL])
