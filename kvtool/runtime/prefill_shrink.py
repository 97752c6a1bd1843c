"""PyramidInfer's prefill: each decoder layer computes only the prompt tokens the layer below kept.

PyramidInfer (Yang et al., 2024) saves prefill compute, not only cache memory: after layer l
has chosen its kept set, only those tokens' hidden states go on to layer l + 1, so deeper
layers run their projections, attention and MLP over fewer rows. kvtool does this with a
forward pre-hook and a forward hook on every decoder layer (`PrefillShrink`, one per model):

* layer l's pre-hook gives the layer the rows (token positions) still computed, (B, T_l) of the
  forward's T: it gathers the layer's ``attention_mask`` (B, 1, T, T) -> (B, 1, T_l, T_l),
  ``position_embeddings`` (cos, sin) and ``position_ids`` at those rows, and tells the kvtool
  cache the rows' true positions and that the forward covers T tokens (`CacheContext.shrink`:
  the layer stores T_l tokens at their true positions and counts T seen, so budgets and
  positions stay those of the whole prompt);
* layer l's forward hook writes the layer's output rows into a (B, T, H) copy of the residual
  stream, then passes on only the rows the policy kept at this layer (`PyramidInfer.kept_after`,
  one set per sequence shared by its KV heads); after the last layer the full (B, T, H) stream
  goes on, so the model's output keeps its shape. A dropped token's hidden state is the one of
  the last layer that computed it (the layers above act as the identity for it): the logits at
  dropped prompt positions are not the full model's (the paper computes none there); the last
  token, always in the recent window, is computed by every layer.

It acts on a forward only when all of these hold, and otherwise leaves the forward alone:
the forward's cache is a kvtool cache whose policy is `pyramidinfer` with
``eviction.compute_kept_only: true``; every layer of it is empty (the first prefill; a later
multi-token forward computes every token); more than one token; no padding (no mask, or a
mask of ones); the layers are called as transformers' decoder layers are (hidden states first,
``attention_mask`` / ``position_embeddings`` / ``position_ids`` by name; anything else of the
sequence's length is refused); every sequence keeps as many tokens at each layer (else the
rows stop shrinking for the rest of the forward).
"""

from __future__ import annotations

import torch
from torch import nn

SLICED = ("attention_mask", "position_embeddings", "position_ids")  # per-token kwargs a layer gets, gathered by row


