"""A model's context limit read from its config.json alone, before torch or the model loads.

The CLI uses it to refuse an over-long request (``--seq-len``, ``--lengths``, ``-n``) in a
second instead of after a model load of tens of seconds. It never raises for a model it
cannot read: then it answers None and the runtime's own check (`kvtool.runtime.attach.
check_context`, on the loaded model) still refuses the request.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvtool.errors import RuntimeConfigError

DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent / "default_model"  # the embedded kvref-5m
DEFAULT_MODEL_ENV = "KVTOOL_DEFAULT_MODEL"  # its stand-in where the folder is absent


def config_json(model: str | None) -> dict | None:
    """The model's config.json as a dict: a local folder, a cached hub id, or (None) the embedded model."""
    if model is None:
        folder = DEFAULT_MODEL_DIR if DEFAULT_MODEL_DIR.is_dir() else os.environ.get(DEFAULT_MODEL_ENV)
        return _read(Path(folder) / "config.json") if folder else None
    local = Path(os.path.expanduser(model))
    if local.is_dir():
        return _read(local / "config.json")
    if local.exists() or model.count("/") > 1 or model.startswith((".", "~", "/")):
        return None  # a file (GGUF) or a missing path: loading says what is wrong
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of transformers
        return None
    cached = try_to_load_from_cache(model, "config.json")
    return _read(Path(cached)) if isinstance(cached, str) else None


def max_positions(model: str | None) -> int | None:
    """``max_position_embeddings`` of the (text) config, or None when the config does not say."""
    config = config_json(model)
    if config is None:
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    limit = text.get("max_position_embeddings")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_context_early(model: str | None, tokens: int, asked: str, fix: str) -> None:
    """RuntimeConfigError when ``tokens`` exceed the model's limit.

    asked: what the user asked for, as they wrote it (``--seq-len 9000``); fix: what to change.
    """
    limit = max_positions(model)
    if limit is not None and tokens > limit:
        name = "the embedded model" if model is None else f"'{model}'"
        raise RuntimeConfigError(f"{asked} exceeds the context limit of {limit} positions of {name}: {fix}")


def check_prompt_fits(prompt_tokens: int, max_new_tokens: int, limit: int) -> None:
    """RuntimeConfigError when a prompt of ``prompt_tokens`` plus ``max_new_tokens`` exceeds ``limit`` positions."""
    if prompt_tokens + max_new_tokens > limit:  # generate's own words: it has no --seq-len
        raise RuntimeConfigError(f"the prompt ({prompt_tokens} tokens) + --max-new-tokens {max_new_tokens} exceed the "
                                 f"model's context limit of {limit} tokens: shorten the prompt or lower --max-new-tokens")


def _read(path: Path) -> dict | None:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # unreadable: the model load reports it properly
    return config if isinstance(config, dict) else None
