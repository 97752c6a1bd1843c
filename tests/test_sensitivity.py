"""Fisher sensitivity pass: K/V gradients equal independently computed ones; the reservoir samples uniformly."""

import pytest
import torch

from kvtool.capture import stream_batches
from kvtool.models.adapter import adapter_for
from kvtool.models.rope import apply_rope
from kvtool.sensitivity import SampleReservoir, next_token_loss, stream_with_gradients
from tests.tiny_models import FAMILIES, tiny_model


def _windows(n, t, seed=0):
    return torch.randint(3, 128, (n, t), generator=torch.Generator().manual_seed(seed))


class GradRecorder:
    def __init__(self):
        self.seen = {}  # layer -> list of (keys_pre, values, keys_fisher, values_fisher) per batch
        self.gradients = {}  # layer -> list of (keys_pre_grad, values_grad) per batch

    def observe_gradients(self, layer, keys_pre_rope, values, keys_pre_rope_fisher, values_fisher, gradients=None):
        self.seen.setdefault(layer, []).append((keys_pre_rope, values, keys_pre_rope_fisher, values_fisher))
        self.gradients.setdefault(layer, []).append(gradients)


def _reference_gradients(model, adapter, batch):
    """dL/d(pre-RoPE keys), dL/d(values) per layer, (B, H_kv, T, D), by hooks on the projections of a plain forward.

    The embedding output is made a leaf, so every K/V depends on it and the gradients w.r.t.
    the hooked projection outputs are total derivatives (nothing is detached on the way).
    """
    g = adapter.geometry
    outputs, hooks = {}, []

    def heads(x):  # (B, T, H_kv*D) or (B, T, H_kv, D) -> (B, H_kv, T, D)
        return x.reshape(x.shape[0], x.shape[1], g.num_kv_heads, g.head_dim).transpose(1, 2)

    def leaf(module, args, output):
        return output.detach().requires_grad_()

    def keep(layer, name):
        def hook(module, args, output):
            outputs[(layer, name)] = output

        return hook

    hooks.append(model.model.embed_tokens.register_forward_hook(leaf))
    for layer in range(g.num_layers):
        attn = adapter.attention(layer)
        if g.family == "phi3":
            hooks.append(attn.qkv_proj.register_forward_hook(keep(layer, "qkv")))
        else:
            key_module = attn.k_norm if g.family == "qwen3" else attn.k_proj
            hooks.append(key_module.register_forward_hook(keep(layer, "k")))
            hooks.append(attn.v_proj.register_forward_hook(keep(layer, "v")))
    try:
        logits = model(input_ids=batch, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    loss = next_token_loss(logits, batch)
    keys = list(sorted(outputs))
    grads = dict(zip(keys, torch.autograd.grad(loss, [outputs[k] for k in keys])))
    result = {}
    q_size, kv_size = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    for layer in range(g.num_layers):
        if g.family == "phi3":
            qkv = grads[(layer, "qkv")]
            result[layer] = (heads(qkv[..., q_size : q_size + kv_size]), heads(qkv[..., q_size + kv_size :]))
        else:
            result[layer] = (heads(grads[(layer, "k")]), heads(grads[(layer, "v")]))
    return result, logits.detach()


@pytest.mark.parametrize(
    "family, overrides",
    [("llama", {}), ("qwen3", {}), ("phi3", {"partial_rotary_factor": 0.5})],
    ids=["llama", "qwen3-k_norm", "phi3-partial-rotary"],
)
def test_gradients_match_an_independent_reference(family, overrides):
    model = tiny_model(family, layers=3, **overrides)
    adapter = adapter_for(model)
    windows = _windows(2, 24, seed=3)
    reference, _ = _reference_gradients(model, adapter, windows)
    model.zero_grad(set_to_none=True)
    recorder = GradRecorder()
    assert stream_with_gradients(model, adapter, windows, [recorder], batch_size=2) == 48
    for layer in range(3):  # layer 0 and 1: gradients also flow through the later layers' K/V
        (keys_pre, values, keys_fisher, values_fisher), = recorder.seen[layer]
        ref_keys, ref_values = reference[layer]
        for fisher, ref in ((keys_fisher, ref_keys), (values_fisher, ref_values)):
            assert fisher.shape == ref.shape == (2, 2, 24, 32) and fisher.dtype == torch.float32
            assert not fisher.requires_grad
            torch.testing.assert_close(fisher.sqrt(), ref.abs(), rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        assert keys_fisher.max() > 0 and values_fisher.max() > 0
        (keys_grad, values_grad), = recorder.gradients[layer]  # signed: the Fisher weights are their squares
        for grad, ref in ((keys_grad, ref_keys), (values_grad, ref_values)):
            torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    rotary = adapter.geometry.rotary_dim
    assert rotary == (16 if family == "phi3" else 32)


def test_pre_rope_gradient_is_the_rotated_back_post_rope_gradient(monkeypatch):
    """dL/dk_pre = R^T dL/dk_post with R the RoPE rotation; per rotation pair the norms agree, element-wise they don't."""
    import transformers.models.llama.modeling_llama as llama

    model = tiny_model("llama")
    adapter = adapter_for(model)
    windows = _windows(1, 16, seed=5)
    post_keys = []
    original = llama.apply_rotary_pos_emb

    def recording(q, k, cos, sin, *args, **kwargs):
        q_embed, k_embed = original(q, k, cos, sin, *args, **kwargs)
        post_keys.append(k_embed)
        return q_embed, k_embed

    monkeypatch.setattr(llama, "apply_rotary_pos_emb", recording)
    embed_leaf = model.model.embed_tokens.register_forward_hook(lambda m, a, out: out.detach().requires_grad_())
    try:
        logits = model(input_ids=windows, use_cache=False).logits
    finally:
        embed_leaf.remove()
    post_grad = torch.autograd.grad(next_token_loss(logits, windows), post_keys[1])[0]  # layer 1, (1, H_kv, T, D)
    monkeypatch.undo()
    recorder = GradRecorder()
    stream_with_gradients(model, adapter, windows, [recorder])
    keys_pre, _, keys_fisher, _ = recorder.seen[1][0]
    positions = torch.arange(16).unsqueeze(0)
    cos, sin = adapter.rope_cos_sin(positions)
    probe = keys_pre.clone().requires_grad_()
    (expected,) = torch.autograd.grad(apply_rope(probe, cos, sin), probe, post_grad)  # R^T post_grad
    scale = expected.abs().max().item()
    torch.testing.assert_close(keys_fisher.sqrt(), expected.abs(), rtol=1e-4, atol=1e-4 * scale)
    pair_norm = lambda g: g[..., :16].square() + g[..., 16:].square()  # noqa: E731
    torch.testing.assert_close(pair_norm(keys_fisher.sqrt()), pair_norm(post_grad), rtol=1e-4, atol=1e-8 * scale**2)
    assert not torch.allclose(keys_fisher.sqrt(), post_grad.abs(), rtol=1e-2, atol=1e-3 * scale)  # rotated: differs


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_with_gradient_cache_equals_plain_forward(family):
    model = tiny_model(family)
    adapter = adapter_for(model)
    windows = _windows(3, 20, seed=1)
    with torch.no_grad():
        plain = model(input_ids=windows, use_cache=False).logits
    seen_logits = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: seen_logits.append(output.detach()))
    recorder = GradRecorder()
    try:
        tokens = stream_with_gradients(model, adapter, windows, [recorder], batch_size=2)
    finally:
        hook.remove()
    assert tokens == 60
    torch.testing.assert_close(torch.cat(seen_logits), plain, rtol=1e-5, atol=1e-5)
    assert [len(recorder.seen[layer]) for layer in range(2)] == [2, 2]  # batches of 2 and 1
    assert recorder.seen[0][1][0].shape == (1, 2, 20, 32)
    # the captured activations are the model's: compare with the plain capture pass
    plain_values = []

    class Keep:
        def observe(self, layer, keys_pre_rope, keys, values):
            if layer == 1:
                plain_values.append((keys_pre_rope, values))

    stream_batches(model, adapter, windows, [Keep()], batch_size=2)
    for (keys_pre, values, _, _), (want_keys, want_values) in zip(recorder.seen[1], plain_values):
        torch.testing.assert_close(keys_pre, want_keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-5)


def test_parameters_get_no_grad_and_flags_are_restored():
    model = tiny_model("qwen2")
    adapter = adapter_for(model)
    params = list(model.parameters())
    for i, p in enumerate(params):
        p.requires_grad_(i % 2 == 0)  # a mix of flags
    flags = [p.requires_grad for p in params]
    with torch.no_grad():  # the pass enables gradients itself
        stream_with_gradients(model, adapter, _windows(2, 12), [GradRecorder()])
    assert all(p.grad is None for p in params)
    assert [p.requires_grad for p in params] == flags


def test_flags_are_restored_when_an_observer_fails():
    model = tiny_model("llama")
    adapter = adapter_for(model)

    class Boom:
        def observe_gradients(self, *args, **kwargs):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        stream_with_gradients(model, adapter, _windows(1, 8), [Boom()])
    assert all(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_bfloat16_model_gives_float32_fisher():
    model = tiny_model("llama").to(torch.bfloat16)
    adapter = adapter_for(model)
    recorder = GradRecorder()
    stream_with_gradients(model, adapter, _windows(1, 16), [recorder])
    keys_pre, values, keys_fisher, values_fisher = recorder.seen[0][0]
    assert {t.dtype for t in (keys_pre, values, keys_fisher, values_fisher)} == {torch.float32}
    assert torch.isfinite(keys_fisher).all() and values_fisher.max() > 0


# ----- reservoir -----------------------------------------------------------------------------


def _token_batch(first_id, batch=2, seq=8, heads=2, dim=4):
    """(keys, values, keys_fisher, values_fisher), each (B, H, T, D); element [.., 0] is a global token id."""
    ids = first_id + torch.arange(batch * seq, dtype=torch.float32).reshape(batch, 1, seq, 1)
    noise = torch.randn(batch, heads, seq, dim, generator=torch.Generator().manual_seed(first_id))
    keys = torch.cat([ids.expand(batch, heads, seq, 1), noise[..., 1:]], dim=-1)
    values = torch.cat([ids.expand(batch, heads, seq, 1), -noise[..., 1:]], dim=-1)
    return keys, values, keys.square() + 1, values.abs()


def _feed(reservoir, batches=10, layers=(0,), **shape):
    tokens_per_batch = shape.get("batch", 2) * shape.get("seq", 8)
    data = []
    for i in range(batches):
        keys, values, kf, vf = _token_batch(i * tokens_per_batch, **shape)
        data.append((keys, values, kf, vf))
        for layer in layers:
            reservoir.observe_gradients(layer, keys, values, kf, vf)
    return data


def _all_rows(data):
    rows = lambda x: x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])  # noqa: E731
    return [torch.cat([rows(batch[i]) for batch in data]) for i in range(4)]


