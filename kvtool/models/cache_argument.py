"""The keyword a model takes its KV cache by.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (model forwards, decoder layers, ``generate``,
model outputs); the old name still works, with a warning, until 5.40. kvtool supports every 5.x, so it hands
the cache over under the name the installed version declares. A decoder layer given both names takes
``cache`` and ignores the other, so replayed layer arguments drop whichever name they were recorded with.
"""

from __future__ import annotations

import dataclasses

from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE_ARGUMENT = "cache" if "cache" in {field.name for field in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
CACHE_ARGUMENTS = ("cache", "past_key_values")  # either name, in any transformers 5.x


def with_cache(cache) -> dict:
    """Keyword arguments handing ``cache`` to a model's forward, a decoder layer or ``generate``."""
    return {CACHE_ARGUMENT: cache}


def without_cache(kwargs: dict) -> dict:
    """``kwargs`` without a cache under either name."""
    return {name: value for name, value in kwargs.items() if name not in CACHE_ARGUMENTS}
