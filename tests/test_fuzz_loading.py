"""Property-based fuzzing (hypothesis) of what kvtool reads from disk: artifacts and recipes.

Property: whatever the bytes, `load_artifact` / `load_recipe` either succeed or raise kvtool's
own error (a `KvtoolError` subclass) with a message that names the file or the field; never a
KeyError, TypeError, UnicodeDecodeError, a safetensors or yaml exception, or a crash. A
corrupted tensor payload is always refused (the manifest's checksum), never returned.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvtool.artifact import Artifact, load_artifact, save_artifact
from kvtool.errors import ArtifactError, KvtoolError, RecipeError
from kvtool.recipe import Recipe, load_recipe, recipe_from_dict

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def artifact_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("a") / "good.safetensors"
    tensors = {"layers.0.keys.codebook": torch.linspace(-1, 1, 16), "layers.0.values.sqnr_db": torch.tensor([21.5, 19.0])}
    manifest = {"model": {"num_layers": 1}, "recipe": Recipe().to_dict(), "calibration": {"samples": 2}}
    save_artifact(path, Artifact(kind="calibration", manifest=manifest, tensors=tensors))
    return path.read_bytes()


def split(blob: bytes) -> tuple[int, dict, bytes]:
    """(header length, header JSON, tensor payload) of a safetensors file."""
    n = struct.unpack("<Q", blob[:8])[0]
    return n, json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join(header: dict, payload: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + payload


def load_or_kvtool_error(path, blob: bytes):
    path.write_bytes(blob)
    try:
        return load_artifact(path)
    except ArtifactError as exc:
        assert str(path) in str(exc) and len(str(exc)) > 20
        return None


def test_the_intact_artifact_loads(tmp_path, artifact_bytes):
    assert load_or_kvtool_error(tmp_path / "a.safetensors", artifact_bytes).kind == "calibration"


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(tmp_path, blob):
    assert load_or_kvtool_error(tmp_path / "r.safetensors", blob) is None


@FUZZ
@given(cut=st.integers(min_value=0))
def test_truncated(tmp_path, artifact_bytes, cut):
    blob = artifact_bytes[: cut % len(artifact_bytes)]
    assert load_or_kvtool_error(tmp_path / "t.safetensors", blob) is None


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)), min_size=1, max_size=4))
def test_flipped_payload_bytes_are_refused(tmp_path, artifact_bytes, flips):
    n, header, payload = split(artifact_bytes)
    body = bytearray(payload)
    for where, mask in flips:
        body[where % len(body)] ^= mask
    assume(bytes(body) != payload)  # two flips of one byte may cancel
    assert load_or_kvtool_error(tmp_path / "p.safetensors", artifact_bytes[: 8 + n] + bytes(body)) is None


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)), min_size=1, max_size=4))
def test_flipped_header_bytes(tmp_path, artifact_bytes, flips):
    blob = bytearray(artifact_bytes)
    n = struct.unpack("<Q", artifact_bytes[:8])[0]
    for where, mask in flips:
        blob[where % (8 + n)] ^= mask
    load_or_kvtool_error(tmp_path / "h.safetensors", bytes(blob))  # loads (a harmless change) or a kvtool error


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                       max_leaves=8)


@FUZZ
@given(key=st.sampled_from(["format", "format_version", "manifest", "other"]), value=JSONISH)
def test_mutated_metadata(tmp_path, artifact_bytes, key, value):
    _, header, payload = split(artifact_bytes)
    header["__metadata__"][key] = value if isinstance(value, str) else json.dumps(value)
    load_or_kvtool_error(tmp_path / "m.safetensors", join(header, payload))


@FUZZ
@given(field=st.sampled_from(["kind", "tensors_sha256", "model", "recipe", "kvtool_version"]), value=JSONISH)
def test_mutated_manifest(tmp_path, artifact_bytes, field, value):
    _, header, payload = split(artifact_bytes)
    manifest = json.loads(header["__metadata__"]["manifest"])
    manifest[field] = value
    header["__metadata__"]["manifest"] = json.dumps(manifest)
    loaded = load_or_kvtool_error(tmp_path / "f.safetensors", join(header, payload))
    if field in ("kind", "tensors_sha256") and loaded is not None:
        assert loaded.manifest[field] == json.loads(split(artifact_bytes)[1]["__metadata__"]["manifest"])[field]


def test_manifest_that_is_not_a_mapping(tmp_path, artifact_bytes):
    _, header, payload = split(artifact_bytes)
    header["__metadata__"]["manifest"] = "[1, 2]"
    with pytest.raises(ArtifactError, match="manifest"):
        (tmp_path / "l.safetensors").write_bytes(join(header, payload))
        load_artifact(tmp_path / "l.safetensors")


# --- recipes -----------------------------------------------------------------------------------


@FUZZ
@given(text=st.text(max_size=300))
def test_random_recipe_text(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    try:
        load_recipe(path)
    except RecipeError as exc:
        assert str(exc)


@FUZZ
@given(blob=st.binary(max_size=200))
def test_random_recipe_bytes(tmp_path, blob):
    path = tmp_path / "b.yaml"
    path.write_bytes(blob)
    try:
        load_recipe(path)
    except RecipeError as exc:
        assert str(exc)


BASE = Recipe().to_dict()
FIELDS = [(section, name) for section, values in BASE.items() if isinstance(values, dict) for name in values]


@FUZZ
@given(field=st.sampled_from(FIELDS), value=JSONISH)
def test_mutated_recipe_fields(field, value):
    raw = json.loads(json.dumps(BASE))
    raw[field[0]][field[1]] = value
    try:
        recipe = recipe_from_dict(raw)
    except RecipeError as exc:
        assert f"{field[0]}" in str(exc) or field[1] in str(exc), str(exc)
    else:
        assert recipe_from_dict(yaml.safe_load(yaml.safe_dump(recipe.to_dict()))) == recipe


@FUZZ
@given(raw=JSONISH)
def test_any_document_as_a_recipe(raw):
    try:
        recipe_from_dict(raw)
    except KvtoolError as exc:
        assert str(exc)


_WRITER = """
import sys, torch
from kvtool.artifact import Artifact, save_artifact
value = float(sys.argv[2])
for _ in range(20):
    save_artifact(sys.argv[1], Artifact(kind="calibration", manifest={"writer": value},
                                        tensors={"x": torch.full((4096,), value)}))
"""


def test_two_processes_writing_one_out_never_leave_a_corrupt_artifact(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "same.safetensors"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(out), str(v)], env=env) for v in (1.0, 2.0)]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    loaded = load_artifact(out)  # one writer's complete file, never a mix
    assert torch.equal(loaded.tensors["x"], torch.full((4096,), loaded.manifest["writer"]))
    assert [p.name for p in tmp_path.iterdir()] == ["same.safetensors"]  # no temporary files left
