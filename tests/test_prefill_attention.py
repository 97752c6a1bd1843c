"""The many-row prefill path (`prefill_attention.attend_many`: each stored chunk decoded once, fused SDPA per
chunk, log-sum-exp merge) computes the attention a dense float cache would.

* in a real chunked prefill (tiny GQA llama, batch 2 with left padding that fills the whole first chunk of one
  sequence), every layer's attention of a second or later chunk over quantized / evicted / low-rank blocks equals
  dense float attention over the store's own decoded tokens plus the new ones (`KvtoolLayer.decoded`);
* on featured models (sliding windows, learned sinks) the logits equal those of the chunk algebra
  (`paged_attention.attend`), the path it replaces;
* attention-scored policies (`attend_many_scored`: H2O, SnapKV, TOVA, CAKE, PyramidInfer, ChunkKV, AdaKV, RocketKV,
  VATP; also on sliding-window models) keep what the chunk algebra keeps (the same logits through later decode steps);
* a policy that declares it reads fewer sums (`EvictionPolicy.attention_from`: H2O and VATP no window sums, TOVA and
  RocketKV no all-query sums, which the runtime then does not form) keeps what it keeps when every sum is formed;
* on random tensors, against `attend` and `attend_scored` (output, attention received, a window observer's sums),
  every row or the window rows only: streams with no stored token, rows that see nothing, sinks, windows.
"""

import dataclasses
import math

import pytest
import torch

from kvtool.methods.evict.base import policy_class, registered_policies
from kvtool.methods.evict.cake import squared
from kvtool.methods.evict.window_stats import WindowStats
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import CacheSpec, QuantSpec, Recipe, load_recipe
from kvtool.runtime import prefill_attention
from kvtool.runtime.attach import CompressedRuntime
from kvtool.runtime.layer import KvtoolLayer, new_token_mask
from kvtool.runtime.paged_attention import Chunk, LayerOptions, attend, attend_scored
from tests.test_decode_step import RECIPES as DECODE_RECIPES
from tests.test_decode_step import _evicting
from tests.test_palu_runtime import fitted_runtime
from tests.test_runtime import make_recipe, pre_rope_recipe
from tests.tiny_models import featured_model, tiny_model

CHUNKS = (40, 36, 24)  # prefill chunk lengths: the later ones run over encoded body blocks (block 32)
PADDING = 45  # sequence 1 is left-padded over the whole first chunk and 5 tokens of the second


def _palu_grouped() -> Recipe:
    """One Palu key latent for both KV heads (g = 2 heads per stream) beside 4-bit values lifted to it."""
    return Recipe(
        name="palu-grouped",
        keys=QuantSpec(method="palu", bits=16, rank_fraction=0.5, pre_rope=True, group_heads=0, path="keys"),
        values=QuantSpec(method="uniform", bits=4, axis="token", group_size=32, path="values"),
        cache=CacheSpec(block_size=32, sink_tokens=0, recent_tokens=0, float_dtype="model"),
    )


def _bundled(name: str) -> Recipe:
    """A bundled quantizing recipe storing floats in the model's dtype, with a window short enough for body blocks."""
    recipe = load_recipe(name)
    cache = dataclasses.replace(recipe.cache, float_dtype="model", sink_tokens=2, recent_tokens=8)
    return dataclasses.replace(recipe, cache=cache)


RECIPES = {
    "kivi-4bit": lambda: make_recipe(4, float_dtype="model"),
    "kivi-2bit": lambda: make_recipe(2, float_dtype="model"),
    "pre-rope-4bit": lambda: pre_rope_recipe(4, float_dtype="model"),
    "uncompressed": DECODE_RECIPES["uncompressed"],
    "streamingllm": DECODE_RECIPES["streamingllm"],  # evicts at prefill, scores nothing: the same path
    "knorm": DECODE_RECIPES["knorm"],
    "palu-grouped": _palu_grouped,
    "fp8-e4m3": lambda: _bundled("fp8-e4m3"),  # formats read through the default `chunk_floats` (decode_blocks)
    "turboquant-4bit": lambda: _bundled("turboquant-4bit"),
    "h2o": DECODE_RECIPES["h2o"],  # scored: `attend_many_scored`, the probabilities from the fused pass's log-sum-exp
    "snapkv": DECODE_RECIPES["snapkv"],
}
SCORED = ("h2o", "snapkv")


def _runtime(model, recipe: Recipe) -> CompressedRuntime:
    if recipe.keys.method == "palu":
        return fitted_runtime(model, recipe)
    return CompressedRuntime.from_recipe(model, recipe)


def _inputs(vocab: int = 128):
    total = sum(CHUNKS)
    ids = torch.randint(3, vocab, (2, total), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, total, dtype=torch.long)
    ids[1, :PADDING], mask[1, :PADDING] = 0, 0
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # as `generate` numbers left-padded rows
    return ids, mask, positions


