"""What a model fingerprint identifies: one checkpoint in any float dtype, never another checkpoint."""

import re

import pytest
import torch

from kvtool.artifact import Artifact, check_model
from kvtool.errors import ArtifactError
from kvtool.models.adapter import adapter_for
from kvtool.models.fingerprint import SAME_WEIGHTS_RMS, compare_fingerprints, kv_weights_sketch, weights_difference
from tests.conftest import shared_path
from tests.tiny_models import tiny_model


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return weights_difference(kv_weights_sketch([a]), kv_weights_sketch([b]))[0]


def test_sketch_is_pinned():
    """Artifacts store sketches: the sign hash and the layout must never change silently."""
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5.5
    sketch = kv_weights_sketch([weight])[0]
    assert len(sketch) == 17
    assert sketch[0] == pytest.approx(3.4520525, rel=1e-7)
    assert sketch[1:5] == pytest.approx([-1.1547005, 4.9074773, -4.330127, 1.7320508], rel=1e-6)


@pytest.mark.parametrize("dtypes", [(torch.float16,), (torch.bfloat16,), (torch.float16, torch.bfloat16)])
def test_rounding_to_16_bit_floats_is_the_same_weights(dtypes):
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    rounded = weight
    for dtype in dtypes:
        rounded = rounded.to(dtype)
    assert _difference(weight, rounded) < SAME_WEIGHTS_RMS / 2


@pytest.mark.parametrize("relative_change", [0.02, 0.1, 1.0])
def test_changed_or_other_weights_are_not_the_same(relative_change):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 512, generator=gen) * 0.02
    other = weight + relative_change * weight.std() * torch.randn(256, 512, generator=gen)
    assert _difference(weight, other) > SAME_WEIGHTS_RMS
    assert _difference(weight, other) == pytest.approx(relative_change, rel=0.5)


def test_another_checkpoint_of_the_same_geometry_is_refused():
    first, second = (adapter_for(tiny_model("llama", seed=seed)).fingerprint() for seed in (0, 1))
    [line] = compare_fingerprints(first, second)
    assert re.match(r"kv_weights: the K/V projection weights differ \(layer \d (keys|values): \d+\.\d% RMS difference", line)


def test_an_artifact_from_an_older_kvtool_is_compared_by_its_exact_hash():
    fingerprint = adapter_for(tiny_model("llama", seed=0)).fingerprint()
    legacy = {k: v for k, v in fingerprint.items() if k != "kv_weights_sketch"}
    assert compare_fingerprints(legacy, fingerprint) == []  # the same load: accepted as before
    in_fp16 = adapter_for(tiny_model("llama", seed=0).to(torch.float16)).fingerprint()
    [line] = compare_fingerprints(legacy, in_fp16)
    assert line.startswith("kv_weights_sha256: artifact has ")
    assert "older kvtool" in line and "calibrate and export again" in line


@pytest.fixture(scope="module")
def kvref_fingerprints():
    """The embedded default model (float16 file) and ../shared kvref-5m (float32 file) in several dtypes."""
    from kvtool.models.loading import load_model

    shared = str(shared_path("models/kvref-5m"))
    loads = {"default": (None, "auto"), "shared": (shared, "auto"), "shared-bf16": (shared, "bfloat16"),
             "shared-fp16": (shared, "float16"), "default-bf16": (None, "bfloat16")}
    return {name: adapter_for(load_model(path, dtype=dtype, tokenizer=False)[0]).fingerprint()
            for name, (path, dtype) in loads.items()}


@pytest.mark.parametrize("other", ["shared", "shared-bf16", "shared-fp16", "default-bf16"])
def test_the_embedded_default_model_is_kvref_5m(kvref_fingerprints, other):
    """An artifact made on the default model loads on ../shared/models/kvref-5m, in any dtype, and back."""
    made_on_default = Artifact("deployable", {"model": kvref_fingerprints["default"], "model_source": "kvtool:default-model"})
    check_model(made_on_default, kvref_fingerprints[other])
    check_model(Artifact("deployable", {"model": kvref_fingerprints[other]}), kvref_fingerprints["default"])


def test_a_fine_tuned_kvref_is_refused(kvref_fingerprints):
    from kvtool.models.loading import load_model

    model, _ = load_model(str(shared_path("models/kvref-5m")), tokenizer=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + 0.03 * torch.randn(param.shape, generator=gen))  # 3% RMS change everywhere
    made_on_default = Artifact("deployable", {"model": kvref_fingerprints["default"], "model_source": "kvtool:default-model"})
    with pytest.raises(ArtifactError, match=r"made for a different model \(kvtool:default-model\): kv_weights: .*% RMS"):
        check_model(made_on_default, adapter_for(model).fingerprint())
