"""Ask a model's forward for the last position's logits only, where nothing reads the others.

A forward over T tokens returns (b, T, V) logits by default. Where only the cache it fills matters (the prefill
of a perplexity window or a retrieval context, a capture pass, a bytes-measuring walk) those logits are waste,
and with a large vocabulary they are most of the forward's memory: Gemma 3's 262,144-token vocabulary makes a
batch of 4 x 1024 prefilled tokens 4.3 GB of float32 logits (more with its final soft-capping's temporaries),
against about 0.1 GB for the cache. transformers 5.x causal LMs take ``logits_to_keep``; a forward that does not
is called as before.
"""

from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(forward_type: type) -> bool:
    try:
        parameters = inspect.signature(forward_type.forward).parameters
    except (TypeError, ValueError):  # no inspectable signature: keep the default call
        return False
    return "logits_to_keep" in parameters


def last_logits_only(model) -> dict:
    """Keyword arguments that make ``model``'s forward compute logits for the last position only ({} if it cannot)."""
    return {"logits_to_keep": 1} if _takes_logits_to_keep(type(model)) else {}
