"""The CPU (Numba) decode kernel against the torch reference, and the ``numba`` backend end to end.

Reference for the kernel: the same dense softmax over the blocks decoded by the formats' own `decode_blocks` that the
Triton kernels are tested against (`tests/test_kernels.py::build_case`: ragged streams, empty and one-token ones
included). End to end: the numba backend generates the torch backend's tokens and leaves the same store behind.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from kvtool.errors import RuntimeConfigError
from kvtool.models.cache_argument import with_cache
from kvtool.recipe import CacheSpec, EvictionSpec, QuantSpec, Recipe, load_recipe
from kvtool.runtime.attach import CompressedRuntime
from kvtool.runtime.backend import resolve_backend
from kvtool.runtime.store import take_rows
from tests.test_kernels import build_case
from tests.tiny_models import tiny_model, tiny_tokenizer_free_inputs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")

SIDES = ["uniform-2", "uniform-3", "uniform-4", "uniform-8", "uniform-4-token-keys-channel-values"]
SHAPES = [(64, 1), (64, 4), (128, 8), (256, 1)]  # (head_dim, GQA ratio)


def _cpu_args(args: dict) -> dict:
    """`build_case`'s Triton arguments as `cpu_decode_attention` takes them (host lengths, no static tables)."""
    out = {k: v for k, v in args.items() if k not in ("stream_group",)}
    out["float_len"] = args["float_len"].numpy()
    out["body_len"] = args["body_len"].numpy()
    out["body"] = tuple({n: t for n, t in side.items() if n in ("codes", "scale", "zero")} for side in args["body"])
    return out


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("head_dim, gqa", SHAPES)
def test_cpu_kernel_equals_the_dense_reference(side, head_dim, gqa):
    from kvtool.runtime.kernels.cpu_decode import covers, cpu_decode_attention

    args, reference = build_case(side, head_dim, gqa, "cpu", seed=head_dim + gqa + 3)
    assert covers(args["formats"], torch.float16, head_dim) is None
    out = cpu_decode_attention(**_cpu_args(args))
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


