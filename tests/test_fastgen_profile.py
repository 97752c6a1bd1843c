"""FastGen kept sets, policy choice and attention profiling (`kvtool.methods.evict.fastgen`,
`kvtool.attention_profile`), through the API and the CLI.

Oracles: hand-worked kept sets; the per-stream `fastgen_keep` for the batched variant;
synthetic attention patterns whose policy is known (BOS-only head -> special, previous
tokens -> local, fixed positions -> frequent, uniform -> full); a per-row reference built
from full T x T probabilities for the chunked profiler on a tiny model.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from kvtool import api
from kvtool.artifact import Artifact, load_artifact, save_artifact
from kvtool.attention_profile import AttentionProfiler, PolicyMap, policy_map, profile_attention
from kvtool.cli import app
from kvtool.errors import DataError, RecipeError
from kvtool.methods.evict.fastgen import (
    FASTGEN_POLICIES,
    choose_policies,
    fastgen_keep,
    fastgen_keep_rows,
    token_classes,
)
from kvtool.models.adapter import adapter_for
from kvtool.models.attention_hook import attention_handler, install, sdpa_reference
from kvtool.recipe import EvictionSpec
from tests.conftest import shared_path
from tests.tiny_models import FAMILIES, tiny_model

SPECIAL, PUNCT, LOCAL, FREQUENT, FULL = range(5)


def mask(t: int, positions) -> torch.Tensor:
    out = torch.zeros(t, dtype=torch.bool)
    out[list(positions)] = True
    return out


def kept(keep: torch.Tensor) -> set[int]:
    return set(torch.nonzero(keep).reshape(-1).tolist())


# --- fastgen_keep on hand examples -------------------------------------------------------------

T = 10
IS_SPECIAL, IS_PUNCT = mask(T, [0]), mask(T, [3, 6])
SCORES = torch.tensor([9.0, 8.0, 0.0, 0.0, 7.0, 0.0, 0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("policy, expected", [
    (SPECIAL, {0}),
    (PUNCT, {0, 3, 6}),
    (LOCAL, {0, 3, 6, 7, 8, 9}),  # ceil(0.3 x 10) = 3 (not 4 from 3.0000000000000004)
    (FREQUENT, {0, 1, 3, 4, 6, 7, 8, 9}),  # top ceil(0.3 x 10) = 3 by score: 0, 1, 4
    (FULL, set(range(T))),
])
def test_fastgen_keep_hand_examples(policy, expected):
    assert kept(fastgen_keep(policy, IS_SPECIAL, IS_PUNCT, SCORES, 0.3, 0.3)) == expected


def test_fastgen_keep_ratios_and_ties():
    none = torch.zeros(T, dtype=torch.bool)
    assert kept(fastgen_keep(LOCAL, none, none, SCORES, 0.0, 0.0)) == set()
    assert kept(fastgen_keep(LOCAL, none, none, SCORES, 0.11, 0.0)) == {8, 9}  # ceil(1.1) = 2
    # ties among heavy hitters go to the older token
    assert kept(fastgen_keep(FREQUENT, none, none, torch.ones(T), 0.0, 0.2)) == {0, 1}
    with pytest.raises(ValueError):
        fastgen_keep(5, none, none, SCORES, 0.3, 0.3)


def test_rows_variant_equals_per_stream():
    generator = torch.Generator().manual_seed(0)
    b, h, t = 2, 3, 20
    is_special = torch.rand(b, 1, t, generator=generator) < 0.1  # (B, 1, T)
    is_punct = torch.rand(b, 1, t, generator=generator) < 0.2
    scores = torch.randint(0, 4, (b, h, t, t), generator=generator).float()  # many ties
    lengths = torch.arange(1, t + 1)  # row r holds keys 0..r
    for policy in range(5):
        rows = fastgen_keep_rows(policy, is_special, is_punct, scores, lengths, 0.3, 0.25)  # (B, H, T, T)
        assert rows.shape == (b, h, t, t)
        for i in range(b):
            for j in range(h):
                for r in range(t):
                    n = r + 1
                    ref = fastgen_keep(policy, is_special[i, 0, :n], is_punct[i, 0, :n], scores[i, j, r, :n], 0.3, 0.25)
                    assert torch.equal(rows[i, j, r, :n], ref), (policy, i, j, r)
                    assert not rows[i, j, r, n:].any()


def test_choose_policies_first_over_threshold():
    mass = torch.tensor([[[0.96, 0.97, 0.98, 0.99, 1.0],
                          [0.10, 0.95, 0.96, 0.97, 1.0],
                          [0.10, 0.20, 0.90, 0.99, 1.0],
                          [0.10, 0.20, 0.30, 0.40, 0.9999999]]])  # (1, 4, 5); full always qualifies
    assert choose_policies(mass, 0.95).tolist() == [[SPECIAL, PUNCT, FREQUENT, FULL]]
    assert choose_policies(mass, 0.9).tolist() == [[SPECIAL, PUNCT, LOCAL, FULL]]
    assert choose_policies(mass, 0.9).dtype == torch.int64


def test_token_classes_on_kvref():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(shared_path("models/kvref-5m")))
    special, punct = token_classes(tokenizer)
    assert special.tolist() == [0, 1, 2]
    texts = {tokenizer.decode([i]) for i in punct.tolist()}
    assert {".", ",", "!", "?", '"', "'", "(", ")", "-", ";", ":", "\n"} <= texts
    assert not any(t.strip().isalnum() for t in texts)
    assert not set(punct.tolist()) & set(special.tolist())


# --- synthetic attention patterns with a known policy ------------------------------------------

N = 64  # tokens of the synthetic window
PUNCT_POSITIONS = list(range(6, N, 7))
FIXED = [5, 9, 12]


def row_distribution(kind: str, i: int) -> torch.Tensor:
    """(N,) attention probabilities of query row i over keys 0..i."""
    p = torch.zeros(N)
    if kind == "bos":
        p[0] = 1
    elif kind == "previous3":
        p[max(0, i - 2) : i + 1] = 1
    elif kind == "fixed":
        p[[f for f in FIXED if f <= i] or [0]] = 1
    elif kind == "punct":
        p[[q for q in PUNCT_POSITIONS if q <= i] or [0]] = 1
    elif kind == "uniform":
        p[: i + 1] = 1
    return p / p.sum()


def synthetic_probs(heads: list[tuple[str, str]]) -> torch.Tensor:
    """(1, H_kv, 2, N, N): per KV head, the patterns of its two query heads."""
    rows = [[torch.stack([row_distribution(kind, i) for i in range(N)]) for kind in pair] for pair in heads]
    return torch.stack([torch.stack(pair) for pair in rows])[None]


def feed(profiler: AttentionProfiler, probs: torch.Tensor, chunk: int, layer: int = 0) -> None:
    accumulated = torch.zeros(probs.shape[0], probs.shape[1], probs.shape[-1])  # (B, H_kv, T)
    for start in range(0, probs.shape[3], chunk):
        positions = torch.arange(start, min(start + chunk, probs.shape[3]))
        accumulated = profiler.observe_probabilities(layer, probs[:, :, :, positions], positions, accumulated)


SYNTHETIC = [
    (("bos", "bos"), "special"),
    (("punct", "punct"), "punctuation"),
    (("previous3", "previous3"), "local"),
    (("fixed", "fixed"), "frequent"),
    (("uniform", "uniform"), "full"),
    (("bos", "previous3"), "local"),  # GQA: the group decides together
    (("bos", "uniform"), "full"),
]


@pytest.mark.parametrize("chunk", [N, 10])
def test_synthetic_heads_get_known_policies(chunk):
    heads = [pair for pair, _ in SYNTHETIC]
    profiler = AttentionProfiler(1, len(heads), EvictionSpec())
    profiler.begin_batch(mask(N, [0])[None], mask(N, PUNCT_POSITIONS)[None])
    feed(profiler, synthetic_probs(heads), chunk)
    result = profiler.finish(torch.tensor([0]), torch.tensor([]))
    chosen = [FASTGEN_POLICIES[p] for p in result.tensors["heads.policy"][0].tolist()]
    assert chosen == [name for _, name in SYNTHETIC]
    mass = result.tensors["heads.mass"][0]  # (H, 5)
    assert mass[0, SPECIAL] == pytest.approx(1.0)
    assert mass[5, SPECIAL] == pytest.approx(0.5) and mass[5, LOCAL] == pytest.approx(1.0)
    assert result.tensors["layers.attention_need"].shape == (1,)


def test_synthetic_profile_independent_of_chunking():
    heads = [pair for pair, _ in SYNTHETIC]
    results = []
    for chunk in (N, 7):
        profiler = AttentionProfiler(1, len(heads), EvictionSpec())
        profiler.begin_batch(mask(N, [0])[None], mask(N, PUNCT_POSITIONS)[None])
        feed(profiler, synthetic_probs(heads), chunk)
        results.append(profiler.finish(torch.tensor([0]), torch.tensor([])).tensors)
    for name, tensor in results[0].items():
        torch.testing.assert_close(results[1][name], tensor, msg=name)


# --- the profiler on a tiny model against a per-row reference ----------------------------------


def full_probs(model, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per layer the full causal attention probabilities (B, H_kv, G, T, T), captured through the hook."""
    captured = {}

    def handler(module, query, key, value, attention_mask, scaling):
        b, hq, t, d = query.shape
        hkv = key.shape[1]
        logits = query.reshape(b, hkv, hq // hkv, t, d) @ key.transpose(-1, -2)[:, :, None] * scaling
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        captured[module.layer_idx] = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        return sdpa_reference(query, key, value, attention_mask, scaling)

    install(model)
    with torch.no_grad(), attention_handler(handler):
        model(input_ids=ids, use_cache=False)
    return captured


def reference_profile(probs: dict[int, torch.Tensor], is_special, is_punct, spec: EvictionSpec, skip: int = 16):
    """heads.mass, heads.kept_fraction, layers.attention_need row by row with `fastgen_keep`."""
    layers = len(probs)
    b, h, g, t, _ = probs[0].shape
    mass, kept_fraction = torch.zeros(layers, h, 5), torch.zeros(layers, h, 5)
    need = torch.zeros(layers)
    for layer, p in probs.items():
        group = p.sum(dim=2).double()  # (B, H, T, T)
        for bi in range(b):
            for hi in range(h):
                for i in range(skip, t):
                    n = i + 1
                    scores = group[bi, hi, : i + 1, :n].sum(dim=0)
                    row = group[bi, hi, i, :n] / g
                    for policy in range(5):
                        keep = fastgen_keep(policy, is_special[bi, :n], is_punct[bi, :n], scores,
                                            spec.local_ratio, spec.frequent_ratio)
                        mass[layer, hi, policy] += float(row[keep].sum())
                        kept_fraction[layer, hi, policy] += float(keep.sum()) / n
                    ordered = row.sort(descending=True).values.cumsum(0)
                    need[layer] += min(int((ordered < spec.threshold).sum()) + 1, n) / n / h
    rows = b * (t - skip)
    return {"heads.mass": mass / rows, "heads.kept_fraction": kept_fraction / rows, "layers.attention_need": need / rows}


def test_chunked_profiler_matches_per_row_reference_on_tiny_model():
    model = tiny_model("llama")
    adapter = adapter_for(model)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = 1  # BOS
    special_ids, punct_ids = torch.tensor([1]), torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    spec = EvictionSpec(local_ratio=0.25, frequent_ratio=0.2, threshold=0.9)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    chunked = profile_attention(model, adapter, ids, special_ids, punct_ids, spec, batch_size=1, chunk_rows=7)
    whole = profile_attention(model, adapter, ids, special_ids, punct_ids, spec, batch_size=2, chunk_rows=64)
    for name, tensor in whole.tensors.items():
        torch.testing.assert_close(chunked.tensors[name], tensor, msg=name)
    is_special = torch.isin(ids, special_ids) | (torch.arange(40) < spec.sink_tokens)
    reference = reference_profile(full_probs(model, ids), is_special, torch.isin(ids, punct_ids), spec)
    for name, tensor in reference.items():
        torch.testing.assert_close(chunked.tensors[name], tensor, atol=1e-5, rtol=1e-5, msg=name)
    with torch.no_grad():  # the handler returned the normal attention output: the model is unchanged
        torch.testing.assert_close(model(input_ids=ids).logits, plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_profiles_every_family_without_changing_the_model(family):
    model = tiny_model(family)
    ids = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    result = profile_attention(model, adapter_for(model), ids, torch.tensor([1]), torch.tensor([5, 6]), EvictionSpec())
    assert result.tensors["heads.mass"].shape == (2, 2, 5) and result.tensors["heads.policy"].shape == (2, 2)
    assert torch.allclose(result.tensors["heads.mass"][..., -1], torch.ones(2, 2))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain)


def test_windows_shorter_than_32_tokens_are_refused():
    model = tiny_model("llama")
    with pytest.raises(DataError, match="at least 32 tokens"):
        profile_attention(model, adapter_for(model), torch.ones(1, 31, dtype=torch.long),
                          torch.tensor([1]), torch.tensor([]), EvictionSpec())


# --- through the API on kvref-5m ---------------------------------------------------------------


@pytest.fixture(scope="module")
def kvref_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "p.safetensors"
    artifact = api.profile(f"{shared_path('data/text/wikitext2_test.txt')}[0:0.1]", out, str(shared_path("models/kvref-5m")),
                           threshold=0.8, samples=2, seq_len=256, batch_size=2)
    return out, artifact


def test_api_profile_writes_attention_tensors(kvref_profile):
    out, artifact = kvref_profile
    t = artifact.tensors
    assert t["heads.mass"].shape == (6, 2, 5) and t["heads.mass"].dtype == torch.float32
    assert t["heads.kept_fraction"].shape == (6, 2, 5)
    assert t["heads.policy"].shape == (6, 2) and t["heads.policy"].dtype == torch.int8
    for name in ("layers.attention_need", "layers.attention_entropy", "layers.budget_weight"):
        assert t[name].shape == (6,) and t[name].dtype == torch.float32 and torch.isfinite(t[name]).all()
    assert t["tokens.special"].tolist() == [0, 1, 2] and t["tokens.punctuation"].dtype == torch.int64
    assert "layers.0.keys.absmax" in t  # channel statistics are still there
    mass, fraction = t["heads.mass"], t["heads.kept_fraction"]
    assert (mass.diff(dim=-1) >= -1e-6).all() and torch.allclose(mass[..., -1], torch.ones(6, 2))
    assert (fraction.diff(dim=-1) >= -1e-6).all() and torch.allclose(fraction[..., -1], torch.ones(6, 2))
    assert torch.equal(t["heads.policy"].long(), choose_policies(mass, 0.8))
    assert t["layers.budget_weight"].mean() == pytest.approx(1.0, abs=1e-6)

    fastgen = artifact.manifest["fastgen"]
    assert fastgen["threshold"] == 0.8 and fastgen["local_ratio"] == 0.3 and fastgen["sink_tokens"] == 4
    assert fastgen["policies"] == list(FASTGEN_POLICIES)
    assert 0 < fastgen["expected_cache_fraction"] <= 1
    assert fastgen["expected_cache_fraction"] == pytest.approx(policy_map(t).expected_cache_fraction)
    assert artifact.manifest["pyramid"]["budget_weight"] == pytest.approx(t["layers.budget_weight"].tolist())

    loaded = load_artifact(out, expect_kind="profile")  # round trip
    for name, tensor in t.items():
        assert torch.equal(loaded.tensors[name], tensor), name


def test_api_profile_validates_overrides_before_loading(tmp_path):
    with pytest.raises(RecipeError, match="eviction.threshold"):
        api.profile("unused.txt", tmp_path / "p.safetensors", "no/such-model", threshold=1.5)


# --- CLI: the policy map, inspect, --plot ------------------------------------------------------

runner = CliRunner()


def squash(text: str) -> str:
    return "".join(text.split())


def fake_attention_profile() -> Artifact:
    policy = torch.tensor([[0, 4], [2, 3]], dtype=torch.int8)
    kept = torch.tensor([0.1, 0.2, 0.4, 0.6, 1.0]).expand(2, 2, 5).clone()
    tensors = {"heads.policy": policy, "heads.kept_fraction": kept, "heads.mass": kept.clone(),
               "layers.attention_need": torch.tensor([0.6, 0.3]), "layers.budget_weight": torch.tensor([1.33, 0.67])}
    return Artifact(kind="profile", manifest={"model": {}, "fastgen": {"threshold": 0.95}}, tensors=tensors)


def test_cli_profile_prints_policy_map_and_forwards_options(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(api, "profile", lambda *a, **k: calls.append((a, k)) or fake_attention_profile())
    plot = tmp_path / "map.png"
    (tmp_path / "f.txt").write_text("some calibration text\n")  # the CLI checks --data before the model loads
    result = runner.invoke(app, ["profile", "-d", str(tmp_path / "f.txt"), "-o", str(tmp_path / "p.safetensors"), "--recipe", "fastgen-t95",
                                 "--threshold", "0.9", "--local-ratio", "0.2", "--frequent-ratio", "0.1", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    (_, kwargs), = calls
    assert {k: kwargs[k] for k in ("recipe", "threshold", "local_ratio", "frequent_ratio")} == {
        "recipe": "fastgen-t95", "threshold": 0.9, "local_ratio": 0.2, "frequent_ratio": 0.1}
    out = squash(result.stdout)
    assert all(squash(s) in out for s in ("FastGen policy per layer x KV head at T = 0.95", "special", "full",
                                           "local", "frequent", "expected cache fraction 0.525"))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_inspect_shows_policy_map_of_profile_and_deployable(tmp_path):
    profile = fake_attention_profile()
    save_artifact(tmp_path / "p.safetensors", profile)
    prefixed = {f"profile.{k}": v for k, v in profile.tensors.items()}
    save_artifact(tmp_path / "d.safetensors", Artifact(kind="deployable", manifest={"model": {}}, tensors=prefixed))
    for name in ("p.safetensors", "d.safetensors"):
        result = runner.invoke(app, ["inspect", str(tmp_path / name), "--plot", str(tmp_path / f"{name}.png")])
        assert result.exit_code == 0, result.output
        assert "FastGenpolicyperlayerxKVhead" in squash(result.stdout) and "expectedcachefraction0.525" in squash(result.stdout)
        assert (tmp_path / f"{name}.png").is_file()


def test_cli_plot_errors_are_friendly(monkeypatch, tmp_path):
    import sys

    save_artifact(tmp_path / "x.safetensors", Artifact(kind="profile", manifest={"model": {}}, tensors={"x": torch.zeros(2)}))
    result = runner.invoke(app, ["inspect", str(tmp_path / "x.safetensors"), "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "heads.policy" in result.stderr and "kvtoolprofile" in squash(result.stderr)
    assert result.stdout == ""  # refused before printing anything
    result = runner.invoke(app, ["inspect", str(tmp_path / "x.safetensors"), "--plot", str(tmp_path / "x.jpg")])
    assert result.exit_code == 2 and ".png" in result.stderr
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    (tmp_path / "f.txt").write_text("some calibration text\n")
    argv = ["profile", "-d", str(tmp_path / "f.txt"), "-o", str(tmp_path / "p.safetensors"), "--plot", str(tmp_path / "m.png")]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2 and 'pip install -e ".[plots]"' in result.stderr


def test_policy_map_expected_fraction():
    policies = PolicyMap(policy=torch.tensor([[0, 4]]), kept_fraction=torch.tensor([[[0.1, 0, 0, 0, 1], [0.1, 0, 0, 0, 1]]]))
    assert policies.expected_cache_fraction == pytest.approx(0.55)
    assert PolicyMap(policy=torch.tensor([[0]])).expected_cache_fraction is None
    assert policy_map({"x": torch.zeros(1)}) is None
