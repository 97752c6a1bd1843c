"""Artifacts: exact save/load, atomic writes, and errors that say what is wrong with the file."""

import json
import os

import pytest
import safetensors.torch
import torch

from kvtool import __version__
from kvtool.artifact import (
    FORMAT,
    Artifact,
    check_model,
    load_artifact,
    save_artifact,
    tensors_sha256,
)
from kvtool.errors import ArtifactError, KvtoolError
from kvtool.models.adapter import adapter_for
from tests.tiny_models import tiny_model

MANIFEST = {"recipe": {"name": "t", "keys": {"bits": 4}}, "calibration": {"samples": 2}, "expected_bits_per_element": 5.0}


def sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "layers.0.keys.scale": torch.randn(2, 32, generator=generator).to(torch.float16),
        "layers.0.keys.codes": torch.randint(-(2**31), 2**31 - 1, (2, 8), generator=generator, dtype=torch.int64).to(torch.int32),
        "layers.1.values.absmax": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        "layers.1.values.bytes": torch.randint(0, 256, (17,), generator=generator, dtype=torch.int64).to(torch.uint8),
        "quality.sqnr_db": torch.randn(4, generator=generator),
        "positions": torch.arange(6, dtype=torch.int64).view(2, 3),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False, True]),
    }


def files_in(folder) -> list[str]:
    return sorted(os.listdir(folder))


@pytest.fixture
def saved(tmp_path):
    path = save_artifact(tmp_path / "a.kvt", Artifact("deployable", dict(MANIFEST), sample_tensors()))
    return path


