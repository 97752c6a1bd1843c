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
recovers (`recovered_mass`) on calibration text, and `choose_policies` picks the cheapest
one above the threshold T: one policy map for every prompt (``profile_source: offline``).
With ``profile_source: prompt`` (the paper's mode) the runtime makes the same choice per
(sequence, KV head) at each prefill, from that prompt's own attention (`choose_from_prompt`).
The runtime applies the chosen policy (`kept_sets`) at prefill and at every generated token.

Counts use ceil(ratio x n) computed in float64 with a 1e-9 slack, so 0.3 x 10
keeps 3 tokens, not 4. Ties among heavy hitters go to the older token.

Which attention decides at a prompt. The paper picks, at prompt encoding, the cheapest policy C
with |A - softmax(Q K_C^T)| <= 1 - T for the prompt's attention map A. kvtool measures the kept
set the runtime will actually hold from then on (the one at the end of the prompt: local window
and heavy hitters counted from the whole prompt, heavy hitters by the attention accumulated over
all prompt queries) against the attention of the prompt's last ``eviction.window`` (32) queries,
summed over the GQA group's query heads: (1) early queries attend to their own neighbourhood,
which the final local window does not hold, so scoring the final set with all queries would
wrongly push every local head to ``full``, and scoring each query with its own kept set (what
`kvtool profile` does) needs every query's whole attention row, T x T per head, which the
runtime never forms (it sums attention per token, chunk by chunk); (2) the last queries are the
best stand-in for the generated tokens that will read the cache (SnapKV's observation window),
and they include the question of a question-at-the-end prompt. The threshold then reads as: the
kept set holds >= T of what the end of the prompt attends to. The mass is a share in float64
(the window's attention over the held tokens is the whole), so T = 1 keeps every token that
received any attention.
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
    """(...) int64: per KV head the first (cheapest) policy whose recovered mass (..., 5) >= threshold.

    mass (L, H, 5) from a profile, or (S, 5) per stream at a prompt. ``full`` always qualifies
    (its mass is 1 up to rounding).
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


def fastgen_token_classes(tokenizer) -> dict[str, Tensor]:
    """``{"tokens.special", "tokens.punctuation"}``: `token_classes` in the form a runtime's profile carries them.

    What FastGen chosen per prompt needs instead of a profile (``profile_source: prompt``).
    """
    special, punct = token_classes(tokenizer)
    return {"tokens.special": special, "tokens.punctuation": punct}


# --- runtime policy ---------------------------------------------------------------------------

from kvtool.methods.evict.base import EvictionPolicy, StreamView, register_policy, whole_units  # noqa: E402


@register_policy("fastgen")
class FastGen(EvictionPolicy):
    """Apply each KV head's policy: profiled offline (``heads.policy`` (L, H_kv) from `kvtool profile`) or
    chosen per (sequence, KV head) from the prompt's own attention (``eviction.profile_source: prompt``).

    The streams hold only the tokens kept so far, so the local window and the number of
    heavy hitters are fractions of the tokens the *sequence* has seen (``view.length``), as
    in profiling where nothing had been evicted yet; the budget is ignored. Heavy hitters:
    most accumulated attention, the older token first among ties.

    Per-prompt choice (the paper's mode, see `choose_from_prompt`): at every forward of several
    tokens (the prefill, a later chat turn) each stream takes the cheapest policy whose kept set
    recovers >= T of the attention the last ``window`` queries of that forward pay to the tokens
    the stream holds; the choice is kept in ``view.stream_state`` (the layer stores it per
    stream) and applied at every generated token. Tokens already evicted are never re-admitted.
    A stream never chosen for (a sequence that only ever decoded single tokens) keeps everything;
    one whose sequence is only padding in a later forward keeps its earlier choice.
    """

    uses_token_classes = True
    budgeted = False

    def keep(self, view: StreamView, budget: Tensor) -> Tensor:
        kept = kept_sets(view, self.spec.local_ratio, self.spec.frequent_ratio)  # (S, 5, N)
        policies = self.stream_policies(view, kept)  # (S,)
        keep = kept.gather(1, policies[:, None, None].expand(-1, 1, kept.shape[2]))[:, 0]  # (S, N)
        return whole_units(keep, view)

    def stream_policies(self, view: StreamView, kept: Tensor) -> Tensor:
        """(S,) int64 policy index of each stream for this forward."""
        previous = self.decode_policies(view.layer, view.heads, view.stream_state)
        if self.spec.profile_source == "prompt" and view.window_attention is not None:  # several tokens: choose
            chosen = choose_from_prompt(view.window_attention, kept, view.valid, self.spec.threshold)
            attended = (view.window_attention * view.valid).sum(dim=1) > 0  # (S,) False: only padding this forward
            view.stream_state = torch.where(attended, chosen, previous)
            return view.stream_state
        return previous

    def decode_policies(self, layer: int, heads: Tensor, stream_state: Tensor | None) -> Tensor:
        """(S,) int64 policy of each stream (KV heads ``heads`` (S,) of ``layer``) at a decode step: the profile's, or
        the one chosen at the stream's last prompt (``stream_state``; every token while none was chosen)."""
        if self.spec.profile_source == "offline":
            return self.profile["heads.policy"].to(heads.device)[layer, heads].long()
        return stream_state if stream_state is not None else torch.full_like(heads, FULL)


def kept_sets(view: StreamView, local_ratio: float, frequent_ratio: float) -> Tensor:
    """(S, 5, N) bool: what each FastGen policy keeps of every stream, nested (policy p keeps all of p - 1 keeps).

    special / +punctuation: token classes; +local: positions within the last ceil(local_ratio x length)
    of the sequence; +frequent: the ceil(frequent_ratio x length) held tokens with the most
    accumulated attention (older first among ties); full: every held token.
    """
    local = keep_count(local_ratio, view.length)  # (S,)
    recent = view.positions > (view.latest() - local)[:, None]  # (S, N)
    frequent = torch.minimum(keep_count(frequent_ratio, view.length), view.valid.sum(dim=1))  # (S,)
    by_age = torch.sort(view.positions.masked_fill(~view.valid, torch.iinfo(torch.int64).max), dim=1, stable=True).indices
    attention = view.attention.float().masked_fill(~view.valid, -float("inf")).gather(1, by_age)
    order = by_age.gather(1, torch.sort(attention, dim=1, descending=True, stable=True).indices)  # older first among ties
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    special = view.is_special & view.valid  # (S, N)
    punctuation = special | (view.is_punct & view.valid)
    local_set = punctuation | (recent & view.valid)
    frequent_set = local_set | ((rank < frequent[:, None]) & view.valid)
    return torch.stack([special, punctuation, local_set, frequent_set, view.valid], dim=1)


def recovered_mass(attention: Tensor, kept: Tensor) -> Tensor:
    """Attention mass a kept set recovers: sum over keys of ``attention`` (..., T) where ``kept`` (..., T) (broadcast).

    With rows that sum to one this is the share of the row's attention the kept tokens get;
    `kvtool profile` averages it over rows, the per-prompt choice normalises the window's sums.
    """
    return (attention * kept).sum(dim=-1)


def choose_from_prompt(window_attention: Tensor, kept: Tensor, valid: Tensor, threshold: float) -> Tensor:
    """(S,) int64: per stream the cheapest policy whose kept set (S, 5, N) recovers >= ``threshold`` of its attention.

    window_attention (S, N): attention the forward's last ``window`` queries paid to every slot,
    summed over those queries and the GQA group's query heads (never expanded per KV head), in
    float64 normalised to a share per stream. A stream that received no attention (padding only)
    gets ``full`` (the runtime keeps such a stream's earlier choice).
    """
    attention = window_attention.double().masked_fill(~valid, 0.0)  # (S, N)
    share = attention / attention.sum(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
    return choose_policies(recovered_mass(share[:, None, :], kept), threshold)  # (S, 5) -> (S,)
