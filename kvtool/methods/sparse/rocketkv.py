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

``unread: estimate`` (kvtool's extension, not in the paper; one-token groups only): the paper
drops the tokens a step does not read from the softmax, so the attention they would have
received goes to the tokens read. kvtool adds them back as one softmax term (`unread_term`): its
logit is the logsumexp of their partial logits (step 2's q_hat . k_hat, which the selection
computed anyway: no extra reads), each completed on the unscored channels by q . (the unread
keys' mean); its value is the unread values' mean. The means come from per-block key and value
sums the store keeps (`LayerStore.token_sums`: 1 / 16 of the bytes read per step, 1 / 16 held)
less what the step read. Exact when nothing is left unread; the unread tokens' values are
weighted evenly, which is close because they are the ones with the least attention.

``unread: estimate_blocks`` (kvtool's extension, one-token groups only): the same term estimated per
16-slot float block (`unread_blocks_term`): each unread token's partial logit is completed by its
own block's mean key, and each block's share of the unread mass takes the block's mean value, so the
unread tokens' values are no longer weighted evenly. It reads the same block sums and needs no sums
of what the step read.

``read_budget: shared`` (kvtool's extension, AdaKV's idea applied to reads): the KV heads of one
sequence in a layer share one budget, the sum of their own; the groups with the largest selection
weights across those heads are read (each head's weights sum to 1, so they compare as attention
probabilities), each head keeping its ``min_tokens`` first. A sharp head that needs a few tokens
leaves its reads to a broad one; the sequence reads as much as before (`_share_reads`).

``channel_score: query_key`` (kvtool's extension): step 2 ranks the channels by mean |q| times
the standard deviation of the held keys (from per-block key and squared-key sums), not by |q|
alone: a channel whose keys hardly vary says nothing about which token to read. On Gemma-3-270M
(256-dim q/k-normed heads) the paper's rule makes stage 2 cost +15.3% perplexity and the
pass key fall to 0.4 at 50% kept; this rule +0.18% and 0.9 (`benchmarks/RESULTS.md`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def partial_logits(
    q: torch.Tensor,  # (S, g, R, D) float32, already multiplied by the softmax scale
    kmax: torch.Tensor,  # (S, N, g, D) per-group key max
    kmin: torch.Tensor,  # (S, N, g, D) per-group key min
    channels: float,
    key_scale: torch.Tensor | None = None,  # (S, g, D) per-channel key magnitude: channels ranked by |q| x it
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(partial (S, g, R, N), fraction (S, g, R, 1), used (S, g, 1, D) bool or None for every channel): every row's dot
    product with every group's summary over the ``channels`` fraction of channels (steps 1-2 above; with one-token
    groups q_hat . k_hat, the true logit's part on those channels), the share of |q|_1 those channels carry, and
    which channels they are: the largest mean |q| over the rows, times ``key_scale`` when given."""
    s, g, r, d = q.shape
    sign = torch.where(q.sum(dim=2, keepdim=True) >= 0, 1.0, -1.0)  # (S, g, 1, D)
    summary = torch.where(sign > 0, kmax.float().transpose(1, 2), -kmin.float().transpose(1, 2))  # (S, g, N, D)
    signed_q = q * sign  # (S, g, R, D)
    kept = max(1, round(channels * d))
    used = None
    if kept < d:
        weight = q.abs().mean(dim=2, keepdim=True)  # (S, g, 1, D)
        if key_scale is not None:
            weight = weight * key_scale[:, :, None, :]
        top = weight.topk(kept, dim=-1).indices  # (S, g, 1, r)
        q_hat = signed_q.gather(-1, top.expand(s, g, r, kept))  # (S, g, R, r)
        summary = summary.gather(-1, top.expand(s, g, summary.shape[2], kept))  # (S, g, N, r)
        used = torch.zeros(s, g, 1, d, dtype=torch.bool, device=q.device).scatter_(-1, top, True)
    else:
        q_hat = signed_q
    fraction = q_hat.abs().sum(dim=-1, keepdim=True) / q.abs().sum(dim=-1, keepdim=True).clamp(min=1e-30)  # (S, g, R, 1)
    return torch.matmul(q_hat, summary.transpose(-1, -2)), fraction, used


def approximate_group_logits(
    q: torch.Tensor,  # (S, g, R, D) float32, already multiplied by the softmax scale
    kmax: torch.Tensor,  # (S, N, g, D) per-group key max
    kmin: torch.Tensor,  # (S, N, g, D) per-group key min
    channels: float,
    scaling: float,
) -> torch.Tensor:
    """(S, g, R, N) approximate logits of every row against every summary group (steps 1-2 above)."""
    partial, fraction, _ = partial_logits(q, kmax, kmin, channels)
    return paper_logits(partial, fraction, scaling, q.shape[-1])


def paper_logits(partial: torch.Tensor, fraction: torch.Tensor, scaling: float, d: int) -> torch.Tensor:
    """The paper's approximate logits (Q_hat . K_hat) / sqrt(D * fraction) for an unscaled Q (q here carries
    ``scaling``): a partial dot product is not over-confident."""
    return partial / (scaling * torch.sqrt(d * fraction.clamp(min=1e-30)))


@dataclass
class Selection:
    """What a sparse step reads, and what the selection computed on the way (for ``unread: estimate``)."""

    groups: torch.Tensor  # (S, K) int64 summary groups to read, best first
    count: torch.Tensor  # (S,) how many of them each stream reads (entries past it are to be ignored)
    partial: torch.Tensor  # (S, g, R, N) partial logits (`partial_logits`), -inf past a stream's groups
    used: torch.Tensor | None  # (S, g, 1, D) bool channels they were computed on, None for all


def select_groups(
    spec: SparseAttentionSpec,
    q: torch.Tensor,  # (S, g, R, D) float32, scaled
    kmax: torch.Tensor,  # (S, N, g, D)
    kmin: torch.Tensor,
    held_tokens: torch.Tensor,  # (S,) int64 tokens each stream holds
    scaling: float,
    key_scale: torch.Tensor | None = None,  # (S, g, D): ``channel_score: query_key``'s spread of the held keys
    streams_per_sequence: int = 1,  # H: streams s = b H + j belong to sequence b (``read_budget: shared``)
) -> Selection:
    """The summary groups each stream reads (K = the most any stream reads)."""
    width = kmax.shape[1]
    partial, fraction, used = partial_logits(q, kmax, kmin, spec.channels, key_scale)  # (S, g, R, N), (S, g, R, 1)
    held = -(-held_tokens // spec.summary_tokens)
    absent = torch.arange(width, device=q.device)[None] >= held[:, None]  # (S, N)
    partial = partial.masked_fill(absent[:, None, None, :], -math.inf)
    logits = paper_logits(partial, fraction, scaling, q.shape[-1])
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=(1, 2))  # (S, N), each held row sums to 1
    count = groups_to_read(spec, held_tokens)
    if spec.read_budget == "shared" and streams_per_sequence > 1:
        count = _share_reads(spec, weights.masked_fill(absent, -1.0), count, held, streams_per_sequence)
    most = int(count.max()) if count.numel() else 0
    groups = weights.masked_fill(absent, -1.0).topk(most, dim=-1).indices  # (S, K)
    return Selection(groups, count, partial, used)


def _share_reads(spec: SparseAttentionSpec, weights: torch.Tensor, count: torch.Tensor, held: torch.Tensor,
                 h: int) -> torch.Tensor:
    """``read_budget: shared``: (S,) groups each stream reads when the H streams of a sequence share their budget
    (the sum of their own ``count``) by weight (S, N) (-1 where absent; every stream's weights sum to 1, so they
    compare across heads as attention probabilities). Each stream keeps its ``min_tokens`` share first.

    A stream's selected groups are then its best ``count`` by weight, as without sharing."""
    s, n = weights.shape
    floor = torch.minimum(torch.full_like(held, -(-spec.min_tokens // spec.summary_tokens)), held)  # (S,)
    best = weights.argsort(dim=-1, descending=True)  # (S, N) each stream's groups, best first
    first = (torch.arange(n, device=weights.device)[None] < floor[:, None]).to(weights.dtype)  # (S, N) by rank
    bonus = torch.zeros_like(weights).scatter_(1, best, first) * 2.0  # the per-stream floor first (weights are <= 1)
    pooled = (weights + bonus).reshape(s // h, h * n)  # (B, H N)
    budget = count.reshape(s // h, h).sum(dim=1)  # (B,)
    order = pooled.argsort(dim=-1, descending=True)
    chosen = torch.arange(h * n, device=weights.device)[None] < budget[:, None]  # (B, H N) by order
    taken = torch.zeros_like(chosen).scatter_(1, order, chosen)  # (B, H N) by group
    return taken.reshape(s, n).sum(dim=1)


def unread_logsumexp(partial: torch.Tensor, groups: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp (S, g, R) of the partial logits of the groups a step does not read, -inf where it reads them all;
    unread (S,) how many groups that is). partial (S, g, R, N) -inf past a stream's groups; groups (S, K), count (S,)
    as `select_groups` returns them."""
    read = _read_columns(groups, count, partial.shape[-1])  # (S, N)
    unread = partial.masked_fill(read[:, None, None, :], -math.inf)
    return torch.logsumexp(unread, dim=-1), _unread_count(partial, read)


def _read_columns(groups: torch.Tensor, count: torch.Tensor, n: int) -> torch.Tensor:
    """(S, N) bool: the groups a step reads, from groups (S, K) ranked and count (S,) (entries past it ignored)."""
    rank = torch.arange(groups.shape[1], device=groups.device)[None]  # (1, K)
    read = torch.zeros(groups.shape[0], n + 1, dtype=torch.bool, device=groups.device)
    read.scatter_(1, torch.where(rank < count[:, None], groups, n), True)  # column n: the unused ranks' sink
    return read[:, :n]


def _unread_count(partial: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """(S,) held groups not read: partial (S, g, R, N) is -inf past a stream's groups, read (S, N)."""
    return (torch.isfinite(partial[:, 0, 0]) & ~read).sum(dim=1)


def unread_term(
    selection: Selection,
    q: torch.Tensor,  # (S, g, R, D) float32, scaled
    held_sums: tuple[torch.Tensor, torch.Tensor],  # (S, g, D) float32 x 2: every held key's and value's sum
    read_sums: tuple[torch.Tensor, torch.Tensor],  # (S, g, D) float32 x 2: the read ones'
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``unread: estimate`` (one-token groups): (logit (S, g, R), value (S, g, D), unread (S,)) of one softmax term that
    stands for the held tokens a step does not read.

    logit: the logsumexp of their partial logits (the channels the selection scored), each completed on the other
    channels by q . (the unread keys' mean); value: the unread values' mean. The means come from the store's sums
    less what the step read. Measured on SmolLM2-135M (768 tokens, every layer, the last query, the exact best quarter
    read): the attention output's relative error is 0.060 with the unread dropped, 0.042 with the partial logits
    alone, 0.031 completed with the mean (0.031 with the exact logits)."""
    lse, unread = unread_logsumexp(selection.partial, selection.groups, selection.count)  # (S, g, R), (S,)
    per_token = unread.clamp(min=1)[:, None, None].float()
    mean_key = (held_sums[0] - read_sums[0]) / per_token  # (S, g, D)
    mean_value = (held_sums[1] - read_sums[1]) / per_token
    if selection.used is not None:
        rest = (q * mean_key[:, :, None, :]).masked_fill(selection.used, 0.0).sum(dim=-1)  # (S, g, R)
        lse = lse + rest
    return lse, mean_value, unread


def unread_blocks_term(
    selection: Selection,
    q: torch.Tensor,  # (S, g, R, D) float32, scaled
    block_sums: tuple[torch.Tensor, torch.Tensor],  # (S, F, g, D) float32 x 2: each float block's key and value sums
    block_counts: torch.Tensor,  # (S, F) tokens each float block holds
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``unread: estimate_blocks`` (one-token groups; group j = float slot j, block j // fbs): (logit (S, g, R), value
    (S, g, R, D), unread (S,)) of one softmax term that stands for the held tokens a step does not read.

    Each unread token's logit is its partial logit completed on the unscored channels by q . (its block's mean key);
    the term's logit is their logsumexp, its value the blocks' mean values weighted by each block's share of that
    mass. Block means are over every token of the block, read or not: nothing is subtracted, so the kernel need not
    sum what it reads, and the term weighs nothing when every token is read. Measured offline on SmolLM2-135M (7
    windows of 768 tokens, every layer, 3 queries each, the best quarter by the selection's own weights read, half
    the channels scored): the attention output's relative error is 0.030 with `unread_term`, 0.023 with this (0.060
    with the unread dropped); Gemma-3-270M's global layers 0.072 -> 0.065."""
    partial = selection.partial  # (S, g, R, N)
    s, g, r, n = partial.shape
    f = block_counts.shape[1]
    fbs = n // max(f, 1)
    read = _read_columns(selection.groups, selection.count, n)  # (S, N)
    logits = partial.masked_fill(read[:, None, None, :], -math.inf)  # (S, g, R, N): the unread tokens' partial logits
    per_block = block_counts.clamp(min=1)[:, :, None, None].float()  # (S, F, 1, 1)
    mean_key = (block_sums[0] / per_block).transpose(1, 2)  # (S, g, F, D)
    mean_value = (block_sums[1] / per_block).transpose(1, 2)  # (S, g, F, D)
    if selection.used is not None:
        rest = torch.matmul(q.masked_fill(selection.used, 0.0), mean_key.transpose(-1, -2))  # (S, g, R, F)
        logits = (logits.reshape(s, g, r, f, fbs) + rest[..., None]).reshape(s, g, r, n)
    block_lse = torch.logsumexp(logits.reshape(s, g, r, f, fbs), dim=-1)  # (S, g, R, F)
    lse = torch.logsumexp(block_lse, dim=-1)  # (S, g, R)
    share = torch.exp(block_lse - lse[..., None]).nan_to_num(0.0)  # (S, g, R, F): 0 where nothing is unread
    return lse, torch.matmul(share, mean_value), _unread_count(partial, read)
