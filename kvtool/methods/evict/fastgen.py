"""FastGen (Ge et al., "Model Tells You What to Discard", ICLR 2024): per-KV-head kept sets.

Each KV head gets one of five policies, in order of cost; each keeps a superset of
the one before:

0. ``special``: special tokens (BOS, the tokenizer's special ids) and the sinks;
1. ``punctuation``: + punctuation tokens (see `token_classes`);
2. ``local``: + the last ceil(local_ratio x n) tokens;
3. ``frequent``: + the ceil(frequent_ratio x n) tokens with the most accumulated
   attention (heavy hitters, chosen among all n tokens);
4. ``full``: every token.

`kvtool profile` measures, per KV head, how much attention mass each kept set
recovers and `choose_policies` picks the cheapest one above the threshold T. The
runtime applies the chosen policy with `fastgen_keep` at prefill and at every
generated token.

Counts use ceil(ratio x n) computed in float64 with a 1e-9 slack, so 0.3 x 10
keeps 3 tokens, not 4. Ties among heavy hitters go to the older token.
"""

from __future__ import annotations

import unicodedata

import torch
from torch import Tensor

FASTGEN_POLICIES = ("special", "punctuation", "local", "frequent", "full")
SPECIAL, PUNCTUATION, LOCAL, FREQUENT, FULL = range(len(FASTGEN_POLICIES))


def _check_policy(policy: int) -> None:
    if not 0 <= int(policy) < len(FASTGEN_POLICIES):
        raise ValueError(f"FastGen policy {policy} is not an index into {FASTGEN_POLICIES}")


def keep_count(ratio: float, lengths: Tensor) -> Tensor:
    """ceil(ratio x n) per length n (int64, same shape), robust to float rounding (0.3 x 10 -> 3)."""
    return torch.ceil(ratio * lengths.to(torch.float64) - 1e-9).clamp(min=0).to(torch.int64)


def fastgen_keep(
    policy: int,
    is_special: Tensor,
    is_punct: Tensor,
    scores: Tensor,
    local_ratio: float,
    frequent_ratio: float,
) -> Tensor:
    """Kept set (T,) bool of one KV-head stream of T tokens (oldest first) under FastGen ``policy``.

    is_special, is_punct: (T,) bool token classes; scores: (T,) float accumulated attention
    (used by ``frequent``). The reference for `fastgen_keep_rows`.
    """
    _check_policy(policy)
    n = scores.shape[0]
    if policy == FULL:
        return torch.ones(n, dtype=torch.bool, device=scores.device)
    keep = is_special.clone()  # (T,)
    if policy >= PUNCTUATION:
        keep |= is_punct
    if policy >= LOCAL:
        local = int(keep_count(local_ratio, torch.tensor(n)))
        keep[n - local :] = True  # local == 0: empty slice
    if policy >= FREQUENT:
        frequent = int(keep_count(frequent_ratio, torch.tensor(n)))
        order = torch.sort(scores, descending=True, stable=True).indices  # (T,) older first among ties
        keep[order[:frequent]] = True
    return keep


def fastgen_keep_rows(
    policy: int,
    is_special: Tensor,
    is_punct: Tensor,
    scores: Tensor,
    lengths: Tensor,
    local_ratio: float,
    frequent_ratio: float,
) -> Tensor:
    """`fastgen_keep` for many streams at once: row r is a stream holding keys 0..lengths[r]-1.

    is_special, is_punct: (..., T) bool, broadcast over rows; scores: (..., R, T) accumulated
    attention (entries at keys >= the row's length are ignored); lengths: (R,) int64 in 1..T.
    Returns (..., R, T) bool (may be a broadcast view), False at keys outside a row's stream.
    """
    _check_policy(policy)
    t = scores.shape[-1]
    keys = torch.arange(t, device=scores.device)  # (T,)
    lengths = lengths.to(scores.device)
    seen = keys < lengths[:, None]  # (R, T)
    if policy == FULL:
        return seen.expand(torch.broadcast_shapes(is_special[..., None, :].shape, scores.shape))
    keep = is_special[..., None, :] & seen  # (..., R, T)
    if policy >= PUNCTUATION:
        keep = keep | (is_punct[..., None, :] & seen)
    if policy >= LOCAL:
        first_local = lengths - keep_count(local_ratio, lengths)  # (R,)
        keep = keep | (seen & (keys >= first_local[:, None]))
    if policy >= FREQUENT:
        keep = keep | _top_rows(scores, seen, keep_count(frequent_ratio, lengths))
    return keep.expand(torch.broadcast_shapes(keep.shape, scores.shape))