# ----- round trip ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["profile", "calibration", "deployable"])
def test_round_trip_exact(tmp_path, kind):
    tensors = sample_tensors()
    path = save_artifact(tmp_path / "sub" / "a.kvt", Artifact(kind, dict(MANIFEST), tensors))
    loaded = load_artifact(path, expect_kind=kind)
    assert loaded.kind == kind
    assert loaded.tensors.keys() == tensors.keys()
    for name, tensor in tensors.items():
        got = loaded.tensors[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name
    for key, value in MANIFEST.items():
        assert loaded.manifest[key] == value
    assert loaded.manifest["kind"] == kind
    assert loaded.manifest["kvtool_version"] == __version__
    assert loaded.manifest["tensors_sha256"] == tensors_sha256(tensors)
    assert files_in(path.parent) == ["a.kvt"]


def test_round_trip_empty_tensor_dict(tmp_path):
    path = save_artifact(tmp_path / "e.kvt", Artifact("profile", {"note": "nothing"}, {}))
    loaded = load_artifact(path)
    assert loaded.tensors == {}
    assert loaded.manifest["note"] == "nothing"


def test_non_contiguous_and_grad_tensors_saved(tmp_path):
    base = torch.randn(4, 6, requires_grad=True)
    tensors = {"t": base.t(), "s": base[:, ::2]}
    path = save_artifact(tmp_path / "a.kvt", Artifact("profile", {}, tensors))
    loaded = load_artifact(path)
    for name, tensor in tensors.items():
        assert torch.equal(loaded.tensors[name], tensor.detach()), name


def test_overwrite_replaces(tmp_path):
    path = tmp_path / "a.kvt"
    save_artifact(path, Artifact("profile", {"v": 1}, {"x": torch.zeros(3)}))
    save_artifact(path, Artifact("profile", {"v": 2}, {"x": torch.ones(3)}))
    loaded = load_artifact(path)
    assert loaded.manifest["v"] == 2 and torch.equal(loaded.tensors["x"], torch.ones(3))
    assert files_in(tmp_path) == ["a.kvt"]


def test_layer_tensors():
    artifact = Artifact("deployable", {}, sample_tensors())
    assert set(artifact.layer_tensors(0)) == {"keys.scale", "keys.codes"}
    assert set(artifact.layer_tensors(1)) == {"values.absmax", "values.bytes"}
    assert artifact.layer_tensors(7) == {}


def test_unknown_kind_rejected():
    with pytest.raises(ArtifactError, match=r"artifact kind 'bogus' is not one of"):
        Artifact("bogus", {})


def test_scalar_tensor_round_trip(tmp_path):
    path = save_artifact(tmp_path / "s.kvt", Artifact("profile", {}, {"count": torch.tensor(3.0)}))
    assert torch.equal(load_artifact(path).tensors["count"], torch.tensor(3.0))


# ----- atomic write -------------------------------------------------------------------------


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = save_artifact(tmp_path / "a.kvt", Artifact("profile", {"v": "good"}, {"x": torch.arange(4)}))
    before = path.read_bytes()

    def failing_save(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:  # a partial file, then the crash
            handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    with pytest.raises(KvtoolError, match=r"cannot write '.*a\.kvt': disk full"):
        save_artifact(path, Artifact("profile", {"v": "bad"}, {"x": torch.zeros(4)}))
    assert path.read_bytes() == before
    assert files_in(tmp_path) == ["a.kvt"]
    monkeypatch.undo()
    assert load_artifact(path).manifest["v"] == "good"


def test_failed_first_write_leaves_nothing(tmp_path, monkeypatch):
    def failing_save(tensors, filename, metadata=None):
        raise RuntimeError("boom")  # not an OSError: propagates as is, still cleaned up

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    with pytest.raises(RuntimeError, match="boom"):
        save_artifact(tmp_path / "new.kvt", Artifact("profile", {}, {"x": torch.zeros(2)}))
    assert files_in(tmp_path) == []


# ----- errors -------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(ArtifactError, match=r"'.*nope\.kvt' does not exist"):
        load_artifact(tmp_path / "nope.kvt")


def test_cannot_save_over_a_folder(tmp_path):
    (tmp_path / "out.kvt").mkdir()
    with pytest.raises(KvtoolError, match=r"is a folder"):
        save_artifact(tmp_path / "out.kvt", Artifact("profile", {}, {}))


def test_directory_is_not_an_artifact(tmp_path):
    with pytest.raises(ArtifactError, match=r"does not exist"):
        load_artifact(tmp_path)


def test_truncated_file(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match=r"truncated or corrupt"):
        load_artifact(saved)


def test_truncated_by_a_few_bytes(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[:-3])
    with pytest.raises(ArtifactError, match=r"truncated or corrupt"):
        load_artifact(saved)


def test_random_bytes(tmp_path):
    path = tmp_path / "junk.kvt"
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(ArtifactError, match=r"not a readable safetensors file"):
        load_artifact(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.kvt"
    path.write_bytes(b"")
    with pytest.raises(ArtifactError, match=r"not a readable safetensors file"):
        load_artifact(path)


def test_plain_safetensors_without_metadata(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"w": torch.ones(2)}, str(path))
    with pytest.raises(ArtifactError, match=rf"not a kvtool artifact \(no '{FORMAT}' header\)"):
        load_artifact(path)


def test_foreign_metadata(tmp_path):
    path = tmp_path / "other.safetensors"
    safetensors.torch.save_file({"w": torch.ones(2)}, str(path), metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match=r"not a kvtool artifact"):
        load_artifact(path)


def test_future_format_version(tmp_path):
    tensors = {"w": torch.ones(2)}
    manifest = {"kind": "profile", "tensors_sha256": tensors_sha256(tensors)}
    path = tmp_path / "v99.kvt"
    metadata = {"format": FORMAT, "format_version": "99", "manifest": json.dumps(manifest)}
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ArtifactError, match=r"format version 99; this kvtool reads version 1"):
        load_artifact(path)


@pytest.mark.parametrize("manifest", [None, "{not json"])
def test_missing_or_corrupt_manifest(tmp_path, manifest):
    path = tmp_path / "m.kvt"
    metadata = {"format": FORMAT, "format_version": "1"}
    if manifest is not None:
        metadata["manifest"] = manifest
    safetensors.torch.save_file({"w": torch.ones(2)}, str(path), metadata=metadata)
    with pytest.raises(ArtifactError, match=r"missing or corrupt manifest"):
        load_artifact(path)


def test_flipped_data_byte_fails_checksum(saved):
    data = bytearray(saved.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    data_start = 8 + header_len
    assert len(data) > data_start + 10
    position = data_start + (len(data) - data_start) // 2
    data[position] ^= 0xFF
    saved.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"corrupt: its tensors do not match the checksum"):
        load_artifact(saved)


def test_edited_manifest_checksum_fails(tmp_path):
    tensors = {"w": torch.ones(2)}
    manifest = {"kind": "profile", "tensors_sha256": tensors_sha256({"w": torch.zeros(2)})}
    path = tmp_path / "c.kvt"
    metadata = {"format": FORMAT, "format_version": "1", "manifest": json.dumps(manifest)}
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ArtifactError, match=r"do not match the checksum"):
        load_artifact(path)