def _float_only_reference(args: dict, softcap=None, sink_logits=None) -> torch.Tensor:
    """Dense attention over each stream's float tokens and the new token (a store with no body: float recipes)."""
    out = []
    fbs, d = args["float_k"].shape[1], args["q"].shape[-1]
    for s, n in enumerate(args["float_len"].tolist()):
        ids = args["float_table"][s, : -(-n // fbs)].long()
        keys = torch.cat([args["float_k"][ids].reshape(-1, d)[:n].float(), args["new_k"][s : s + 1]])
        values = torch.cat([args["float_v"][ids].reshape(-1, d)[:n].float(), args["new_v"][s : s + 1]])
        logits = args["q"][s] @ keys.T
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        if sink_logits is not None:
            logits, values = torch.cat([logits, sink_logits[s][:, None]], 1), torch.cat([values, torch.zeros(1, d)])
        out.append(torch.softmax(logits, -1) @ values)
    return torch.stack(out)


@pytest.mark.parametrize("head_dim, gqa", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_kernel_reads_float_only_stores(head_dim, gqa, dtype):
    from kvtool.runtime.kernels.cpu_decode import covers, cpu_decode_attention

    args, _ = build_case("float", head_dim, gqa, "cpu", seed=head_dim + gqa + 5)
    args["float_k"], args["float_v"] = args["float_k"].to(dtype), args["float_v"].to(dtype)
    assert covers(None, dtype, head_dim) is None
    out = cpu_decode_attention(
        args["q"], args["new_k"], args["new_v"], args["float_k"], args["float_v"], args["float_table"], args["float_len"].numpy()
    )
    torch.testing.assert_close(out, _float_only_reference(args), rtol=1e-4, atol=1e-4)


def test_cpu_kernel_soft_caps_and_adds_learned_sinks():
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention

    args, reference = build_case("uniform-3", 64, 4, "cpu", softcap=5.0, sinks=True, seed=7)
    torch.testing.assert_close(cpu_decode_attention(**_cpu_args(args)), reference, rtol=1e-4, atol=1e-4)
    args, _ = build_case("float", 64, 4, "cpu", seed=8)
    sinks = torch.randn(args["q"].shape[:2], generator=torch.Generator().manual_seed(1))
    out = cpu_decode_attention(
        args["q"], args["new_k"], args["new_v"], args["float_k"], args["float_v"], args["float_table"], args["float_len"].numpy(),
        softcap=3.0, sink_logits=sinks,
    )
    torch.testing.assert_close(out, _float_only_reference(args, 3.0, sinks), rtol=1e-4, atol=1e-4)


def test_cpu_kernel_refuses_what_it_cannot_read():
    from kvtool.runtime.kernels.cpu_decode import covers

    for side in ("fp8-dynamic", "nuq-3-1pct", "turboquant-3", "palu-fp16", "float"):
        args, _ = build_case(side, 64, 1, "cpu")
        assert covers(args["formats"], torch.float16, 64) is not None, side
    assert "float32" in covers(None, torch.float32, 64)


def test_cpu_kernel_writes_the_new_token_where_the_store_would_and_nowhere_else():
    """``write``: each stream's next float slot gets new_k / new_v rounded as the pool's dtype rounds them (float16
    and bfloat16), after the attention that read the new token in float32; every other slot keeps its bytes."""
    from kvtool.runtime.kernels.cpu_decode import cpu_decode_attention

    for dtype in (torch.float16, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        fbs, d, lengths = 16, 64, np.array([1, 17, 5])
        table = torch.tensor([[3, 0], [1, 4], [2, 0]], dtype=torch.int32)  # blocks the streams already have
        float_k = torch.randn(6, fbs, d, generator=g).to(dtype)
        float_v = torch.randn(6, fbs, d, generator=g).to(dtype)
        before_k, before_v = float_k.clone(), float_v.clone()
        q, new_k, new_v = torch.randn(3, 2, d, generator=g), torch.randn(3, d, generator=g) * 3, torch.randn(3, d, generator=g)
        read_only = cpu_decode_attention(q, new_k, new_v, float_k.clone(), float_v.clone(), table, lengths)
        out = cpu_decode_attention(q, new_k, new_v, float_k, float_v, table, lengths, write=True)
        torch.testing.assert_close(out, read_only, rtol=0, atol=0)  # written after the read, not read back rounded
        block = table[torch.arange(3), torch.from_numpy(lengths // fbs)].long()
        offset = torch.from_numpy(lengths % fbs)
        assert torch.equal(float_k[block, offset].view(torch.int16), new_k.to(dtype).view(torch.int16))
        assert torch.equal(float_v[block, offset].view(torch.int16), new_v.to(dtype).view(torch.int16))
        float_k[block, offset], float_v[block, offset] = before_k[block, offset], before_v[block, offset]
        assert torch.equal(float_k.view(torch.int16), before_k.view(torch.int16))
        assert torch.equal(float_v.view(torch.int16), before_v.view(torch.int16))


def test_auto_is_numba_on_cpu_for_packed_codes_the_kernel_reads():
    from kvtool.calibration import build_quantizers

    def backend(recipe, requested="auto"):
        return resolve_backend(requested, torch.device("cpu"), recipe, build_quantizers(recipe, 64, torch.float32, {}))

    for name in ("kivi-4bit", "kivi-2bit", "int8"):
        assert backend(load_recipe(name)) == "numba", name
    for name in ("uncompressed", "h2o", "streamingllm", "uniform-3bit-prerope"):  # float-only stores; pre-RoPE keys
        assert backend(load_recipe(name)) == "torch", name
    for name in ("uncompressed", "h2o", "streamingllm"):  # the kernel reads float-only stores when asked
        assert backend(load_recipe(name), "numba") == "numba", name
    assert backend(load_recipe("kivi-4bit"), "torch") == "torch"
    for name in ("turboquant-3bit", "fp8-e4m3"):  # formats the CPU kernel does not read
        assert backend(load_recipe(name)) == "torch"
        with pytest.raises(RuntimeConfigError, match="--backend numba: recipe"):
            backend(load_recipe(name), "numba")
    with pytest.raises(RuntimeConfigError, match="before RoPE"):
        backend(load_recipe("uniform-3bit-prerope"), "numba")


RECIPES = {
    "kivi-3bit": Recipe(
        name="kivi3", keys=QuantSpec(bits=3, path="keys"), values=QuantSpec(bits=3, axis="token", group_size=16, path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
    ),
    "float16": Recipe(name="f16", cache=CacheSpec(float_dtype="float16"),
                      keys=QuantSpec(method="none", bits=16, path="keys"),
                      values=QuantSpec(method="none", bits=16, axis="token", path="values")),
    "bfloat16-kivi-4bit": Recipe(name="bf16", cache=CacheSpec(sink_tokens=1, recent_tokens=0, block_size=32, float_dtype="bfloat16")),
    "streamingllm-4bit": Recipe(  # an evicting store: the kernel reads it, the torch path stores and evicts
        name="sl4", cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
        eviction=EvictionSpec(policy="streamingllm", budget_tokens=64, sink_tokens=4, window=16),
    ),
}


def _generate(model, recipe, backend, ids, mask, tokens=24):
    runtime = CompressedRuntime.from_recipe(model, recipe, backend=backend)
    cache = runtime.new_cache()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **with_cache(cache), max_new_tokens=tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out, cache


def _held(store) -> tuple:
    """A store's lengths and the float keys / values of every stream's held slots, gathered through its tables."""
    width = int(store.float_len.max())
    slots = torch.arange(width)[None].expand(store.streams, width)
    valid = slots < torch.from_numpy(store.float_len)[:, None]
    ids = store.float_slot_ids(slots)
    floats = [take_rows(store.float_flat(name), ids)[valid] for name in ("k", "v")]
    return store.float_len.tolist(), store.body_len.tolist(), store.n_sink.tolist(), floats


@pytest.mark.parametrize("name", list(RECIPES))
def test_numba_backend_generates_the_torch_backends_tokens_and_store(name):
    """Batch of two, row 1 left-padded (ragged streams), GQA 4:2; 24 tokens cross block flushes and float-block
    boundaries, so the kernel's own writes (`LayerStore.quiet_appends`) and the torch path's alternate."""
    model = tiny_model("llama", kv_heads=2)
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=70)
    by_torch, torch_cache = _generate(model, RECIPES[name], "torch", ids, mask)
    by_numba, numba_cache = _generate(model, RECIPES[name], "numba", ids, mask)
    report = numba_cache.memory_report()
    assert report["backend"] == "numba"
    assert report["kernel_steps"] >= 20 * model.config.num_hidden_layers  # the kernel really ran
    assert torch.equal(by_torch.sequences, by_numba.sequences)
    torch.testing.assert_close(torch.stack(by_numba.logits), torch.stack(by_torch.logits), rtol=2e-3, atol=2e-3)
    assert report["cache_bytes"] == torch_cache.memory_report()["cache_bytes"]
    for a, b in zip(torch_cache.layers, numba_cache.layers):
        held_a, held_b = _held(a.store), _held(b.store)
        assert held_a[:3] == held_b[:3]
        for x, y in zip(held_a[3], held_b[3]):
            # the same tokens in the same slots (the values differ by the attention's rounding: the torch path reads
            # the new token back from float16, the kernel uses it in float32, so later layers' inputs differ slightly)
            torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=2e-2)
