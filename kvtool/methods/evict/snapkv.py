"""SnapKV (Li et al., 2024): prompt tokens scored by the attention of the last ``window`` prompt queries.

The scores are max-pooled over neighbouring *positions* (kernel ``pooling``) so that
clusters survive together; positions no stream holds any more count as -inf. After
prefill the runtime keeps accumulating attention from generated queries, so decoding past
the budget evicts by the same (pooled) score.
"""

import math

import torch

from kvtool.methods.evict.base import EvictionPolicy, StreamView, register_policy


def pool_by_position(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, kernel: int,
                     mean: bool = False) -> torch.Tensor:
    """Max of ``scores`` (S, N) over tokens within kernel // 2 positions of each token (valid tokens only).

    mean: the average over the ``kernel`` positions instead (positions no valid token holds count as 0; CAKE).
    """
    half = kernel // 2
    pos = positions.masked_fill(~valid, 0).long()
    width = int(pos.max()) + 1 + 2 * half if pos.numel() else 1
    empty = 0.0 if mean else -math.inf
    dense = torch.full((scores.shape[0], width), empty, device=scores.device)
    dense.scatter_reduce_(1, pos + half, scores.float().masked_fill(~valid, empty), reduce="sum" if mean else "amax")
    pool = torch.nn.functional.avg_pool1d if mean else torch.nn.functional.max_pool1d
    pooled = pool(dense[:, None], kernel, stride=1)[:, 0]  # (S, width - 2 half)
    return pooled.gather(1, pos)


@register_policy("snapkv")
class SnapKV(EvictionPolicy):
    observes_window = True  # its window's queries score the rest: sized by the budget

    def token_scores(self, view: StreamView):
        scores = view.window_attention if view.window_attention is not None else view.attention  # (S, N)
        if self.spec.pooling == 1:
            return scores
        return pool_by_position(scores, view.positions, view.valid, self.spec.pooling, mean=self.spec.pools_by_mean)
