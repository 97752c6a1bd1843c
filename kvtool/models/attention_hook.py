"""kvtool's attention function: how profiling and kvtool's cache see queries and attention.

transformers 5.x attention modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
with ``(module, query, key, value, attention_mask, scaling=...)`` right after
``past_key_values.update``. `install` registers ``"kvtool"`` there (and the
padding-aware boolean mask builder for it) and switches a model to it. The function
dispatches, in this order, to:

1. an *owner* the cache registered during ``update`` for this very call (kvtool's
   cache: attention runs over its compressed blocks, never over a rebuilt float cache;
   every (sequence, KV head) stream has its own length; eviction policies see the
   attention probabilities); the model's extra arguments (``softcap``, ``s_aux`` sinks,
   ``sliding_window``) are passed on;
2. a *handler* set with `attention_handler` (profiling: attention statistics per head);
3. PyTorch SDPA, exactly what the model would run without kvtool.

Shapes as transformers passes them: query (B, H_q, t, D) after RoPE, key/value
(B, H_kv, T, D), attention_mask None or bool (B, 1, t, T) with True = may attend.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Protocol

import torch

ATTENTION_NAME = "kvtool"
_state = threading.local()


class AttentionOwner(Protocol):
    def attend(self, module, query, key, value, attention_mask, scaling: float) -> torch.Tensor:
        """Return the attention output (B, t, H_q, D), as transformers' attention functions do."""


def claim_next_attention(owner: AttentionOwner) -> None:
    """Called by a cache layer inside ``update``: the attention call that follows belongs to ``owner``."""
    if getattr(_state, "owner", None) is not None:
        _state.owner = None  # drop the stale claim so the next correct forward works
        raise RuntimeError(
            "kvtool's cache was updated but the model did not run kvtool attention; "
            "build caches with CompressedRuntime.new_cache(), which switches the model to it"
        )
    _state.owner = owner


def release_claim() -> None:
    _state.owner = None


@contextmanager
def attention_handler(handler: Callable):
    """Route attention calls (without an owner) to ``handler(module, q, k, v, mask, scaling)`` inside the block."""
    previous = getattr(_state, "handler", None)
    _state.handler = handler
    try:
        yield
    finally:
        _state.handler = previous


def kvtool_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention function (see the module docstring for the dispatch order)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scaling = module.head_dim**-0.5 if scaling is None else scaling
    owner = getattr(_state, "owner", None)
    if owner is not None:
        _state.owner = None
        return owner.attend(module, query, key, value, attention_mask, scaling, **kwargs), None
    handler = getattr(_state, "handler", None)
    if handler is not None:
        return handler(module, query, key, value, attention_mask, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, kvtool_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def install(model) -> None:
    """Switch ``model`` to kvtool attention (idempotent). Without an owner or handler it is plain SDPA."""
    _register()
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)


def sdpa_reference(query, key, value, attention_mask, scaling: float) -> torch.Tensor:
    """Plain attention output (B, t, H_q, D) with GQA groups sharing K/V (used by handlers)."""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, hq // hkv * t, d)  # (B, H_kv, G*t, D): a group's query heads share their KV head
    mask = None
    if attention_mask is not None:
        mask = attention_mask.expand(b, 1, t, -1).repeat(1, 1, hq // hkv, 1)  # (B, 1, G*t, T)
    elif t > 1:
        causal = torch.ones(t, key.shape[2], dtype=torch.bool, device=query.device).tril(key.shape[2] - t)
        mask = causal.repeat(hq // hkv, 1)[None, None]
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, t, d).transpose(1, 2)
