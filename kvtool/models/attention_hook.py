"""kvtool's attention function: how profiling and kvtool's cache see queries and attention.

transformers 5.x attention modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
with ``(module, query, key, value, attention_mask, scaling=...)`` right after
the cache's ``update``. `install` registers ``"kvtool"`` there (and the
padding-aware boolean mask builder for it) and switches a model to it. The function
dispatches, in this order, to:

1. an *owner* the cache registered during ``update`` for this very call (kvtool's
   cache: attention runs over its compressed blocks, never over a rebuilt float cache;
   every (sequence, KV head) stream has its own length; eviction policies see the
   attention probabilities); the model's extra arguments (``softcap``, ``s_aux`` sinks,
   ``sliding_window``) are passed on;
2. a *handler* set with `attention_handler` (profiling: attention statistics per head);
   it also gets ``softcap=`` / ``s_aux=`` for the calls that carry them;
3. PyTorch SDPA, exactly what the model would run without kvtool; calls that carry
   ``softcap`` (Gemma 2) or ``s_aux`` sinks (GPT-OSS), which SDPA cannot do, go to the
   family's own eager attention (a model switched to kvtool attention and then run with
   another cache, e.g. transformers' DynamicCache, still computes what it would without kvtool).

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
        extra = {name: kwargs[name] for name in ("softcap", "s_aux") if kwargs.get(name) is not None}
        return handler(module, query, key, value, attention_mask, scaling, **extra), None  # extras only where the model has them
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:  # SDPA has neither: the model's own eager path
        return eager_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The model family's own ``eager_attention_forward``, fed an additive float mask.

    The fallback (3.) for calls without an owner that carry ``softcap`` (Gemma 2) or ``s_aux``
    sink logits (GPT-OSS): SDPA can do neither (it refuses softcap and would drop the sinks).
    kvtool's own cache never comes here: its attention applies both (`kvtool.runtime.layer`).

    attention_mask: None (causal), bool (B, 1, t, T) with True = may attend (kvtool's mask), or already additive.
    Returns (output (B, t, H_q, D), weights) as transformers' attention functions do.
    """
    import sys

    from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager

    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", llama_eager)
    t, total = query.shape[2], key.shape[2]
    if attention_mask is None and t > 1:  # the SDPA mask builder skips causal masks SDPA does itself (is_causal)
        attention_mask = torch.ones(t, total, dtype=torch.bool, device=query.device).tril(total - t)[None, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        blocked = torch.finfo(query.dtype).min
        attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(~attention_mask, blocked)
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


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
