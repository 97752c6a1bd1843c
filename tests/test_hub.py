"""Sharing artifacts through the hub (`kvtool.hub`), never touching the network.

push: against a local-folder stand-in for `huggingface_hub.HfApi` (same method signatures).
pull / ``--artifact owner/name:file``: the real `huggingface_hub.hf_hub_download` in offline mode
over a hub cache laid out as huggingface_hub lays it out (refs/main -> snapshots/<commit>/file).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from typer.testing import CliRunner

from kvtool.artifact import Artifact, load_artifact, save_artifact
from kvtool.cli import app
from kvtool.errors import ArtifactError
from kvtool.hub import model_card, parse_hub_spec, push, resolve_artifact
from kvtool.recipe import load_recipe

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FolderHub:
    """create_repo / upload_file of `HfApi`, writing into ``root/owner/name/``."""

    def __init__(self, root: Path, fail: Exception | None = None) -> None:
        self.root, self.fail = root, fail

    def create_repo(self, repo_id, *, private=None, exist_ok=False, **kwargs):
        if self.fail is not None:
            raise self.fail
        (self.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)

    def upload_file(self, *, path_or_fileobj, path_in_repo, repo_id, commit_message=None, **kwargs):
        target = self.root / repo_id / path_in_repo
        if isinstance(path_or_fileobj, bytes):
            target.write_bytes(path_or_fileobj)
        else:
            shutil.copyfile(path_or_fileobj, target)


@pytest.fixture
def artifact(tmp_path) -> Path:
    manifest = {
        "model": {"family": "llama", "num_layers": 2, "num_kv_heads": 2, "head_dim": 32},
        "model_source": "HuggingFaceTB/SmolLM2-135M", "recipe": load_recipe("kivi-4bit").to_dict(),
        "calibration": {"data": "wikitext2_valid.txt[0:0.9]", "samples": 8, "seq_len": 512, "tokens": 4096, "seed": 0},
        "quality": {"keys_sqnr_db": 21.25, "values_sqnr_db": 18.5}, "expected_bits_per_element": {"keys": 4.5, "values": 4.5},
    }
    path = tmp_path / "model.kvt.safetensors"
    save_artifact(path, Artifact(kind="deployable", manifest=manifest, tensors={"layers.0.keys.sqnr_db": torch.ones(2)}))
    return path


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub-cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def publish_to_cache(cache: Path, hub_root: Path, repo_id: str) -> None:
    """What a download would have left: the repo's files under snapshots/<commit>/, refs/main -> commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(hub_root / repo_id, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


def test_push_uploads_the_artifact_and_a_model_card(tmp_path, artifact):
    hub = FolderHub(tmp_path / "hub")
    spec = push(artifact, "someone/smollm2-kivi", api=hub)
    assert spec == "someone/smollm2-kivi:model.kvt.safetensors"
    uploaded = tmp_path / "hub/someone/smollm2-kivi"
    assert load_artifact(uploaded / "model.kvt.safetensors").manifest["quality"]["keys_sqnr_db"] == 21.25
    card = (uploaded / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: kvtool") and "`kivi-4bit`" in card
    assert "wikitext2_valid.txt[0:0.9]" in card and "keys_sqnr_db 21.2" in card and "HuggingFaceTB/SmolLM2-135M" in card


def test_pull_through_huggingface_hub_and_load_by_hub_id(tmp_path, artifact, offline_cache):
    hub = FolderHub(tmp_path / "hub")
    push(artifact, "someone/smollm2-kivi", api=hub)
    publish_to_cache(offline_cache, tmp_path / "hub", "someone/smollm2-kivi")
    path = resolve_artifact("someone/smollm2-kivi:model.kvt.safetensors")
    assert path.is_file() and COMMIT in str(path)
    loaded = load_artifact("someone/smollm2-kivi:model.kvt.safetensors")  # what every --artifact option calls
    assert torch.equal(loaded.tensors["layers.0.keys.sqnr_db"], torch.ones(2))
    result = CliRunner().invoke(app, ["pull", "someone/smollm2-kivi:model.kvt.safetensors", "--out", str(tmp_path / "copy.safetensors")])
    assert result.exit_code == 0, result.output
    assert load_artifact(tmp_path / "copy.safetensors").kind == "deployable"


def test_offline_without_a_cached_copy_is_a_clear_error(offline_cache):
    with pytest.raises(ArtifactError, match="cannot get 'm.safetensors' from hub repo 'someone/absent'.*offline"):
        load_artifact("someone/absent:m.safetensors")
    result = CliRunner().invoke(app, ["pull", "someone/absent:m.safetensors"])
    assert result.exit_code == 2 and "offline" in result.stderr and "Traceback" not in result.output


def test_push_failures_are_kvtool_errors(tmp_path, artifact):
    with pytest.raises(ArtifactError, match="cannot push .* to hub repo 'a/b': ConnectionError.*network"):
        push(artifact, "a/b", api=FolderHub(tmp_path, fail=ConnectionError("no route to host")))
    with pytest.raises(ArtifactError, match="not a hub repository id"):
        push(artifact, "no-owner", api=FolderHub(tmp_path))
    corrupt = tmp_path / "bad.safetensors"
    corrupt.write_bytes(artifact.read_bytes()[:-3])
    with pytest.raises(ArtifactError, match="truncated or corrupt"):
        push(corrupt, "a/b", api=FolderHub(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_hub_specs():
    assert parse_hub_spec("o/n:f.safetensors") == ("o/n", "f.safetensors", None)
    assert parse_hub_spec("o/n:sub/f.safetensors@v1.0") == ("o/n", "sub/f.safetensors", "v1.0")
    assert parse_hub_spec("local/file.safetensors") is None and parse_hub_spec("o/n:f.bin") is None


def test_card_command_prints_the_markdown(artifact):
    result = CliRunner().invoke(app, ["card", str(artifact)])
    assert result.exit_code == 0 and result.stdout.strip() == model_card(load_artifact(artifact).manifest).strip()
    assert "## kvtool KV-cache compression" in result.stdout and "4-bit per channel" in result.stdout


def test_inspect_markdown_prints_the_card(artifact):
    """`kvtool inspect --markdown` is the same model-card section as `kvtool card`; with --json it is a usage error."""
    result = CliRunner().invoke(app, ["inspect", str(artifact), "--markdown"])
    assert result.exit_code == 0 and result.stdout.strip() == model_card(load_artifact(artifact).manifest).strip()
    both = CliRunner().invoke(app, ["inspect", str(artifact), "--markdown", "--json"])
    assert both.exit_code == 2 and "pass one of them" in both.output and "Traceback" not in both.output