def _prefill(model, cache, ids, mask, positions) -> torch.Tensor:
    """Logits (B, T, vocab) of a prefill in CHUNKS."""
    logits, start = [], 0
    with torch.no_grad():
        for length in CHUNKS:
            end = start + length
            out = model(
                input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                **with_cache(cache), use_cache=True,
            )
            logits.append(out.logits)
            start = end
    return torch.cat(logits, dim=1)


def _dense_attention(query, new_k, new_v, stored, attention_mask, scaling) -> torch.Tensor:
    """Float attention (B, t, H_q, D) of query (B, H_q, t, D) over the decoded store plus the new K/V (B, H, t, D)."""
    keys, values, _, valid = stored  # (B, H, T, D) x 2, (B, H, T)
    b, hq, t, _ = query.shape
    g = hq // keys.shape[1]
    new_mask, _ = new_token_mask(attention_mask, b, t, query.device)  # (B, t, t)
    k = torch.cat([keys, new_k.float()], dim=2).repeat_interleave(g, dim=1)  # (B, H_q, T + t, D)
    v = torch.cat([values, new_v.float()], dim=2).repeat_interleave(g, dim=1)
    visible = torch.cat([valid[:, :, None].expand(-1, -1, t, -1), new_mask[:, None].expand(-1, valid.shape[1], -1, -1)], dim=-1)
    logits = torch.matmul(query.float(), k.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~visible.repeat_interleave(g, dim=1), -math.inf)
    return torch.matmul(torch.softmax(logits, dim=-1).nan_to_num(0.0), v).transpose(1, 2)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_many_row_prefill_equals_dense_attention_over_the_decoded_store(name, monkeypatch):
    model = tiny_model("llama")  # 4 query heads over 2 KV heads
    cache = _runtime(model, RECIPES[name]()).new_cache()
    ids, mask, positions = _inputs()
    checked = []
    original_attend = KvtoolLayer.attend
    calls = _count_many(monkeypatch)

    def checked_attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        stored = self.decoded() if self.is_initialized and not self._empty() else None
        out = original_attend(self, module, query, key, value, attention_mask, scaling, **kwargs)  # (B, t, H_q, D)
        if stored is not None:
            reference = _dense_attention(query, key, value, stored, attention_mask, scaling)
            real = new_token_mask(attention_mask, query.shape[0], query.shape[2], query.device)[0].diagonal(dim1=1, dim2=2)
            torch.testing.assert_close(out[real], reference[real].to(out.dtype), rtol=1e-4, atol=1e-5)
            checked.append(self.index)
        return out

    monkeypatch.setattr(KvtoolLayer, "attend", checked_attend)
    _prefill(model, cache, ids, mask, positions)
    layers = model.config.num_hidden_layers
    assert len(checked) == layers * (len(CHUNKS) - 1)
    assert calls["many"] == (len(checked) if name not in SCORED else 0)
    assert calls["scored"] == (layers * len(CHUNKS) if name in SCORED else 0)  # scored: the first chunk too
    if name not in ("uncompressed", "streamingllm", "knorm", *SCORED):
        assert min(int(layer.store.body_len.min()) for layer in cache.layers) > 0  # blocks were read encoded


