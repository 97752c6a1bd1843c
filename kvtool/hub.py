"""Share artifacts through a Hugging Face hub repository (`huggingface_hub`).

* `push(artifact, repo_id)`: validates the artifact, uploads it and a ``README.md`` model card
  whose kvtool section (`model_card`) says which recipe, which model, what quality was
  measured on what data; the card is also what ``kvtool card ARTIFACT`` prints.
* `resolve_artifact("owner/name:file.safetensors[@revision]")`: downloads (or finds in the local
  hub cache) and returns a local path; `kvtool.artifact.load_artifact` calls it for any path
  that does not exist and has this form, so every ``--artifact`` option accepts hub ids.

Network failures, missing repos/files and offline mode (``HF_HUB_OFFLINE=1`` with nothing
cached) become one-line `ArtifactError`s naming the repo, the file and the fix.

Hub ids of models (`check_model_option`, `check_hub_reachable`) are checked here too, without
torch: the CLI imports this module before torch and transformers, so that an unreachable hub id
fails in about a second, with one line.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvtool.data import DataSpec
from kvtool.errors import ArtifactError, ModelError

HUB_SPEC = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+):(?P<file>[^@:]+\.safetensors)(?:@(?P<rev>[\w./-]+))?$")


def parse_hub_spec(spec: str) -> tuple[str, str, str | None] | None:
    """("owner/name", "file.safetensors", revision or None) for a hub spec, else None."""
    match = HUB_SPEC.match(str(spec))
    return (match["repo"], match["file"], match["rev"]) if match else None


def _hub_failure(what: str, exc: Exception) -> ArtifactError:
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, LocalEntryNotFoundError):
        return ArtifactError(f"{what}: not in the local hub cache and the hub cannot be reached (offline?); "
                             "connect (unset HF_HUB_OFFLINE) or copy the file and pass its path")
    if isinstance(exc, RepositoryNotFoundError):
        return ArtifactError(f"{what}: the repository does not exist or needs a token (`hf auth login`)")
    if isinstance(exc, RevisionNotFoundError):
        return ArtifactError(f"{what}: no such revision; check the @revision")
    if isinstance(exc, EntryNotFoundError):
        return ArtifactError(f"{what}: no such file in the repository; check the file name")
    return ArtifactError(f"{what}: {type(exc).__name__}: {exc}; check the network and the repository id")


def resolve_artifact(spec: str, *, cache_dir: str | Path | None = None) -> Path:
    """Local path of a hub artifact ``owner/name:file.safetensors[@revision]`` (downloaded once, then cached)."""
    from huggingface_hub import hf_hub_download

    parsed = parse_hub_spec(spec)
    if parsed is None:
        raise ArtifactError(f"'{spec}' is not a hub artifact: write it as owner/name:file.safetensors[@revision]")
    repo, filename, revision = parsed
    try:
        return Path(hf_hub_download(repo, filename, revision=revision, cache_dir=cache_dir))
    except Exception as exc:  # huggingface_hub and requests raise many types; all become one message
        raise _hub_failure(f"cannot get '{filename}' from hub repo '{repo}'", exc) from exc


def model_card(manifest: dict) -> str:
    """Markdown section describing an artifact: recipe, model, calibration data, measured quality."""
    recipe = manifest.get("recipe", {}) or {}
    model = manifest.get("model", {}) or {}
    calibration = manifest.get("calibration", {}) or {}
    lines = [
        "## kvtool KV-cache compression",
        "",
        f"- **artifact kind**: {manifest.get('kind', '?')} (kvtool {manifest.get('kvtool_version', '?')})",
        f"- **recipe**: `{recipe.get('name', '?')}` — {recipe.get('description', '') or 'no description'}",
        f"- **keys**: {_part(recipe.get('keys', {}))}; **values**: {_part(recipe.get('values', {}))}",
        f"- **model**: {manifest.get('model_source', '?')} ({model.get('family', '?')}, {model.get('num_layers', '?')} layers, "
        f"{model.get('num_kv_heads', '?')} KV heads, head dim {model.get('head_dim', '?')})",
    ]
    bits = manifest.get("expected_bits_per_element") or {}
    if bits:
        lines.append("- **expected bits per element (body)**: " + ", ".join(f"{k} {_num(v)}" for k, v in bits.items()))
    if calibration:
        lines.append(f"- **calibrated on**: {DataSpec.label_of(calibration.get('data', '?'))} — {calibration.get('samples', '?')} windows x "
                     f"{calibration.get('seq_len', '?')} tokens ({calibration.get('tokens', '?')} tokens, seed {calibration.get('seed', '?')})")
    quality = manifest.get("quality") or {}
    if quality:
        lines.append("- **measured quality (on the calibration data)**: " + ", ".join(f"{k} {_num(v)}" for k, v in quality.items()))
    if manifest.get("profile"):
        lines.append(f"- **attention profile from**: {DataSpec.label_of(manifest['profile'].get('data', '?'))}")
    lines += ["", "Use: `kvtool generate --artifact OWNER/NAME:FILE.safetensors --model MODEL --prompt \"...\"`, "
              "or `kvtool.load(model, path)` in Python.", ""]
    return "\n".join(lines)


def _part(spec: dict) -> str:
    if not spec:
        return "?"
    if spec.get("method") == "none":
        return "float"
    return f"{spec.get('method')} {spec.get('bits')}-bit per {spec.get('axis')}"


def _num(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def push(artifact: str | Path, repo_id: str, *, filename: str | None = None, private: bool = False,
         token: str | None = None, api=None) -> str:
    """Upload a validated artifact and its model card to ``repo_id``; returns the hub spec to load it with.

    api: an object with `huggingface_hub.HfApi`'s ``create_repo`` and ``upload_file`` (default: HfApi()).
    """
    from kvtool.artifact import load_artifact

    loaded = load_artifact(artifact)  # never upload a corrupt file
    if not re.match(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$", repo_id):
        raise ArtifactError(f"'{repo_id}' is not a hub repository id: write it as owner/name")
    filename = filename or Path(artifact).name
    if not filename.endswith(".safetensors"):
        raise ArtifactError(f"the file name in the repository must end in .safetensors, got '{filename}'")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    card = f"---\nlibrary_name: kvtool\ntags: [kvtool, kv-cache]\n---\n\n{model_card(loaded.manifest)}"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_file(path_or_fileobj=str(artifact), path_in_repo=filename, repo_id=repo_id,
                        commit_message=f"kvtool artifact {filename}")
        api.upload_file(path_or_fileobj=card.encode(), path_in_repo="README.md", repo_id=repo_id,
                        commit_message="kvtool model card")
    except Exception as exc:
        raise _hub_failure(f"cannot push '{artifact}' to hub repo '{repo_id}'", exc) from exc
    return f"{repo_id}:{filename}"


HUB_PROBE_SECONDS = 1.5


def check_hub_reachable(model_id: str) -> None:
    """Fail in about a second, with one line, for a hub id that is neither cached nor reachable.

    Without this check transformers retries the connection for half a minute, printing a
    warning per retry, before its own error. Cached ids pass through (transformers reads them
    from the cache); offline mode (HF_HUB_OFFLINE) with an uncached id fails at once.
    """
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        return  # cached: transformers reads it without the network
    if constants.HF_HUB_OFFLINE:
        raise ModelError(f"model '{model_id}' is not a local folder and not in the hub cache, and HF_HUB_OFFLINE "
                         "is set: pass a local directory with config.json and weights, or unset HF_HUB_OFFLINE "
                         "to download it")
    endpoint = urlparse(constants.ENDPOINT)
    host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS).close()
    except OSError as exc:
        raise ModelError(f"model '{model_id}' is not a local folder, not in the hub cache, and the hub ({host}) "
                         f"cannot be reached ({exc.__class__.__name__}): pass a local directory with config.json "
                         "and weights, or download the model on a machine with network access first") from None


def check_model_option(model: str | None) -> None:
    """--model before anything heavy loads: a hub id (not a folder or path form) must be cached or reachable."""
    import os

    if model is None or os.path.exists(os.path.expanduser(model)):
        return
    if os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1:
        return  # a path that does not exist: `load_model` says so
    check_hub_reachable(model)