def test_reservoir_is_bounded_and_rows_are_real_tokens():
    reservoir = SampleReservoir(max_tokens=50, seed=0)
    data = []
    for i in range(10):
        keys, values, kf, vf = _token_batch(i * 16)
        data.append((keys, values, kf, vf))
        reservoir.observe_gradients(0, keys, values, kf, vf)
        assert reservoir.samples(0, "values")[0].shape[0] == min(50, 16 * (i + 1))
    assert reservoir.tokens_seen(0) == 160
    all_keys, all_values, all_kf, all_vf = _all_rows(data)
    x, fisher = reservoir.samples(0, "keys_pre_rope")
    v, v_fisher = reservoir.samples(0, "values")
    assert x.shape == fisher.shape == v.shape == v_fisher.shape == (50, 2, 4)
    assert x.dtype == fisher.dtype == torch.float32
    ids = x[:, 0, 0].long()
    assert len(set(ids.tolist())) == 50  # no token twice
    assert torch.equal(ids, ids.sort().values)  # kept in stream order
    # every row is the real row of its token, the Fisher row belongs to the same token, values too
    assert torch.equal(x, all_keys[ids]) and torch.equal(fisher, all_kf[ids])
    assert torch.equal(v, all_values[ids]) and torch.equal(v_fisher, all_vf[ids])