def _count_many(monkeypatch) -> dict:
    calls = {"many": 0, "scored": 0}
    for name, key in (("attend_many", "many"), ("attend_many_scored", "scored")):
        original = getattr(prefill_attention, name)

        def counted(*args, original=original, key=key, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(prefill_attention, name, counted)
    return calls


def _generate(model, runtime, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (B, T + new_tokens, vocab), real (B, T + new_tokens) bool) of a chunked prefill, then greedy decode steps."""
    ids, mask, positions = _inputs(model.config.vocab_size)
    cache = runtime.new_cache()
    logits = [_prefill(model, cache, ids, mask, positions)]
    step_mask, step_pos, token = mask, positions[:, -1:], logits[0][:, -1:].argmax(dim=-1)
    with torch.no_grad():
        for _ in range(new_tokens):  # decode steps over what the prefill chose to keep
            step_mask, step_pos = torch.cat([step_mask, torch.ones_like(token)], dim=1), step_pos + 1
            out = model(input_ids=token, attention_mask=step_mask, position_ids=step_pos, **with_cache(cache), use_cache=True)
            logits.append(out.logits)
            token = out.logits[:, -1:].argmax(dim=-1)
    real = torch.cat([mask, torch.ones(mask.shape[0], new_tokens, dtype=mask.dtype)], dim=1).bool()
    return torch.cat(logits, dim=1), real


def _equals_the_chunk_algebra(model, recipe, monkeypatch, new_tokens: int = 0):
    """Logits of a chunked prefill (then greedy decode steps) by the many-row path and by the chunk algebra."""
    runtime = CompressedRuntime.from_recipe(model, recipe)
    calls = _count_many(monkeypatch)
    ours, real = _generate(model, runtime, new_tokens)
    taken = dict(calls)
    monkeypatch.setattr(prefill_attention, "covers", lambda *args: False)
    algebra, _ = _generate(model, runtime, new_tokens)
    assert taken["many"] + taken["scored"] >= model.config.num_hidden_layers * (len(CHUNKS) - 1)
    assert calls == taken  # switched off: not taken again
    torch.testing.assert_close(ours[real], algebra[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gpt_oss", "gemma3_text"])
def test_many_row_prefill_equals_the_chunk_algebra_on_featured_models(family, monkeypatch):
    """Sliding windows (stored tokens masked per row by position), learned sinks, a single KV head."""
    _equals_the_chunk_algebra(featured_model(family), make_recipe(4, float_dtype="model"), monkeypatch)


def _scored_recipe(name: str) -> Recipe:
    """A bundled recipe of an attention-scored policy (4-token window, 2 sinks), or H2O's with ``name``'s policy."""
    if name in DECODE_RECIPES:
        return DECODE_RECIPES[name]()
    return _evicting(name) if name in ("cake", "pyramidinfer", "chunkkv", "ada-snapkv", "rocketkv") else _evicting("h2o", name)


@pytest.mark.parametrize("name", ["h2o", "snapkv", "tova", "cake", "pyramidinfer", "chunkkv", "ada-snapkv", "rocketkv", "vatp"])
def test_scored_many_row_prefill_keeps_what_the_chunk_algebra_keeps(name, monkeypatch):
    """Policies that score by attention received: the same tokens kept (so the same logits at every later step)."""
    _equals_the_chunk_algebra(tiny_model("llama"), _scored_recipe(name), monkeypatch, new_tokens=6)


@pytest.mark.parametrize("family, name", [("mistral", "h2o"), ("mistral", "tova"), ("gemma3_text", "snapkv"), ("gemma3_text", "tova")])
def test_scored_many_row_prefill_keeps_what_the_chunk_algebra_keeps_on_sliding_window_models(family, name, monkeypatch):
    """Stored tokens masked per row by position in the probabilities too (every row, or the window rows only)."""
    _equals_the_chunk_algebra(featured_model(family), _scored_recipe(name), monkeypatch, new_tokens=6)


SCORED_POLICIES = [name for name in registered_policies() if policy_class(name).uses_attention and name != "fastgen"]


@pytest.mark.parametrize("name", SCORED_POLICIES)
def test_policies_keep_the_same_tokens_when_only_the_sums_they_declare_are_formed(name, monkeypatch):
    """`attention_from` leaves out sums the policy never reads: the same logits as with every sum formed, through
    decode steps that evict by the scores accumulated since (a policy declaring away a sum it reads fails here:
    TOVA without "window" scores by every query, SnapKV without "all" decodes on scores missing the prompt's)."""
    cls = policy_class(name)
    model, recipe = tiny_model("llama"), _scored_recipe(name)
    recipe = dataclasses.replace(recipe, eviction=dataclasses.replace(recipe.eviction, interval=1))  # decode steps evict
    formed = []
    original = prefill_attention.attend_many_scored

    def recorded(*args, **kwargs):
        formed.append((args[7] is not None, kwargs["all_rows"]))  # (window sums, all-query sums)
        return original(*args, **kwargs)

    monkeypatch.setattr(prefill_attention, "attend_many_scored", recorded)
    declared, real = _generate(model, CompressedRuntime.from_recipe(model, recipe), new_tokens=6)
    assert set(formed) == {("window" in cls.attention_from, "all" in cls.attention_from)}
    monkeypatch.setattr(cls, "attention_from", ("all", "window"))
    everything, _ = _generate(model, CompressedRuntime.from_recipe(model, recipe), new_tokens=6)
    assert set(formed[len(formed) // 2 :]) == {(True, True)}
    torch.testing.assert_close(declared[real], everything[real], rtol=1e-4, atol=1e-4)


def _float_chunk(k, v, valid, positions, start) -> Chunk:
    return Chunk(
        scores=lambda q: torch.matmul(q, k.transpose(-1, -2)), values=lambda p: torch.matmul(p, v),
        valid=valid, positions=positions, region="float", start=start, floats=lambda: (k, v),
    )


@pytest.mark.parametrize("window, sinks", [(None, False), (None, True), (6, False), (6, True)])
def test_attend_many_equals_attend_and_attend_scored_on_edge_cases(window, sinks):
    """Stream 1 holds no stored token (every slot invalid), sequence 1's first rows are padding (see nothing
    at all), chunks of different widths, GQA rows, learned sinks, a sliding window over stored positions."""
    generator = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    b, groups, g, heads, t, d = 2, 2, 1, 3, 8, 16  # S = 4 streams of 3 query heads each
    s, r = b * groups, heads * t
    q = randn(s, g, r, d) * 0.5
    new_k, new_v = randn(s, g, t, d), randn(s, g, t, d)
    new_mask = torch.ones(t, t, dtype=torch.bool).tril().repeat(b, 1, 1)  # (B, t, t)
    new_mask[1, :3] = False  # padding rows of sequence 1: nothing visible, not even themselves
    new_mask[1, :, :3] = False
    chunks, start = [], 0
    for width in (5, 11):
        valid = torch.ones(s, width, dtype=torch.bool)
        valid[1] = False
        valid[2, width - 2 :] = False
        positions = torch.arange(start, start + width).expand(s, width)
        chunks.append(_float_chunk(randn(s, g, width, d), randn(s, g, width, d), valid, positions, start))
        start += width
    query_pos = (start + torch.arange(t)).repeat(heads).expand(s, r)  # (S, R): row = head * t + token
    options = LayerOptions(scaling=1.0, sliding_window=window)
    sink_logits = randn(s, g, r) if sinks else None
    stream_mask = new_mask[:, None].expand(b, heads, t, t).reshape(b, r, t).repeat_interleave(groups, dim=0)
    expected = attend(q, new_k, new_v, stream_mask, iter(chunks), options, query_pos, sink_logits)
    stored = lambda rows: iter(chunks)  # noqa: E731
    ours = prefill_attention.attend_many(q, new_k, new_v, new_mask, stored, options, query_pos, sink_logits)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    causal = prefill_attention.attend_many(q, new_k, new_v, None, stored, options, query_pos, sink_logits)
    plain = torch.ones(t, t, dtype=torch.bool).tril().expand(s, r // t, t, t).reshape(s, r, t)
    torch.testing.assert_close(causal, attend(q, new_k, new_v, plain, iter(chunks), options, query_pos, sink_logits), rtol=1e-5, atol=1e-6)
    window_rows = torch.arange(r) % t >= t - 3  # rows of the last 3 query tokens
    observer = lambda: WindowStats(t, 3, {"square": squared})  # noqa: E731  a policy's statistics of the window rows
    expected, expected_received = attend_scored(
        q, new_k, new_v, stream_mask, lambda: iter(chunks), options, window_rows, query_pos, sink_logits, observer(),
    )
    _, of_window_rows = attend_scored(  # the window sums as every-row sums of the window rows alone
        q[:, :, window_rows], new_k, new_v, stream_mask[:, window_rows], lambda: iter(chunks), options, None,
        query_pos[:, window_rows], None if sink_logits is None else sink_logits[:, :, window_rows],
    )
    _assert_same_sums(expected_received.chunks_window, of_window_rows.chunks)
    torch.testing.assert_close(expected_received.new_window, of_window_rows.new, rtol=1e-5, atol=1e-6)
    for all_rows in (True, False):
        ours, received = prefill_attention.attend_many_scored(
            q, new_k, new_v, new_mask, stream_mask, stored, options, window_rows, query_pos, sink_logits, observer(),
            all_rows=all_rows,
        )
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
        _assert_same_sums(received.chunks_window, expected_received.chunks_window)
        torch.testing.assert_close(received.new_window, expected_received.new_window, rtol=1e-5, atol=1e-6)
        assert received.observer.sums.keys() == expected_received.observer.sums.keys()
        for key, value in expected_received.observer.sums.items():
            torch.testing.assert_close(received.observer.sums[key], value, rtol=1e-5, atol=1e-6)
        if all_rows:
            _assert_same_sums(received.chunks, expected_received.chunks)
            torch.testing.assert_close(received.new, expected_received.new, rtol=1e-5, atol=1e-6)
        else:  # only the window rows were formed
            assert received.chunks == [] and not received.new.any()
    _, causal_received = prefill_attention.attend_many_scored(  # new_mask None: plain causal among the new tokens
        q, new_k, new_v, None, plain, stored, options, window_rows, query_pos, sink_logits,
    )
    _, expected_causal = attend_scored(q, new_k, new_v, plain, lambda: iter(chunks), options, window_rows, query_pos, sink_logits)
    _assert_same_sums(causal_received.chunks, expected_causal.chunks)
    torch.testing.assert_close(causal_received.new, expected_causal.new, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="window_rows"):
        prefill_attention.attend_many_scored(q, new_k, new_v, new_mask, stream_mask, stored, options, all_rows=False)


def _assert_same_sums(ours_sums, expected_sums) -> None:
    """Lists of (region, start, (S, C)) sums: the same chunks, the same values."""
    assert [(region, start) for region, start, _ in ours_sums] == [(region, start) for region, start, _ in expected_sums]
    for (_, _, mine), (_, _, theirs) in zip(ours_sums, expected_sums):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
