"""Hub ids without torch: is a --model string a path, and can a hub id be loaded at all (cache or network)?

Imported by the CLI before torch and transformers, so that an unreachable hub id fails in
about a second, with one line.
"""

from __future__ import annotations

from kvtool.errors import ModelError


HUB_PROBE_SECONDS = 1.5


def check_hub_reachable(model_id: str) -> None:
    """Fail in about a second, with one line, for a hub id that is neither cached nor reachable.

    Without this check transformers retries the connection for half a minute, printing a
    warning per retry, before its own error. Cached ids and offline mode (HF_HUB_OFFLINE)
    pass through: transformers reads them from the cache.
    """
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        return
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