def test_checksum_covers_names_dtypes_shapes():
    base = {"a": torch.arange(4, dtype=torch.int32)}
    digest = tensors_sha256(base)
    assert tensors_sha256({"b": base["a"]}) != digest
    assert tensors_sha256({"a": base["a"].view(torch.float32)}) != digest  # same bytes, other dtype
    assert tensors_sha256({"a": base["a"].view(2, 2)}) != digest  # same bytes, other shape
    assert tensors_sha256({"a": base["a"].clone()}) == digest


def test_wrong_kind(saved):
    with pytest.raises(ArtifactError, match=r"is a deployable artifact; this command needs a profile artifact"):
        load_artifact(saved, expect_kind="profile")
    with pytest.raises(ArtifactError, match=r"needs a profile or calibration artifact"):
        load_artifact(saved, expect_kind=("profile", "calibration"))
    assert load_artifact(saved, expect_kind=("calibration", "deployable")).kind == "deployable"


# ----- model fingerprint --------------------------------------------------------------------


@pytest.fixture(scope="module")
def fingerprints():
    return {
        "base": adapter_for(tiny_model("llama", seed=0)).fingerprint(),
        "same": adapter_for(tiny_model("llama", seed=0)).fingerprint(),
        "other_seed": adapter_for(tiny_model("llama", seed=1)).fingerprint(),
        "more_kv_heads": adapter_for(tiny_model("llama", seed=0, kv_heads=4)).fingerprint(),
    }


def artifact_for(fingerprint, tmp_path):
    """Save and reload, so the fingerprint went through JSON as in real use."""
    manifest = {"model": fingerprint, "model_source": "tiny-llama"}
    return load_artifact(save_artifact(tmp_path / "m.kvt", Artifact("deployable", manifest, {"x": torch.ones(1)})))


def test_same_model_passes(fingerprints, tmp_path):
    assert fingerprints["base"] == fingerprints["same"]
    check_model(artifact_for(fingerprints["base"], tmp_path), fingerprints["same"])


def test_different_weights_named(fingerprints, tmp_path):
    artifact = artifact_for(fingerprints["base"], tmp_path)
    with pytest.raises(ArtifactError, match=r"made for a different model \(tiny-llama\)") as info:
        check_model(artifact, fingerprints["other_seed"])
    message = str(info.value)
    assert "kv_weights: the K/V projection weights differ (layer " in message and "% RMS difference" in message
    assert "num_kv_heads" not in message and "head_dim" not in message  # only what differs


def test_different_kv_heads_named(fingerprints, tmp_path):
    artifact = artifact_for(fingerprints["base"], tmp_path)
    with pytest.raises(ArtifactError, match=r"num_kv_heads: artifact has 2, model has 4"):
        check_model(artifact, fingerprints["more_kv_heads"], source="calibration")


def test_missing_fingerprint(tmp_path):
    artifact = Artifact("deployable", {})
    with pytest.raises(ArtifactError, match=r"the calibration has no model fingerprint"):
        check_model(artifact, {"family": "llama"}, source="calibration")
