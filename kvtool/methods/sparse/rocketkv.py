"""RocketKV stage 2 (Behnam et al., 2025, arXiv 2502.14051): hybrid sparse attention over key summaries.

Every group of ``summary_tokens`` consecutive float slots of a stream keeps the per-channel max
and min of its keys (`LayerStore`, ``kmax`` / ``kmin``). A decode step approximates the
attention each group can receive and reads only the best groups, exactly:

1. sign per channel from the group's queries summed (one sign per KV head, as in the paper's
   GQA form); a group's summary key is ``max over its tokens of k * sign`` = kmax where the
   sign is +, -kmin where it is -, and ``q * sign`` is non-negative, so ``(q * sign) . summary``
   bounds the group's logits from above for every row that shares the sign (Quest's bound);
2. head-dimension reduction: only the ``channels`` fraction of channels with the largest
   mean |q| over the query rows are used, and the approximate logits are divided by
   ``sqrt(D * |q_hat|_1 / |q|_1)`` as the paper does, so a partial dot product is not
   over-confident; sequence-dimension reduction is the summary group (the paper's chunk of
   ceil(sqrt(compression)) tokens: 2 when a quarter is read);
3. softmax of the approximate logits per query row, averaged over the rows, and the top
   ``max(min_tokens, read_fraction x tokens held)`` tokens' groups per stream are read: the fraction
   rounded down to whole groups (a step never reads more than ``read_fraction`` of what a stream
   holds, unless ``min_tokens`` asks for more), ``min_tokens`` rounded up.

Why groups and not whole 16-token blocks: measured on SmolLM2-135M (512 tokens, every layer and
KV head, one decode step), the attention mass the selected quarter of the tokens receives is
0.878 with 2-token summaries against 0.916 for the best possible quarter, 0.811 with 4, 0.754
with 8 and 0.710 with 16 (Quest's page size): a max/min over many tokens bounds too loosely.
One-token groups go further at no extra cost: the keys are their own summaries (nothing more is
stored), and scoring half the channels of every key reads as many bytes as the max and min of
2-token groups at half the channels. On SmolLM2-135M after stage 1 (16 windows, a quarter read)
stage 2 costs +1.06% perplexity with them against +1.45% with 2-token summaries; the exact best
quarter costs about +0.94% (`benchmarks/RESULTS.md`). The bundled recipe uses them.

What is selected is read in full precision and attended exactly (`paged_attention.attend`);
the new token always sees itself. Nothing is freed: memory is stage 1's business, and the
summaries cost 2 / summary_tokens of the key bytes (none for one-token groups).
"""

from __future__ import annotations

import math

import torch

from kvtool.recipe import SparseAttentionSpec


def groups_to_read(spec: SparseAttentionSpec, held_tokens: torch.Tensor) -> torch.Tensor:
    """(S,) int64 summary groups a step reads of streams holding ``held_tokens`` (S,) tokens."""
    n = spec.summary_tokens
    held = -(-held_tokens // n)  # groups held
    if spec.read_fraction >= 1.0:
        return held  # every group, the last partly filled one included
    wanted = torch.floor(spec.read_fraction * held_tokens.double() / n + 1e-9).long()  # never over the fraction
    wanted = torch.maximum(wanted, torch.full_like(wanted, -(-spec.min_tokens // n)))
    return torch.minimum(wanted, held)


def approximate_group_logits(
    q: torch.Tensor,  # (S, g, R, D) float32, already multiplied by the softmax scale
    kmax: torch.Tensor,  # (S, N, g, D) per-group key max
    kmin: torch.Tensor,  # (S, N, g, D) per-group key min
    channels: float,
    scaling: float,
) -> torch.Tensor:
    """(S, g, R, N) approximate logits of every row against every summary group (steps 1-2 above)."""
    s, g, r, d = q.shape
    sign = torch.where(q.sum(dim=2, keepdim=True) >= 0, 1.0, -1.0)  # (S, g, 1, D)
    summary = torch.where(sign > 0, kmax.float().transpose(1, 2), -kmin.float().transpose(1, 2))  # (S, g, N, D)
    signed_q = q * sign  # (S, g, R, D)
    kept = max(1, round(channels * d))
    if kept < d:
        top = q.abs().mean(dim=2, keepdim=True).topk(kept, dim=-1).indices  # (S, g, 1, r)
        q_hat = signed_q.gather(-1, top.expand(s, g, r, kept))  # (S, g, R, r)
        summary = summary.gather(-1, top.expand(s, g, summary.shape[2], kept))  # (S, g, N, r)
    else:
        q_hat = signed_q
    fraction = q_hat.abs().sum(dim=-1, keepdim=True) / q.abs().sum(dim=-1, keepdim=True).clamp(min=1e-30)  # (S, g, R, 1)
    # the paper's logits are (Q_hat . K_hat) / sqrt(D * fraction) with an unscaled Q; q here carries ``scaling``
    return torch.matmul(q_hat, summary.transpose(-1, -2)) / (scaling * torch.sqrt(d * fraction.clamp(min=1e-30)))


def select_groups(
    spec: SparseAttentionSpec,
    q: torch.Tensor,  # (S, g, R, D) float32, scaled
    kmax: torch.Tensor,  # (S, N, g, D)
    kmin: torch.Tensor,
    held_tokens: torch.Tensor,  # (S,) int64 tokens each stream holds
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups (S, K) int64 to read, best first; count (S,) how many of them each stream reads).

    K = the most any stream reads; entries past a stream's count are to be ignored.
    """
    width = kmax.shape[1]
    logits = approximate_group_logits(q, kmax, kmin, spec.channels, scaling)  # (S, g, R, N)
    held = -(-held_tokens // spec.summary_tokens)
    absent = torch.arange(width, device=q.device)[None] >= held[:, None]  # (S, N)
    logits = logits.masked_fill(absent[:, None, None, :], -math.inf)
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=(1, 2))  # (S, N)
    count = groups_to_read(spec, held_tokens)
    most = int(count.max()) if count.numel() else 0
    groups = weights.masked_fill(absent, -1.0).topk(most, dim=-1).indices  # (S, K)
    return groups, count
