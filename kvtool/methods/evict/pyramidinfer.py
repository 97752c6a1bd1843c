"""PyramidInfer (Yang et al., "PyramidInfer: Pyramid KV Cache Compression for High-throughput LLM
Inference", Findings of ACL 2024): fewer kept tokens layer after layer, chosen by recent attention.

Recent attention consistency: the last queries of a prompt keep attending to the same few
"pivotal" tokens, and those are what later tokens need. At prefill a token's score is the
attention the last ``window`` prompt queries give it, each query weighted linearly from 1
(the oldest of them) to ``distance_weight`` (the newest), summed over every query head of the
layer: one kept set per layer and sequence, shared by its KV heads (the paper drops a token
from the whole layer). Layer-wise shrinking: layer l keeps only tokens that layer l-1 kept in
the same forward, and fewer of them: budgets follow `pyramidinfer_weights` (layer l keeps r_l
of what the layer below keeps, r_l falling from 1 to ``retention_decay`` along a cosine),
rescaled so the mean over layers is the recipe's budget. Sinks and the window are always kept.
With sliding-window layers (Gemma 2/3, Mistral) a layer judges only the tokens its window
shows: a token stays open to layer l while the last layer below that could see it kept it
(a global layer over a local one still chooses among the tokens older than the local window,
and only those the previous global layer kept; before, it could keep nothing older than the
local window).

Prefill compute. The paper also *computes* fewer tokens in deeper layers: only the kept tokens'
hidden states go on, which saves prefill time and activation memory. With
``eviction.compute_kept_only: true`` kvtool does too (`kvtool.runtime.prefill_shrink`: layer l + 1
runs over the tokens this policy left open after layer l); without it every layer computes the
whole prompt and this policy stores fewer tokens in deeper layers. While decoding, every layer keeps its own budget,
ranking by the attention accumulated since prefill summed over the layer's heads (the paper's
generation stage compresses each layer's new tokens on its own; layers are not nested then).
"""

from __future__ import annotations

import functools
import math

import torch

from kvtool.methods.budget.pyramid import pyramidinfer_weights
from kvtool.methods.evict.base import EvictionPolicy, LayerKept, StreamView, by_position, register_policy
from kvtool.methods.evict.tova import sum_over_heads
from kvtool.methods.evict.window_stats import WindowStats


@register_policy("pyramidinfer")
class PyramidInfer(EvictionPolicy):
    def __init__(self, spec, profile=None) -> None:
        super().__init__(spec, profile)
        self._below: LayerKept | None = None  # what the last layer prefilled kept
        self._allowed: torch.Tensor | None = None  # (S, N) bool while `keep` runs: what the layer below kept
        self._windows: tuple = ()  # each layer's sliding window or None (`budget_rule`)

    def budget_rule(self, rule, num_layers: int, windows: tuple = ()):
        self._windows = tuple(windows[:num_layers])
        return super().budget_rule(rule, num_layers, windows)

    def window_observer(self, t: int, window: int | torch.Tensor) -> WindowStats:
        return WindowStats(t, window, {"recent": functools.partial(self._recency_weighted, window=window)})

    def _recency_weighted(self, p: torch.Tensor, age: torch.Tensor, window: int | torch.Tensor) -> torch.Tensor:
        """p (S, g, W, C) x the weight of each row of a stream's ``window`` (int or (S,)): distance_weight for the newest
        query, 1 for the oldest."""
        span = torch.as_tensor(window, dtype=p.dtype, device=p.device).reshape(-1, 1)  # (S or 1, 1)
        slope = (self.spec.distance_weight - 1) / (span - 1).clamp(min=1)  # (S or 1, 1)
        weight = self.spec.distance_weight - slope * age[None, :]  # (S or 1, W)
        return p * weight[:, None, :, None]  # broadcast over heads and tokens

    def layer_weights(self, weights: torch.Tensor) -> torch.Tensor:
        return pyramidinfer_weights(len(weights), self.spec.retention_decay)

    def token_scores(self, view: StreamView) -> torch.Tensor:
        recent = view.window_stats["recent"] if view.window_stats is not None else view.attention  # (S, N)
        scores = sum_over_heads(recent, view)  # one score per position and sequence: the layer keeps one set
        return scores if self._allowed is None else scores.masked_fill(~self._allowed, -math.inf)

    def keep(self, view: StreamView, budget: torch.Tensor) -> torch.Tensor:
        prefill = view.window_stats is not None
        self._allowed = self._kept_below(view) if prefill else None
        try:
            keep = super().keep(view, budget)
            if self._allowed is not None:
                keep &= self._allowed | self.protected(view)  # nested: never what the layer below dropped
        finally:
            self._allowed = None
        if prefill:
            self._below = self._alive_after(keep, view)
        return keep

    def _alive_after(self, keep: torch.Tensor, view: StreamView) -> LayerKept:
        """What the next layer may keep, by position: this layer's choice where its window sees, and what was
        alive before elsewhere (everything, below the first layer of the forward)."""
        chosen = by_position(keep, view, False)  # (S, newest kept position + 1)
        width = max(int(view.length.max()), chosen.shape[1])
        kept = torch.zeros(keep.shape[0], width, dtype=torch.bool, device=keep.device)
        kept[:, : chosen.shape[1]] = chosen
        window = self._windows[view.layer] if view.layer < len(self._windows) else None
        if window:  # positions <= newest - window were not this layer's to judge
            before = None if self._below is None else self._below.at_layer(view, view.layer - 1)
            unseen = torch.arange(width, device=keep.device)[None, :] <= (view.latest() - window)[:, None]  # (S, P)
            previous = torch.ones_like(kept)
            if before is not None:
                previous[:, : min(width, before.shape[1])] = before[:, :width]
            kept = torch.where(unseen, previous, kept)
        return LayerKept(view.layer, view.length.clone(), kept)

    def kept_after(self, layer: int) -> torch.Tensor | None:
        """(S, P) bool by position: what ``layer`` left open to the next layer in the forward in progress (its kept set
        where it could judge, see `_alive_after`), or None when ``layer`` did not just choose (`prefill_shrink`)."""
        return self._below.kept if self._below is not None and self._below.layer == layer else None

    def _kept_below(self, view: StreamView) -> torch.Tensor | None:
        """(S, N) bool: the tokens still alive after layer l-1 in this same forward; None on layer 0 or after
        another forward."""
        return None if self._below is None else self._below.at(view, view.layer - 1)
