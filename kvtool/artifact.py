"""kvtool artifacts: one safetensors file with a JSON manifest in its metadata.

Three kinds share this format: ``profile`` (from `kvtool profile`),
``calibration`` (from `kvtool calibrate`) and ``deployable`` (from
`kvtool export`, what the runtime loads). Tensor names are hierarchical and
stable, e.g. ``layers.3.keys_pre_rope.absmax`` or ``layers.3.keys.sqnr_db``.

safetensors metadata is string-only, so it holds three entries:
``format`` = "kvtool.artifact", ``format_version`` = "1" and ``manifest`` =
JSON with at least: kind, kvtool_version, model (fingerprint), recipe (resolved),
calibration (provenance), expected_bits_per_element, tensors_sha256.

Loading validates the header, the version and a checksum over every tensor
before anything touches a model; `check_model` compares the fingerprint.
Writes are atomic (temporary file in the same folder, fsync, rename). Never pickle.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtool.errors import ArtifactError
from kvtool.fileio import atomic_write

FORMAT = "kvtool.artifact"
FORMAT_VERSION = 1
KINDS = ("profile", "calibration", "deployable")


@dataclass(frozen=True)
class Artifact:
    """In-memory artifact: a manifest (JSON-able dict) and named tensors."""

    kind: str
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ArtifactError(f"artifact kind '{self.kind}' is not one of {list(KINDS)}")

    def layer_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """Tensors of one layer with the ``layers.{i}.`` prefix removed."""
        prefix = f"layers.{layer}."
        return {k[len(prefix) :]: v for k, v in self.tensors.items() if k.startswith(prefix)}


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """Checksum over names, dtypes, shapes and bytes of every tensor, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def save_artifact(path: str | Path, artifact: Artifact) -> Path:
    """Write atomically: temp file next to ``path``, fsync, then rename over it."""
    from safetensors.torch import save_file

    from kvtool import __version__

    path = Path(path)
    tensors = {k: v.detach().cpu().contiguous() for k, v in artifact.tensors.items()}
    manifest = {
        **artifact.manifest,
        "kind": artifact.kind,
        "kvtool_version": __version__,
        "tensors_sha256": tensors_sha256(tensors),
    }
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "manifest": json.dumps(manifest)}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    return path


def _read_header(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return handle.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise ArtifactError(
            f"'{path}' is not a readable safetensors file (truncated or corrupt: {exc}); re-run the command that wrote it"
        ) from exc


def _parse_manifest(path: Path, metadata: dict[str, str]) -> dict[str, Any]:
    if metadata.get("format") != FORMAT:
        raise ArtifactError(f"'{path}' is a safetensors file but not a kvtool artifact (no '{FORMAT}' header)")
    version = metadata.get("format_version", "?")
    if version != str(FORMAT_VERSION):
        raise ArtifactError(
            f"'{path}' has artifact format version {version}; this kvtool reads version {FORMAT_VERSION}: "
            "upgrade kvtool or re-export the artifact"
        )
    try:
        manifest = json.loads(metadata["manifest"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"'{path}' has a missing or corrupt manifest ({exc}); re-export the artifact") from exc
    if not isinstance(manifest, dict):
        raise ArtifactError(f"'{path}' has a corrupt manifest (a JSON {type(manifest).__name__}, not an object); re-export the artifact")
    return manifest


def load_artifact(path: str | Path, expect_kind: str | tuple[str, ...] | None = None) -> Artifact:
    """Read and validate an artifact; errors name the file and what is wrong with it."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        from kvtool.hub import parse_hub_spec, resolve_artifact

        if parse_hub_spec(str(path)) is None:
            raise ArtifactError(f"artifact '{path}' does not exist")
        path = resolve_artifact(str(path))
    manifest = _parse_manifest(path, _read_header(path))
    try:
        tensors = load_file(str(path))
    except Exception as exc:
        raise ArtifactError(f"'{path}' is truncated or corrupt ({exc}); re-run the command that wrote it") from exc
    if tensors_sha256(tensors) != manifest.get("tensors_sha256"):
        raise ArtifactError(f"'{path}' is corrupt: its tensors do not match the checksum in its manifest")
    kind = manifest.get("kind")
    if kind not in KINDS:
        raise ArtifactError(f"'{path}' has artifact kind {json.dumps(kind)}, not one of {list(KINDS)}: its manifest is corrupt; re-export it")
    kinds = (expect_kind,) if isinstance(expect_kind, str) else expect_kind
    if kinds and kind not in kinds:
        raise ArtifactError(f"'{path}' is a {kind} artifact; this command needs a {' or '.join(kinds)} artifact")
    return Artifact(kind=kind, manifest=manifest, tensors=tensors)


def check_model(artifact: Artifact, fingerprint: dict[str, Any], source: str = "artifact") -> None:
    """Refuse an artifact made for another model, naming every field that differs."""
    from kvtool.models.adapter import compare_fingerprints

    expected = artifact.manifest.get("model")
    if not expected:
        raise ArtifactError(f"the {source} has no model fingerprint in its manifest; re-export it")
    mismatches = compare_fingerprints(expected, fingerprint)
    if mismatches:
        made_for = artifact.manifest.get("model_source", "another model")
        raise ArtifactError(
            f"the {source} was made for a different model ({made_for}): "
            + "; ".join(mismatches)
            + ". Pass --model with the model it was calibrated on, or calibrate and export again for this model."
        )
