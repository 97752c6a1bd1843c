"""Read a model's rotary embedding module into `RopeSpec`s, one per layer.

transformers 5.x models keep one rotary module on the decoder (``rotary_emb``). Two shapes:

* one RoPE for every layer: buffers ``inv_freq`` / ``original_inv_freq`` and a float
  ``attention_scaling``; ``forward(x, position_ids)`` (Llama, Qwen, Phi-3, GPT-OSS ...);
* one RoPE per layer type (Gemma 3: local base 10k on sliding layers, 1M on global ones):
  ``rope_type`` is a dict keyed by layer type, buffers ``{type}_inv_freq``,
  ``{type}_original_inv_freq``, floats ``{type}_attention_scaling``;
  ``forward(x, position_ids, layer_type)``.

The layout of cos/sin (rotate-half ``cat(f, f)``, Cohere's interleaved ``f0 f0 f1 f1``, or
GPT-OSS's half-width ``f`` whose rotation is rotate-half too) is found by running the
module's *undecorated* forward once on a few positions and matching it against each
layout computed from ``inv_freq``: no hooks fire and no frequency state changes.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn

from kvtool.errors import ModelError
from kvtool.models.rope import RopeSpec

_PROBE_POSITIONS = 9  # positions 0..8: enough to tell the layouts apart (position 0 cannot)


def rotary_module(decoder: nn.Module, model_name: str) -> nn.Module:
    """The decoder's shared rotary module, or ModelError naming what is missing."""
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        raise ModelError(
            f"{model_name} has no rotary embedding at {type(decoder).__name__}.rotary_emb; kvtool needs RoPE models "
            "whose decoder owns one rotary module (transformers 5.x layout)"
        )
    return rotary


def layer_ropes(rotary: nn.Module, config, layer_types: list[str]) -> list[RopeSpec]:
    """The RopeSpec of every layer (layer_types: one entry per decoder layer)."""
    if not isinstance(getattr(rotary, "rope_type", None), dict):
        spec = read_rope(rotary, config, None)
        return [spec] * len(layer_types)
    by_type = {kind: read_rope(rotary, config, kind) for kind in sorted(set(layer_types))}
    return [by_type[kind] for kind in layer_types]


def read_rope(rotary: nn.Module, config, layer_type: str | None) -> RopeSpec:
    """The RopeSpec of one layer type (None: the module has a single RoPE)."""
    prefix = f"{layer_type}_" if layer_type else ""
    where = f"{type(rotary).__name__}" + (f" for layer type '{layer_type}'" if layer_type else "")
    current = getattr(rotary, f"{prefix}inv_freq", None)
    if not isinstance(current, torch.Tensor):
        raise ModelError(f"{where} has no '{prefix}inv_freq' buffer; kvtool reads RoPE frequencies from it")
    base = getattr(rotary, f"{prefix}original_inv_freq", current)  # before longrope/dynamic forwards changed it
    rope_type = rotary.rope_type[layer_type] if layer_type else getattr(rotary, "rope_type", "default")
    scaling = float(getattr(rotary, f"{prefix}attention_scaling", getattr(rotary, "attention_scaling", 1.0)))
    interleaved = _layout_is_interleaved(rotary, layer_type, current, scaling, where)
    extra = _frequency_rules(rotary, config, layer_type, rope_type)
    return RopeSpec(
        inv_freq=base.detach().float().clone(), attention_scaling=scaling, rotary_dim=2 * base.numel(),
        interleaved=interleaved, rope_type=str(rope_type), **extra,
    )


def _frequency_rules(rotary: nn.Module, config, layer_type: str | None, rope_type: str) -> dict:
    """longrope / dynamic: how frequencies change with a forward's length (see RopeSpec)."""
    if rope_type == "longrope":
        params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
        after = int(params["original_max_position_embeddings"])
        return {"long_inv_freq": _init_fn(rope_type, config, layer_type)(after + 1).float(), "long_after": after}
    if "dynamic" in rope_type:
        return {"grow_inv_freq": _init_fn(rope_type, config, layer_type), "grow_after": int(rotary.original_max_seq_len)}
    return {}


def _init_fn(rope_type: str, config, layer_type: str | None) -> Callable[[int], torch.Tensor]:
    """seq_len -> inv_freq (R/2,) from transformers' own RoPE initialisation for this type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    kwargs = {"layer_type": layer_type} if layer_type else {}
    return lambda seq_len: init(config, None, seq_len=seq_len, **kwargs)[0]


def _layout_is_interleaved(rotary: nn.Module, layer_type, inv_freq: torch.Tensor, scaling: float, where: str) -> bool:
    """Run the undecorated forward (no hooks, no state update) and match its cos against each layout."""
    forward = inspect.unwrap(type(rotary).forward)
    positions = torch.arange(_PROBE_POSITIONS, device=inv_freq.device)[None]  # (1, T)
    probe = torch.zeros(0, dtype=torch.float32, device=inv_freq.device)  # only its dtype/device are read
    with torch.no_grad():
        cos, _ = forward(rotary, probe, positions, *([layer_type] if layer_type else []))
    freqs = positions[..., None].float() * inv_freq.float()  # (1, T, R/2)
    layouts = {
        False: torch.cat((freqs, freqs), dim=-1),  # rotate-half
        True: torch.repeat_interleave(freqs, 2, dim=-1),  # interleaved pairs
        "half-width": freqs,  # GPT-OSS: cos/sin of R/2 entries, rotated as halves
    }
    for layout, emb in layouts.items():
        if emb.shape == cos.shape and torch.allclose(cos.float(), emb.cos() * scaling, rtol=1e-5, atol=1e-6):
            return layout is True
    raise ModelError(
        f"{where}: its cos/sin (shape {tuple(cos.shape)}) match no RoPE layout kvtool knows (rotate-half, "
        "interleaved pairs, half-width) computed from its inv_freq and attention_scaling; this model's RoPE "
        "needs a family adapter in kvtool.models.adapter.ADAPTERS"
    )
