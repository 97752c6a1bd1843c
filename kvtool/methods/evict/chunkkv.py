"""ChunkKV (Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression", 2025).

Tokens are grouped into chunks of ``chunk_size`` consecutive *positions* (position //
chunk_size) and a chunk is worth its tokens' summed importance; chunks are kept whole, best
first, so a multi-token fact (a pass key, a name) survives or goes as one unit. Importance
is SnapKV's: the attention of the last ``window`` prompt queries at prefill, the attention
accumulated since while decoding. Inside the chunk that only partly fits, the tokens with
the most attention go first.

Layer-wise index reuse: layers are taken in groups of ``reuse_layers``; the first layer of
a group scores and chooses, and the others keep the positions it kept (when they still hold
them: same forward, same tokens seen), falling back on their own scores for the rest of
their budget. The paper shares indices across adjacent layers because their kept sets
overlap strongly; here it also keeps the same tokens readable across a group of layers.
State is one decision of the last anchor layer, stamped with the layer and the lengths seen.
"""

from __future__ import annotations

import torch

from kvtool.methods.evict.base import EvictionPolicy, LayerKept, StreamView, register_policy


def chunk_sums(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """(S, N): the summed ``scores`` of each token's chunk (valid tokens only)."""
    chunk = (positions.masked_fill(~valid, 0) // chunk_size).long()  # (S, N)
    width = int(chunk.max()) + 1 if chunk.numel() else 1
    sums = torch.zeros(scores.shape[0], width, device=scores.device)
    sums.scatter_add_(1, chunk, scores.float().masked_fill(~valid, 0.0))
    return sums.gather(1, chunk)


def lexicographic_scores(primary: torch.Tensor, secondary: torch.Tensor) -> torch.Tensor:
    """(S, N) float: -rank by ``primary`` descending, ties by ``secondary`` descending (exact, distinct)."""
    by_secondary = torch.sort(secondary, dim=1, descending=True, stable=True).indices
    order = by_secondary.gather(1, torch.sort(primary.gather(1, by_secondary), dim=1, descending=True, stable=True).indices)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return -rank.float()


@register_policy("chunkkv")
class ChunkKV(EvictionPolicy):
    observes_window = True  # its window's queries score the rest: sized by the budget

    def __init__(self, spec, profile=None) -> None:
        super().__init__(spec, profile)
        self._anchor: LayerKept | None = None  # what the last anchor layer kept
        self._reused: torch.Tensor | None = None  # (S, N) bool: positions the anchor layer kept, during `keep`

    def head_scores(self, view: StreamView):
        return self._importance(view)  # per token: comparable across heads, unlike the chunk ranks

    def _importance(self, view: StreamView) -> torch.Tensor:
        importance = view.window_attention if view.window_attention is not None else view.attention  # (S, N)
        return importance.float().masked_fill(~view.valid, 0.0)

    def token_scores(self, view: StreamView):
        importance = self._importance(view)
        primary = chunk_sums(importance, view.positions, view.valid, self.spec.chunk_size)
        if self._reused is not None:  # the anchor's positions first (by their chunk order), then the rest
            primary = torch.where(self._reused, primary + primary.amax(dim=1, keepdim=True) + 1.0, primary)
        return lexicographic_scores(primary, importance)

    def keep(self, view: StreamView, budget: torch.Tensor) -> torch.Tensor:
        anchor = view.layer - view.layer % self.spec.reuse_layers
        # the anchor layer's kept tokens, when it ran in this same forward
        self._reused = self._anchor.at(view, anchor) if anchor != view.layer and self._anchor is not None else None
        try:
            keep = super().keep(view, budget)
        finally:
            self._reused = None
        if anchor == view.layer and self.spec.reuse_layers > 1:
            self._anchor = LayerKept.record(keep, view)
        return keep