def test_reservoir_is_deterministic_per_seed_and_same_tokens_across_layers():
    a, b, c = SampleReservoir(30, seed=1), SampleReservoir(30, seed=1), SampleReservoir(30, seed=2)
    for reservoir in (a, b, c):
        _feed(reservoir, layers=(0, 1))
    for part in ("keys_pre_rope", "values"):
        torch.testing.assert_close(a.samples(0, part), b.samples(0, part), rtol=0, atol=0)
    assert not torch.equal(a.samples(0, "values")[0], c.samples(0, "values")[0])
    assert torch.equal(a.samples(0, "values")[0], a.samples(1, "values")[0])  # same tokens in every layer
    assert a.layers() == [0, 1]


def test_reservoir_keeps_everything_when_data_is_small():
    reservoir = SampleReservoir(max_tokens=1000)
    data = _feed(reservoir, batches=3)
    all_keys, _, all_kf, _ = _all_rows(data)
    x, fisher = reservoir.samples(0, "keys_pre_rope")
    assert torch.equal(x, all_keys) and torch.equal(fisher, all_kf)


def test_reservoir_is_uniform_over_batches():
    reservoir = SampleReservoir(max_tokens=80, seed=0)
    _feed(reservoir, batches=10)  # 160 tokens, 16 per batch
    batch_of = reservoir.samples(0, "values")[0][:, 0, 0].long() // 16
    assert torch.bincount(batch_of, minlength=10).min() > 0  # every batch contributes
    # over many seeds, each batch contributes its share (1 token of 4 per batch kept on average)
    counts = torch.zeros(10)
    for seed in range(300):
        small = SampleReservoir(max_tokens=10, seed=seed)
        for i in range(10):
            keys, values, kf, vf = _token_batch(i * 4, batch=1, seq=4, heads=1, dim=2)
            small.observe_gradients(0, keys, values, kf, vf)
        counts += torch.bincount(small.samples(0, "keys_pre_rope")[0][:, 0, 0].long() // 4, minlength=10)
    assert counts.sum() == 3000
    assert (counts - 300).abs().max() < 60, counts  # sd ~ 15


def test_reservoir_fed_by_plain_capture_and_from_the_gradient_pass():
    model = tiny_model("mistral")
    adapter = adapter_for(model)
    windows = _windows(4, 10, seed=7)
    plain = SampleReservoir(max_tokens=25, seed=0)
    assert stream_batches(model, adapter, windows, [plain], batch_size=2) == 40
    x, fisher = plain.samples(1, "keys_pre_rope")
    assert x.shape == (25, 2, 32) and fisher is None
    graded = SampleReservoir(max_tokens=25, seed=0)
    assert stream_with_gradients(model, adapter, windows, [graded], batch_size=2) == 40
    x_grad, fisher_grad = graded.samples(1, "keys_pre_rope")
    torch.testing.assert_close(x_grad, x, rtol=1e-5, atol=1e-5)  # same seed, same tokens
    assert fisher_grad.shape == x.shape and fisher_grad.min() >= 0
    with pytest.raises(ValueError, match="not both"):
        graded.observe(0, *(torch.zeros(1, 2, 3, 32),) * 3)
    with pytest.raises(KeyError):
        graded.samples(5, "values")
    with pytest.raises(ValueError):
        graded.samples(0, "keys")


def test_reservoir_skips_the_sink_positions():
    from kvtool.sensitivity import SampleReservoir

    x = torch.arange(2 * 1 * 6 * 1, dtype=torch.float32).reshape(2, 1, 6, 1)  # (B, H, T, D): value = position + 6*row
    reservoir = SampleReservoir(max_tokens=100, skip_first=2)
    reservoir.observe(0, x, x, x)
    kept, _ = reservoir.samples(0, "values")
    assert sorted(kept.reshape(-1).tolist()) == [2, 3, 4, 5, 8, 9, 10, 11]