def _top_rows(scores: Tensor, seen: Tensor, counts: Tensor) -> Tensor:
    """(..., R, T) bool: per row the ``counts[r]`` best-scored seen keys (older first among ties)."""
    masked = scores.float().masked_fill(~seen, float("-inf"))  # (..., R, T)
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices  # (..., R, T)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return ranks < counts[:, None]  # (..., R, T)


def choose_policies(mass: Tensor, threshold: float) -> Tensor:
    """(L, H) int64: per KV head the first (cheapest) policy whose recovered mass (L, H, 5) >= threshold.

    ``full`` always qualifies (its mass is 1 up to rounding).
    """
    qualifies = mass >= threshold  # (L, H, 5)
    qualifies[..., FULL] = True
    return qualifies.to(torch.int64).argmax(dim=-1)  # argmax returns the first True


def _is_punctuation_text(text: str) -> bool:
    stripped = text.strip()
    if stripped:
        return "\ufffd" not in stripped and all(unicodedata.category(c)[0] in "PS" for c in stripped)
    return "\n" in text


def token_classes(tokenizer) -> tuple[Tensor, Tensor]:
    """(special_ids, punctuation_ids) int64 of a Hugging Face tokenizer, each sorted.

    special_ids: the tokenizer's special ids (BOS, EOS, PAD, ...). punctuation_ids: every
    other id whose decoded text, stripped of whitespace, is non-empty and made only of
    Unicode punctuation (P*) or symbol (S*) characters (``.,;:!?"'()-``, ``$``, ``+``), plus
    whitespace-only tokens holding a newline. Partial UTF-8 byte tokens (decoding to
    U+FFFD) are not punctuation.
    """
    special = sorted({int(i) for i in tokenizer.all_special_ids})
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    specials = set(special)
    punct = [i for i, text in enumerate(texts) if i not in specials and _is_punctuation_text(text)]
    return torch.tensor(special, dtype=torch.int64), torch.tensor(punct, dtype=torch.int64)


# --- runtime policy ---------------------------------------------------------------------------

from kvtool.methods.evict.base import EvictionPolicy, StreamView, register_policy, whole_units  # noqa: E402


@register_policy("fastgen")
class FastGen(EvictionPolicy):
    """Apply each KV head's profiled policy (``heads.policy`` (L, H_kv) from `kvtool profile`).

    The streams hold only the tokens kept so far, so the local window and the number of
    heavy hitters are fractions of the tokens the *sequence* has seen (``view.length``), as
    in profiling where nothing had been evicted yet; the budget is ignored. Heavy hitters:
    most accumulated attention, the older token first among ties.
    """

    uses_token_classes = True
    budgeted = False

    def keep(self, view: StreamView, budget: Tensor) -> Tensor:
        policies = self.profile["heads.policy"].to(view.heads.device)[view.layer, view.heads][:, None]  # (S, 1)
        keep = view.is_special.clone()
        keep |= (policies >= PUNCTUATION) & view.is_punct
        local = keep_count(self.spec.local_ratio, view.length)  # (S,)
        keep |= (policies >= LOCAL) & (view.positions > (view.latest() - local)[:, None])
        frequent = torch.minimum(keep_count(self.spec.frequent_ratio, view.length), view.valid.sum(dim=1))
        by_age = torch.sort(view.positions.masked_fill(~view.valid, torch.iinfo(torch.int64).max), dim=1, stable=True).indices
        attention = view.attention.float().masked_fill(~view.valid, -float("inf")).gather(1, by_age)
        order = by_age.gather(1, torch.sort(attention, dim=1, descending=True, stable=True).indices)  # older first among ties
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
        keep |= (policies >= FREQUENT) & (rank < frequent[:, None])
        keep = torch.where(policies == FULL, view.valid, keep & view.valid)
        return whole_units(keep, view)