class PrefillShrink:
    """Hooks on a model's decoder layers; the state of the forward in progress (None outside a shrinking one)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.count = len(layers)
        self.cache = None  # the kvtool cache of the shrinking forward
        self.rows: torch.Tensor | None = None  # (B, T_l) positions (0 .. T-1) the next layer computes
        self.stream: torch.Tensor | None = None  # (B, T, H) the residual stream, each row from its last computing layer
        self.rows_per_layer: list[int] = []  # T_l per layer of the last shrinking forward (for tests and reports)
        self.handles = []
        for index, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post_hook(index), with_kwargs=True))

    @classmethod
    def install(cls, model: nn.Module, layers: nn.ModuleList) -> "PrefillShrink":
        """The model's hooks, installed once (runtimes of the same model share them; they act only for their caches)."""
        existing = getattr(model, "_kvtool_prefill_shrink", None)
        if existing is None:
            existing = cls(layers)
            model._kvtool_prefill_shrink = existing
        return existing

    # --- hooks ---------------------------------------------------------------------------------------
    def _pre_hook(self, index: int):
        def hook(module, args, kwargs):
            if index == 0:
                self._end()
                self._begin(args, kwargs)
            if self.cache is None:
                return None
            self.rows_per_layer.append(self.rows.shape[1])
            return None if index == 0 else self._gathered(args, kwargs)

        return hook

    def _post_hook(self, index: int):
        def hook(module, args, kwargs, output):
            if self.cache is None:
                return None
            hidden = output[0] if isinstance(output, tuple) else output  # (B, T_l, H)
            b = hidden.shape[0]
            if self.stream is None:
                self.stream = hidden.clone()
            else:
                self.stream[torch.arange(b, device=hidden.device)[:, None], self.rows] = hidden
            if index == self.count - 1:
                out = self.stream
                self._end()
            else:
                out = self._kept_rows(index, hidden)
            return (out, *output[1:]) if isinstance(output, tuple) else out

        return hook

    # --- one forward ---------------------------------------------------------------------------------
    def _begin(self, args, kwargs) -> None:
        """Start shrinking when this forward qualifies (module docstring)."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        hidden = args[0] if args else kwargs.get("hidden_states")
        context = getattr(cache, "context", None)
        policy = getattr(context, "policy", None)
        if context is None or not getattr(getattr(policy, "spec", None), "compute_kept_only", False):
            return
        if hidden is None or hidden.dim() != 3 or hidden.shape[1] < 2 or any(layer.seen for layer in cache.layers):
            return
        b, t = hidden.shape[:2]
        mask = kwargs.get("attention_mask")
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] == t
                                     and mask.shape[-2] == t and _unpadded(mask)):
            return  # padding, a cached prefix or a mask of another kind: compute every token
        for name, value in kwargs.items():
            if name not in SLICED and isinstance(value, torch.Tensor) and t in value.shape[1:2]:
                return  # a per-token argument this hook does not know how to gather
        self.cache = cache
        self.rows = torch.arange(t, device=hidden.device).expand(b, t)
        self.stream = None
        self.rows_per_layer = []

    def _gathered(self, args, kwargs):
        """(args, kwargs) of a layer with every per-token input at the rows still computed."""
        rows = self.rows  # (B, T_l)
        b, t_l = rows.shape
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            m = mask.expand(b, *mask.shape[1:])
            m = m.gather(2, rows[:, None, :, None].expand(b, m.shape[1], t_l, m.shape[3]))
            kwargs["attention_mask"] = m.gather(3, rows[:, None, None, :].expand(b, m.shape[1], t_l, t_l))
        cos_sin = kwargs.get("position_embeddings")
        if isinstance(cos_sin, tuple):
            kwargs["position_embeddings"] = tuple(_rows_of(x, rows) for x in cos_sin)
        positions = kwargs.get("position_ids")
        true_positions = rows
        if isinstance(positions, torch.Tensor):
            kwargs["position_ids"] = true_positions = positions.expand(b, positions.shape[-1]).gather(1, rows)
        self.cache.context.shrink = (true_positions, self.stream.shape[1])
        return args, kwargs

    def _kept_rows(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden rows (B, T_l, H) of the tokens layer ``index`` kept, in order; ``self.rows`` follows."""
        kept = self.cache.context.policy.kept_after(index)  # (S, P) bool by position, S = B x groups, or None
        b = hidden.shape[0]
        if kept is None or kept.shape[0] % b:
            return hidden
        groups = kept.shape[0] // b
        by_sequence = kept[::groups]  # (B, P): the layer keeps one set per sequence, shared by its KV heads
        inside = self.rows < by_sequence.shape[1]  # rows are the prompt's positions 0 .. T-1 (no padding)
        keep = inside & by_sequence.gather(1, self.rows.clamp(max=by_sequence.shape[1] - 1))  # (B, T_l)
        counts = keep.sum(dim=1)
        if not bool((counts == counts[0]).all()) or int(counts[0]) == 0:
            return hidden  # sequences keep different numbers: stop shrinking
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, : int(counts[0])]  # kept, in order
        self.rows = self.rows.gather(1, order)
        return hidden.gather(1, order[..., None].expand(b, order.shape[1], hidden.shape[2]))

    def _end(self) -> None:
        if self.cache is not None:
            self.cache.context.shrink = None
        self.cache, self.rows, self.stream = None, None, None


def _rows_of(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (B or 1, T, ...) at rows (B, T_l) -> (B, T_l, ...)."""
    b, t_l = rows.shape
    x = x.expand(b, *x.shape[1:])
    index = rows.reshape(b, t_l, *([1] * (x.dim() - 2))).expand(b, t_l, *x.shape[2:])
    return x.gather(1, index)


def _unpadded(mask: torch.Tensor) -> bool:
    """A (B, 1, T, T) mask (bool, or additive 0 / -inf) of a prompt without padding: no token sees a later one, every
    token sees itself and the one before it (a causal mask, or a sliding-window one; padding breaks the latter)."""
    seen = mask if mask.dtype == torch.bool else mask == 0
    future = torch.ones(seen.shape[-2:], dtype=torch.bool, device=mask.device).triu(1)
    return (not bool(seen[..., future].any()) and bool(seen.diagonal(dim1=-2, dim2=-1).all())
            and bool(seen.diagonal(offset=-1, dim1=-2, dim2=-1).all()))
