"""What one decoder layer's attention computes, besides Q/K/V: `LayerAttentionSpec`.

kvtool's runtime computes attention itself over its compressed blocks, so it needs, per
layer, the facts the model's own attention function would otherwise apply:

* ``sliding_window``: keys older than the window are invisible to a query (Mistral,
  Gemma 2/3 local layers, GPT-OSS, Qwen2 with ``use_sliding_window``); None = full.
  transformers' convention: a key at position p is visible to a query at q when
  q - window < p <= q.
* ``logit_softcap``: scores become ``cap * tanh(scores / cap)`` before the mask (Gemma 2).
* ``has_sinks``: learned per-query-head sink logits join the softmax and take their share of
  the mass without contributing a value (GPT-OSS ``sinks``, passed as ``s_aux``).
* ``scaling``: the factor on q.k (head_dim**-0.5 usually; Gemma's query_pre_attn_scalar**-0.5,
  Granite's attention_multiplier).
* ``rope``: this layer's `RopeSpec` (Gemma 3: different bases on local and global layers).

Layer types and windows are read the way transformers' own caches read them
(`transformers.cache_utils.get_layer_types_and_kwargs`), so kvtool agrees with the masks
the model builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.errors import ModelError
from kvtool.models.rope import RopeSpec

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True, eq=False)
class LayerAttentionSpec:
    """Attention facts of one decoder layer (see the module docstring)."""

    sliding_window: int | None
    logit_softcap: float | None
    has_sinks: bool
    scaling: float
    rope: RopeSpec

    def __post_init__(self) -> None:
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be None or a positive int, got {self.sliding_window!r}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be None or > 0, got {self.logit_softcap!r}")
        if not self.scaling > 0:
            raise ValueError(f"scaling must be > 0, got {self.scaling!r}")


def layer_types_and_windows(config, num_layers: int) -> list[tuple[str, int | None]]:
    """(layer type, sliding window or None) of every layer, as transformers' caches see them."""
    kinds, windows = _from_transformers(config, num_layers)
    out = []
    for layer, (kind, window) in enumerate(zip(kinds, windows)):
        if kind not in (FULL, SLIDING):
            raise ModelError(
                f"layer {layer} is of type '{kind}'; kvtool's cache handles only full and sliding-window "
                "attention layers, so this model is not supported"
            )
        out.append((kind, int(window) if kind == SLIDING and window else None))
    return out


def _from_transformers(config, num_layers: int) -> tuple[list[str], list[int | None]]:
    """Layer types and windows from transformers' helper; a plain reading of the config where it is missing."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        kinds, kwargs = get_layer_types_and_kwargs(config)
        kinds = list(kinds)
        if isinstance(kwargs, dict):  # transformers < 5.2x: one kwargs dict shared by every layer (not per layer)
            windows = [kwargs.get("sliding_window") if kind == SLIDING else None for kind in kinds]
        else:
            windows = [k.get("sliding_window") for k in kwargs]
    except (ImportError, AttributeError, TypeError):  # older transformers 5.x
        window = getattr(config, "sliding_window", None) or None
        kinds = list(getattr(config, "layer_types", None) or [SLIDING if window else FULL] * num_layers)
        windows = [window if kind == SLIDING else None for kind in kinds]
    if len(kinds) < num_layers:
        raise ModelError(f"the config lists {len(kinds)} layer types for {num_layers} decoder layers; fix config.layer_types")
    return kinds[:num_layers], windows[:num_layers]
