"""TOVA (Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024): token omission via attention.

At every step the cache is over budget, drop the tokens that received the least attention
from the *current* query, with no memory of earlier steps (unlike H2O's accumulated sum).
At prefill the "current" queries are the last ``window`` prompt tokens (the paper uses the
last one: ``window: 1`` is the exact rule); while decoding it is the one new query. As in
the paper, the score of a token is its attention averaged over all heads of the layer (the
sequence's KV streams summed by position), so a layer's heads keep one set of positions; a
single query's attention per head is too noisy to choose by. Sinks and the recent window stay
protected as for every policy.
"""

import torch

from kvtool.methods.evict.base import EvictionPolicy, StreamView, register_policy


def sum_over_heads(scores: torch.Tensor, view: StreamView) -> torch.Tensor:
    """(S, N): each token's score summed over the KV streams of its sequence that hold its position."""
    s, n = scores.shape
    heads = int(view.heads.max()) + 1 if s else 1
    position = view.positions.masked_fill(~view.valid, 0).long()  # (S, N)
    width = int(position.max()) + 1 if position.numel() else 1
    dense = torch.zeros(s, width, device=scores.device)
    dense.scatter_add_(1, position, scores.float().masked_fill(~view.valid, 0.0))  # (S, P)
    per_sequence = dense.reshape(-1, heads, width).sum(dim=1)  # (B, P)
    return per_sequence.repeat_interleave(heads, dim=0).gather(1, position)  # streams are sequence-major


@register_policy("tova")
class TOVA(EvictionPolicy):
    attention_from = ("window",)  # the last queries at prefill; a decode step's one query is its own sum

    def token_scores(self, view: StreamView):
        current = view.current_attention if view.current_attention is not None else view.attention  # (S, N)
        return sum_over_heads(current, view)

    def head_scores(self, view: StreamView):
        return view.current_attention if view.current_attention is not None else view.attention  # per head (AdaKV)
