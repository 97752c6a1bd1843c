"""Run a causal LM's decoder stack one layer at a time, exactly as the model's own forward would.

The model's forward computes, before the first decoder layer, the embeddings and what every
layer is called with (causal mask, RoPE cos/sin, position ids ...), and after the last layer
the final norm and the LM head. `record_layer_calls` runs that forward with the decoder layers
swapped for recorders: it returns the first layer's input hidden states and each layer's
keyword arguments, without running any layer. `run_layer` then calls one real layer on
stored hidden states; `head_loss_gradient` runs the model's head on the last layer's output
(the layers swapped for a replay) and returns the loss gradient w.r.t. that output.
Nothing here is family-specific: each family's forward builds its own arguments.

Shapes: hidden states (B, T, d_model); input ids (B, T).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from kvtool.models.cache_argument import with_cache, without_cache


class _StopForward(Exception):
    """Raised by the last recorder: everything after the decoder layers is skipped."""


@dataclass
class LayerCall:
    """The first layer's input hidden states of one batch and the keyword arguments of every layer."""

    hidden: torch.Tensor  # (B, T, d_model), on the device the model produced it
    kwargs: list[dict]  # per layer; the cache in them is replaced by the caller's at run time


class _Recorder(nn.Module):
    def __init__(self, index: int, last: bool, call: LayerCall) -> None:
        super().__init__()
        self.index, self.last, self.call = index, last, call

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise RuntimeError("decoder layers called with positional arguments besides hidden_states are not supported")
        if self.index == 0:
            self.call.hidden = hidden_states.detach()
        self.call.kwargs.append(dict(kwargs))
        if self.last:
            raise _StopForward
        return hidden_states


class _Replay(nn.Module):
    """Hands the stored output of the last decoder layer to the model's head."""

    def __init__(self, output: torch.Tensor | None) -> None:
        super().__init__()
        self.output = output

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states if self.output is None else self.output


@contextmanager
def _swapped(layers: nn.ModuleList, replacements: list[nn.Module]) -> Iterator[None]:
    originals = list(layers)
    try:
        for i, module in enumerate(replacements):
            layers[i] = module
        yield
    finally:
        for i, module in enumerate(originals):
            layers[i] = module


@torch.no_grad()
def record_layer_calls(model, layers: nn.ModuleList, input_ids: torch.Tensor, cache) -> LayerCall:
    """The embeddings of ``input_ids`` (B, T) and each decoder layer's keyword arguments, running no layer.

    ``cache`` is passed to the model so the masks are built for it (use the same kind
    of cache as the layer runs).
    """
    call = LayerCall(hidden=torch.empty(0), kwargs=[])
    count = len(layers)
    recorders = [_Recorder(i, i == count - 1, call) for i in range(count)]
    with _swapped(layers, recorders):
        try:
            model(input_ids=input_ids, **with_cache(cache), use_cache=True)
        except _StopForward:
            pass
    if len(call.kwargs) != count:
        raise RuntimeError(f"the model called {len(call.kwargs)} of its {count} decoder layers")
    return call


def run_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict, cache) -> torch.Tensor:
    """One decoder layer on hidden (B, T, d_model) with its recorded arguments and ``cache``: (B, T, d_model)."""
    out = layer(hidden, **without_cache(kwargs), **with_cache(cache))
    return out[0] if isinstance(out, tuple) else out


def head_loss_gradient(
    model,
    layers: nn.ModuleList,
    input_ids: torch.Tensor,
    last_output: torch.Tensor,
    cache,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """d loss / d last_output (B, T, d_model) float32, where loss = loss_fn(logits, input_ids).

    The model's own forward computes the logits from ``last_output`` (final norm, LM head,
    any soft-capping); the decoder layers are swapped for a replay and run nothing.
    """
    leaf = last_output.detach().requires_grad_()
    count = len(layers)
    replays = [_Replay(leaf if i == count - 1 else None) for i in range(count)]
    with _swapped(layers, replays), torch.enable_grad():
        logits = model(input_ids=input_ids, **with_cache(cache), use_cache=True).logits  # (B, T, V)
        loss = loss_fn(logits, input_ids)
        del logits
        (grad,) = torch.autograd.grad(loss, [leaf])
    return grad


@torch.no_grad()
def head_logits(model, layers: nn.ModuleList, input_ids: torch.Tensor, last_output: torch.Tensor, cache,
                keep: int | None = None) -> torch.Tensor:
    """The logits (B, keep or T, V) the model's own head computes from the last decoder layer's ``last_output``.

    keep: the last ``keep`` positions only (``logits_to_keep``, where the model takes it: a large vocabulary's
    logits over every position are most of a forward's memory); the decoder layers are swapped for a replay."""
    from kvtool.models.logits_argument import last_logits_only

    count = len(layers)
    replays = [_Replay(last_output if i == count - 1 else None) for i in range(count)]
    extra = {"logits_to_keep": keep} if keep is not None and last_logits_only(model) else {}
    with _swapped(layers, replays):
        logits = model(input_ids=input_ids, **with_cache(cache), use_cache=True, **extra).logits
    return logits if keep is None else logits[:, -keep:]
