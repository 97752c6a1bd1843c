"""The Triton decode kernel reads TurboQuant keys with the 1-bit QJL residual (``qjl: true``) as the torch path does.

Same harness as tests/test_kernels.py (random ragged store, dense reference from the formats' own
`decode_blocks`, which add the QJL estimate ``gamma G^T sign``; kernels on CPU tensors under
``TRITON_INTERPRET=1``, set by conftest.py, and on CUDA when a GPU is present).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

import tests.test_kernels as base
from kvtool.recipe import CacheSpec, QuantSpec, Recipe
from kvtool.runtime.attach import CompressedRuntime
from tests.tiny_models import tiny_model, tiny_tokenizer_free_inputs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # the other turboquant kernel tests'


def _keys(bits: int, split: bool) -> QuantSpec:
    """TurboQuant keys with QJL; split: a quarter of the channels at +2 bits (their own instance, QJL too)."""
    extra = dict(extra_bits=0.5, outlier_channel_fraction=0.25) if split else {}
    return QuantSpec(method="turboquant", bits=bits, qjl=True, path="keys", **extra)


def _values(bits: int, split: bool) -> QuantSpec:
    """Values never carry QJL: plain TurboQuant (rotated), or its split, or uniform."""
    if bits == 4:
        return QuantSpec(bits=4, axis="token", path="values")
    extra = dict(extra_bits=0.5) if split else {}
    return QuantSpec(method="turboquant", bits=bits, path="values", **extra)


def _case(monkeypatch, bits: int, split: bool, head_dim: int, gqa: int, device: str, **kw):
    """`base.build_case` (RAGGED streams: empty, one token, block boundary, body only, long) for these sides."""
    name = f"turboquant-{bits}-qjl{'-split' if split else ''}"
    monkeypatch.setitem(base.SIDES, name, (_keys(bits, split), _values(bits, split)))
    return base.build_case(name, head_dim, gqa, device, **kw)


@pytest.mark.parametrize("device", base.devices())
@pytest.mark.parametrize("split", [False, True], ids=["one-instance", "outlier-split"])
@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("head_dim, gqa", [(64, 1), (64, 4), (128, 1), (128, 4)])
def test_decode_kernel_reads_the_qjl_residual_as_the_torch_path(monkeypatch, head_dim, gqa, bits, split, device):
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    args, reference = _case(monkeypatch, bits, split, head_dim, gqa, device, seed=head_dim + gqa + bits)
    assert args["formats"][0].qjl and not args["formats"][1].qjl
    out = paged_decode_attention(**args)
    torch.testing.assert_close(out.cpu(), reference, **TOLERANCE)


@pytest.mark.parametrize("device", base.devices())
@pytest.mark.parametrize("split", [False, True], ids=["one-instance", "outlier-split"])
@pytest.mark.parametrize("splits, tile", [(1, 16), (3, None)])
def test_qjl_with_token_tiles_splits_softcap_and_sinks(monkeypatch, split, splits, tile, device):
    """Blocks read in tiles of 16 tokens, flash-decoding splits, soft-capping and learned sinks: the QJL term goes
    into the logits before soft-capping, as the torch path's score does."""
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    args, reference = _case(monkeypatch, 3, split, 64, 4, device, softcap=5.0, sinks=True, seed=7)
    out = paged_decode_attention(**args, splits=splits, tile=tile)
    torch.testing.assert_close(out.cpu(), reference, **TOLERANCE)


@pytest.mark.parametrize("device", base.devices())
@pytest.mark.parametrize("split", [False, True], ids=["one-instance", "outlier-split"])
def test_the_qjl_term_is_what_brings_the_kernel_to_the_torch_path(monkeypatch, split, device):
    """The kernel ignoring the signs (format without ``qjl``) misses the reference by far, and reads exactly as the
    kernel with every residual norm zeroed (gamma = 0): the difference is the QJL term and nothing else."""
    from kvtool.runtime.kernels.decode_attention import paged_decode_attention

    args, reference = _case(monkeypatch, 3, split, 64, 4, device, seed=11)
    keys, values = args["body"]
    key_format, value_format = args["formats"]
    with_qjl = paged_decode_attention(**args).cpu()
    torch.testing.assert_close(with_qjl, reference, **TOLERANCE)
    ignored = paged_decode_attention(**{**args, "formats": (dataclasses.replace(key_format, qjl=False), value_format)}).cpu()
    assert (ignored - reference).abs().max() > 1e-2  # a hundred times the tolerance
    zeroed = {name: torch.zeros_like(t) if name.endswith("residual_norm") else t for name, t in keys.items()}
    assert sum(name.endswith("residual_norm") for name in zeroed) == (2 if split else 1)
    no_term = paged_decode_attention(**{**args, "body": (zeroed, values)}).cpu()
    torch.testing.assert_close(no_term, ignored, rtol=1e-6, atol=1e-6)


def test_the_kernel_format_says_qjl_and_values_are_refused():
    from kvtool.calibration import build_quantizers
    from kvtool.runtime.kernels.body_format import BodyFormat

    recipe = Recipe(name="tq", keys=_keys(3, True), values=_values(3, True))
    keys, values = build_quantizers(recipe, 64, torch.float32, {})
    assert keys.kernel_format().qjl and keys.kernel_format().split == 16 and not values.kernel_format().qjl
    tables = keys.kernel_tensors("cpu")["split_tables"]
    assert tables.numel() == 2**4 + 2 * (16 * 16 + 48 * 48)  # codebook, P_o, P_r, G_o P_o, G_r P_r
    with pytest.raises(ValueError, match="QJL residual is TurboQuant's"):
        BodyFormat(bits=3, per_channel=True, group=1, qjl=True)


QJL_RECIPES = {
    "turboquant-3bit-qjl": Recipe(
        name="tq3qjl", keys=_keys(3, False), values=QuantSpec(method="turboquant", bits=3, path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
    ),
    "turboquant-2.5bit-qjl": Recipe(  # the split: keys 8 of 32 channels at 4 bits (3 + QJL), 24 at 2 (1 + QJL)
        name="tq25qjl", keys=_keys(2, True), values=QuantSpec(method="turboquant", bits=2, extra_bits=0.5, path="values"),
        cache=CacheSpec(sink_tokens=2, recent_tokens=8, block_size=32),
    ),
}


@pytest.mark.parametrize("device", base.devices())
@pytest.mark.parametrize("name", list(QJL_RECIPES))
def test_triton_backend_generates_the_torch_backends_tokens_with_qjl_keys(name, device):
    model = tiny_model("llama", kv_heads=2).to(device)
    recipe = QJL_RECIPES[name]
    assert CompressedRuntime.from_recipe(model, recipe, backend="triton").backend == "triton"
    ids, mask = tiny_tokenizer_free_inputs(batch=2, seq=80)
    by_torch, _ = base._generate(model, recipe, "torch", ids, mask)
    by_triton, cache = base._generate(model, recipe, "triton", ids, mask)
    report = cache.memory_report()
    assert report["backend"] == "triton"
    assert report["kernel_steps"] >= 5 * model.config.num_hidden_layers  # the kernel really ran
    assert torch.equal(by_torch.sequences, by_triton.sequences)
    torch.testing.assert_close(torch.stack(by_triton.logits), torch.stack(by_torch.logits), rtol=1e-3, atol=1e-3)
