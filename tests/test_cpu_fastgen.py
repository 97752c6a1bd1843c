"""FastGen's decode steps on the CPU kernel: the kernel attends and writes the token, `cpu_fastgen` re-chooses the kept
set and compacts the float region; against the torch path (`FastGen.keep` over the whole view, then `fill_holes`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtool.methods.evict.base import StreamView
from kvtool.methods.evict.fastgen import FASTGEN_POLICIES, kept_sets
from kvtool.recipe import CacheSpec, EvictionSpec, QuantSpec, Recipe
from kvtool.runtime.kernels.cpu_fastgen import fastgen_decode_evict
from kvtool.runtime.layer import PUNCT, SPECIAL
from tests.test_cpu_decode import _assert_numba_matches_torch
from tests.tiny_models import featured_model, tiny_model

LOCAL_RATIO, FREQUENT_RATIO = 0.3, 0.3


def _fastgen(source: str, float_dtype: str = "float16") -> Recipe:
    return Recipe(
        name=f"fastgen-{source}", keys=QuantSpec(method="none", bits=16, path="keys"),
        values=QuantSpec(method="none", bits=16, axis="token", path="values"), cache=CacheSpec(float_dtype=float_dtype),
        eviction=EvictionSpec(policy="fastgen", threshold=0.9, sink_tokens=2, window=8, profile_source=source,
                              local_ratio=LOCAL_RATIO, frequent_ratio=FREQUENT_RATIO),
    )


def _fastgen_4bit(source: str, cache_sinks: int = 2, pre_rope: bool = False) -> Recipe:
    """FastGen over 4-bit KIVI blocks of 32 tokens (4 recent tokens in float16): body blocks are freed whole."""
    return Recipe(
        name=f"fastgen-4bit-{source}", keys=QuantSpec(bits=4, pre_rope=pre_rope, path="keys"),
        cache=CacheSpec(sink_tokens=cache_sinks, recent_tokens=4, block_size=32),
        eviction=EvictionSpec(policy="fastgen", threshold=0.9, sink_tokens=2, window=8, profile_source=source,
                              local_ratio=LOCAL_RATIO, frequent_ratio=FREQUENT_RATIO),
    )


def _profile(model, source: str) -> dict:
    """Token classes (ids 5 and 40 special, every seventh id punctuation) and, offline, every policy in turn over the
    (layer, KV head) pairs."""
    profile = {"tokens.special": torch.tensor([5, 40]), "tokens.punctuation": torch.arange(3, 128, 7)}
    if source == "offline":
        layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
        profile["heads.policy"] = (torch.arange(layers * heads) % len(FASTGEN_POLICIES)).reshape(layers, heads)
    return profile


@pytest.mark.parametrize("source", ["offline", "prompt"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_fastgen_decodes_on_the_kernel_as_the_torch_path(family, source):
    """Batch of two (row 1 left-padded), GQA 4:2, every FastGen policy (offline: one per (layer, head) in turn; per
    prompt: the prompt's choice), on a model with global layers and one with sliding-window layers (window 24 < the
    70-token prompt: the window rule frees with the policy): every decode step of every layer runs on the kernel
    (before, FastGen took the torch path at every step) and gives the torch backend's tokens, logits, bytes and held
    slots (keys, values, positions, scores, token classes)."""
    model = tiny_model("llama", kv_heads=2) if family == "llama" else featured_model(family, sliding_window=24, kv_heads=2)
    _assert_numba_matches_torch(model, _fastgen(source), 23, profile=_profile(model, source))


def test_fastgen_on_int8_float_slots_moves_the_scales_with_the_codes():
    """int8 float slots carry a scale per channel group beside their codes: compaction moves both."""
    model = tiny_model("llama", kv_heads=2)
    _assert_numba_matches_torch(model, _fastgen("offline", "int8"), 23, profile=_profile(model, "offline"))


QUANTIZED = [("llama", "offline", 2, False, 23), ("llama", "prompt", 2, False, 23), ("llama", "offline", 4, False, 23),
             ("llama", "offline", 2, True, 23), ("gemma3_text", "offline", 2, False, 23), ("gemma3_text", "prompt", 2, True, 23)]


@pytest.mark.parametrize("family,source,cache_sinks,pre_rope,steps", QUANTIZED,
                         ids=[f"{f}-{s}-sinks{n}" + ("-prerope" if r else "") for f, s, n, r, _ in QUANTIZED])
def test_fastgen_over_quantized_blocks_decodes_on_the_kernel_as_the_torch_path(family, source, cache_sinks, pre_rope, steps):
    """A quantized store: float slots leave one by one and body blocks whole (kept while half their tokens are), both
    regions keeping their order; the kernel runs every decode step but those that encode a block (every 32nd) or make
    a sink. Four store sinks where FastGen protects two (the other two can leave, and a stream left with sinks only
    makes its next token one, on the kernel too); keys before RoPE; sliding-window layers (whose rule frees the sinks
    as well, so a ``special`` head's stream empties and its next token is a sink). Same tokens, logits, bytes and
    slots as the torch backend."""
    model = tiny_model("llama", kv_heads=2) if family == "llama" else featured_model(family, sliding_window=24, kv_heads=2)
    _assert_numba_matches_torch(model, _fastgen_4bit(source, cache_sinks, pre_rope), steps, profile=_profile(model, source))


def _view(positions, valid, length, scores, classes) -> StreamView:
    s, n = positions.shape
    return StreamView(
        positions=positions, valid=valid, length=length, attention=scores, window_attention=None, feature=None,
        is_special=(classes & SPECIAL) > 0, is_punct=(classes & PUNCT) > 0, units=torch.arange(n).expand(s, n),
        unit_count=n, layer=0, heads=torch.zeros(s, dtype=torch.int64),
    )


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("policy", range(len(FASTGEN_POLICIES)))
def test_compiled_eviction_keeps_and_compacts_as_kept_sets_and_fill_holes(policy, window):
    """Streams of 1 to 40 held tokens in paged float blocks of 8 slots, their positions out of order with gaps (tokens
    evicted before), scores from four values (many ties: the older token wins), random classes; the new token's class
    is written by the call. The kept set is `kept_sets`'s (and the window rule's), and the kept slots end where
    `fill_holes` puts them: the freed slots below the new length take the kept slots past it, in order."""
    rng = np.random.default_rng(policy * 10 + window)
    fbs, streams, groups = 8, 6, 2
    held = np.array([40, 1, 17, 33, 8, 24], np.int64)
    blocks = -(-held // fbs)
    table = np.zeros((streams, int(blocks.max())), np.int32)
    ids = rng.permutation(int(blocks.sum())).astype(np.int32)  # paged: blocks anywhere in the pool
    start = 0
    for s in range(streams):
        table[s, : blocks[s]] = ids[start : start + blocks[s]]
        start += blocks[s]
    slots = int(blocks.sum()) * fbs
    pos = np.full(slots, -7, np.int32)
    score = rng.choice(np.array([0.0, 0.25, 0.5, 1.0], np.float32), slots)
    cls = rng.integers(0, 4, slots).astype(np.uint8)
    payload = rng.integers(0, 255, (slots, 6)).astype(np.uint8)  # stands in for keys and values
    lengths = np.array([60, 41, 35], np.int64)  # per sequence (two streams each)
    new_cls = np.array([[SPECIAL], [0], [PUNCT]], np.uint8)
    flat = lambda s, i: int(table[s, i // fbs]) * fbs + i % fbs  # noqa: E731
    for s in range(streams):
        chosen = np.sort(rng.choice(lengths[s // groups] - 1, held[s] - 1, replace=False))
        order = rng.permutation(held[s] - 1)
        for i in range(held[s] - 1):
            pos[flat(s, i)] = chosen[order[i]]
        pos[flat(s, held[s] - 1)] = lengths[s // groups] - 1  # the new token, in the last slot
    before = {name: a.copy() for name, a in (("pos", pos), ("score", score), ("payload", payload))}
    cls_before = cls.copy()
    for s in range(streams):
        cls_before[flat(s, held[s] - 1)] = new_cls[s // groups, 0]

    width = int(held.max())
    region = torch.tensor([[flat(s, min(i, held[s] - 1)) for i in range(width)] for s in range(streams)])
    valid = torch.arange(width)[None] < torch.from_numpy(held)[:, None]
    positions = torch.from_numpy(before["pos"].astype(np.int64))[region]
    view = _view(positions, valid, torch.from_numpy(lengths).repeat_interleave(groups),
                 torch.from_numpy(before["score"])[region], torch.from_numpy(cls_before)[region])
    keep = kept_sets(view, LOCAL_RATIO, FREQUENT_RATIO)[:, policy] & valid
    if window:
        keep &= positions > (positions.masked_fill(~valid, -1).amax(dim=1) - window)[:, None]

    new_len = fastgen_decode_evict(
        table, held.copy(), fbs, pos, score, cls, (payload, pos.view(np.uint8).reshape(slots, 4),
                                                    score.view(np.uint8).reshape(slots, 4), cls.reshape(slots, 1)),
        new_cls, groups, np.full(streams, policy, np.int64), lengths, LOCAL_RATIO, FREQUENT_RATIO, window,
    )
    assert new_len.tolist() == keep.sum(dim=1).tolist()
    if policy < FASTGEN_POLICIES.index("full") or window:
        assert (new_len < held).any()  # the case evicts something
    for s in range(streams):
        kept = keep[s, : held[s]].tolist()
        n = sum(kept)
        movers = iter([i for i in range(n, held[s]) if kept[i]])
        expected = [i if kept[i] else next(movers) for i in range(n)]  # region slot whose token ends in slot i
        for i, source in enumerate(expected):
            got, want = flat(s, i), flat(s, source)
            assert pos[got] == before["pos"][want] and score[got] == before["score"][want]
            assert cls[got] == cls_before[want] and (payload[got] == before["payload"][want]).all()


@pytest.mark.parametrize("window", [0, 11])
@pytest.mark.parametrize("policy", range(len(FASTGEN_POLICIES)))
def test_compiled_eviction_of_quantized_stores_keeps_blocks_and_order_as_the_torch_path(policy, window):
    """A quantized store's streams (body blocks of 4 tokens, oldest first, then float slots with their sinks first and
    the new token last), scores from four values, random classes: the kept set is `kept_sets`'s made whole per body
    block (`whole_units`: kept while at least half its tokens are; many blocks are exactly half kept here), then the
    window rule's (a block while any token is visible); kept blocks and float slots keep their order, freed blocks
    are returned, the rest of the table zeroed; sinks are counted among the kept float slots, and a kept new token
    after sinks only becomes one while the store makes fewer than its sinks (streams 6 and 7)."""
    from kvtool.methods.evict.base import whole_units
    from kvtool.runtime.eviction import SlidingWindowRule
    from kvtool.runtime.kernels.cpu_fastgen import fastgen_decode_evict_blocks

    rng = np.random.default_rng(100 + policy * 10 + window)
    bs = fbs = 4
    sink_tokens, groups = 4, 2
    body_len = np.array([3, 0, 5, 1, 2, 4, 0, 0], np.int64)
    float_len = np.array([7, 5, 3, 9, 1, 6, 4, 3], np.int64)  # the new token included
    n_sink = np.array([4, 2, 2, 3, 0, 4, 2, 2], np.int64)
    streams = body_len.shape[0]
    lengths = np.array([60, 30, 70, 25], np.int64)  # per sequence
    f_blocks = -(-float_len // fbs)
    ftable = np.zeros((streams, int(f_blocks.max())), np.int32)
    btable = np.zeros((streams, int(body_len.max())), np.int32)
    f_ids, b_ids = rng.permutation(int(f_blocks.sum())), rng.permutation(int(body_len.sum()) + 3)
    fo = bo = 0
    for s in range(streams):
        ftable[s, : f_blocks[s]] = f_ids[fo : fo + f_blocks[s]]
        btable[s, : body_len[s]] = b_ids[bo : bo + body_len[s]]
        fo, bo = fo + f_blocks[s], bo + body_len[s]
    f_slots, b_slots = int(f_blocks.sum()) * fbs, (int(body_len.sum()) + 3) * bs
    fpos, bpos = np.full(f_slots, -5, np.int32), np.full(b_slots, -5, np.int32)
    fscore = rng.choice(np.array([0.0, 0.25, 0.5, 1.0], np.float32), f_slots)
    bscore = rng.choice(np.array([0.0, 0.25, 0.5, 1.0], np.float32), b_slots)
    fcls, bcls = rng.integers(0, 4, f_slots).astype(np.uint8), rng.integers(0, 4, b_slots).astype(np.uint8)
    payload = rng.integers(0, 255, (f_slots, 5)).astype(np.uint8)
    new_cls = np.array([[0], [PUNCT], [SPECIAL], [0]], np.uint8)
    fflat = lambda s, i: int(ftable[s, i // fbs]) * fbs + i % fbs  # noqa: E731
    bflat = lambda s, i: int(btable[s, i // bs]) * bs + i % bs  # noqa: E731
    for s in range(streams):
        n = body_len[s] * bs + float_len[s]
        length = lengths[s // groups]
        chosen = np.concatenate([np.arange(n_sink[s]), np.sort(rng.choice(np.arange(n_sink[s], length - 1),
                                                                           n - 1 - n_sink[s], replace=False))])
        if s >= 6:  # sinks (special, as the runtime classes them), then tokens that are neither, then the new token
            fcls[[fflat(s, i) for i in range(float_len[s] - 1)]] = 0
            fcls[[fflat(s, i) for i in range(n_sink[s])]] = SPECIAL
        order = list(range(body_len[s] * bs, n - 1))  # float slots: the sinks first, then the rest
        for i in range(body_len[s] * bs):
            bpos[bflat(s, i)] = chosen[i]
        sink_first = [i for i in order if chosen[i] < n_sink[s]] + [i for i in order if chosen[i] >= n_sink[s]]
        for slot, i in enumerate(sink_first):
            fpos[fflat(s, slot)] = chosen[i]
        fpos[fflat(s, float_len[s] - 1)] = length - 1
        fcls[fflat(s, float_len[s] - 1)] = 0
    policies = np.full(streams, policy, np.int64)
    policies[6], policies[7] = 0, 4  # a `special` stream left with sinks only; a `full` one that already is
    new_cls = np.array([[0], [PUNCT], [SPECIAL], [SPECIAL]], np.uint8)
    before = (fpos.copy(), fscore.copy(), payload.copy(), btable.copy())
    cls_before = fcls.copy()
    for s in range(streams):
        cls_before[fflat(s, float_len[s] - 1)] = new_cls[s // groups, 0]

    expected = []
    for s in range(streams):
        nb, nf = body_len[s] * bs, float_len[s]
        body_slots = [bflat(s, i) for i in range(nb)]
        float_slots = [fflat(s, i) for i in range(nf)]
        positions = torch.tensor([bpos[j] for j in body_slots] + [before[0][j] for j in float_slots], dtype=torch.int64)[None]
        scores = torch.tensor([bscore[j] for j in body_slots] + [before[1][j] for j in float_slots])[None]
        classes = torch.tensor([bcls[j] for j in body_slots] + [cls_before[j] for j in float_slots], dtype=torch.uint8)[None]
        units = torch.tensor([i // bs for i in range(nb)] + [body_len[s] + i for i in range(nf)])[None]
        view = _view(positions, torch.ones_like(positions, dtype=torch.bool), torch.tensor([lengths[s // groups]]),
                     scores, classes)
        view = StreamView(**{**view.__dict__, "units": units, "unit_count": int(body_len[s] + nf)})
        keep = whole_units(kept_sets(view, LOCAL_RATIO, FREQUENT_RATIO)[:, policies[s]], view)
        if window:
            keep &= SlidingWindowRule(window, bs).keep(view, None)
        keep = keep[0].tolist()
        blocks = [int(before[3][s, b]) for b in range(body_len[s]) if keep[b * bs]]
        kept_float = [i for i in range(nf) if keep[nb + i]]
        sinks = sum(1 for i in kept_float if i < n_sink[s])
        if keep[-1] and len(kept_float) - 1 == sinks and not blocks and sinks < sink_tokens:
            sinks += 1  # `LayerStore.append` after `keep`: the new token of an "empty" stream is a sink
        expected.append((blocks, kept_float, sinks))

    new_lengths = np.empty((3, streams), np.int64)
    freed = np.empty(int(body_len.sum()), np.int64)
    n_freed = fastgen_decode_evict_blocks(
        ftable, float_len, n_sink, sink_tokens, fbs, fpos, fscore, fcls,
        (payload, fpos.view(np.uint8).reshape(f_slots, 4), fscore.view(np.uint8).reshape(f_slots, 4),
         fcls.reshape(f_slots, 1)),
        btable, body_len, bs, bpos, bscore, bcls, new_cls, groups, policies, lengths, LOCAL_RATIO, FREQUENT_RATIO,
        window, new_lengths, freed,
    )
    all_freed = []
    for s, (blocks, kept_float, sinks) in enumerate(expected):
        assert new_lengths[:, s].tolist() == [len(kept_float), sinks, len(blocks)]
        assert btable[s].tolist() == blocks + [0] * (btable.shape[1] - len(blocks))
        all_freed += [int(before[3][s, b]) for b in range(body_len[s]) if int(before[3][s, b]) not in blocks]
        for slot, source in enumerate(kept_float):
            got, want = fflat(s, slot), fflat(s, source)
            assert fpos[got] == before[0][want] and fscore[got] == before[1][want]
            assert fcls[got] == cls_before[want] and (payload[got] == before[2][want]).all()
    assert sorted(freed[:n_freed].tolist()) == sorted(all_freed)
    # the new tokens became sinks: after the two sinks (the window frees those, then the new token is the first)
    assert new_lengths[1, 6:].tolist() == ([1, 1] if window else [3, 3])
    if policy < FASTGEN_POLICIES.index("full") or window:
        assert n_freed > 0 or (new_lengths[0] < float_len).any()  # the case evicts something
