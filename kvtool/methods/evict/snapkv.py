"""SnapKV (Li et al., 2024): prompt tokens scored by the attention of the last ``window`` prompt queries.

The scores are max-pooled over neighbouring tokens (kernel ``pooling``) so that
clusters survive together. After prefill the runtime keeps accumulating attention
from generated queries, so decoding past the budget evicts by the same score.
"""

import torch

from kvtool.methods.evict.base import EvictionPolicy, StreamView, register_policy


@register_policy("snapkv")
class SnapKV(EvictionPolicy):
    def token_scores(self, view: StreamView):
        scores = view.window_attention if view.window_attention is not None else view.attention  # (n,)
        kernel = self.spec.pooling
        if kernel == 1 or view.n < 2:
            return scores
        pooled = torch.nn.functional.max_pool1d(scores[None, None], kernel, stride=1, padding=kernel // 2)
        return pooled[0, 0, : view.n]
