"""Base class of token-eviction policies: the plumbing every policy shares.

A policy looks at every (sequence, KV head) stream of one layer at once, each padded to
N slots (the stored tokens, then the tokens of the current forward), and says which to
keep. Subclasses override `token_scores` (higher = keep) and, when they score tokens by
something fixed at insertion (a key or value norm), `token_feature`; nothing else. `keep`
protects the first ``sink_tokens`` positions and the last ``window`` positions, then fills
each stream's budget with the best-scored *units*: a unit is one token, or one quantized
block of ``block_size`` tokens (its codes share scales, so it is freed whole). Everything
is batched over streams with tensor ops: no Python loop over sequences or heads. FastGen
overrides `keep` (its per-head policies imply their own sizes). Policies never import the
runtime; the runtime calls them through the registry (`policy_class`) and three hooks whose
defaults change nothing: `window_observer` (more statistics of the window's attention),
`layer_weights` (a policy's own per-layer budget schedule) and `budget_rule` (budgets that
depend on what the policy measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtool.errors import RecipeError
from kvtool.recipe import EvictionSpec


@dataclass
class StreamView:
    """What a policy may look at: every stream of one layer, (S, N) per slot unless noted.

    positions int64: original positions (garbage where not ``valid``); valid bool: the slot
    holds a token; length (S,) int64: tokens the stream's sequence has seen; attention
    float32: attention received so far, summed over the group's query heads and every query
    (this forward included; zeros when the policy does not use attention); window_attention:
    at prefill only, attention from the last ``window`` query tokens (SnapKV), else None;
    feature float32 or None: `token_feature` of each token, computed when it arrived;
    is_special / is_punct bool: FastGen token classes; current_attention: attention from this
    forward's newest queries only (the last ``window`` at prefill, the single query when
    decoding; TOVA), or None when the policy does not use attention; units int64: unit id per slot in
    [0, unit_count), slots of one unit are kept or freed together; layer: the layer index;
    heads (S,) int64: the KV head of each stream; window_stats: at prefill, the sums of the
    policy's `window_observer` statistics per slot (name -> (S, N)), else None; stream_state
    (S,) int64 or None: a per-stream value the policy keeps between forwards (FastGen's
    per-prompt mode: each stream's chosen policy); the policy may replace it in `keep` and the
    layer stores it, selects it with its sequences (beam search) and counts its bytes; window
    (S,) int64 or None: each stream's recent window (`EvictionPolicy.recent_window`; None: the
    recipe's ``window``).
    """

    positions: torch.Tensor
    valid: torch.Tensor
    length: torch.Tensor
    attention: torch.Tensor
    window_attention: torch.Tensor | None
    feature: torch.Tensor | None
    is_special: torch.Tensor
    is_punct: torch.Tensor
    units: torch.Tensor
    unit_count: int
    layer: int
    heads: torch.Tensor
    current_attention: torch.Tensor | None = None
    window_stats: dict[str, torch.Tensor] | None = None
    stream_state: torch.Tensor | None = None
    window: torch.Tensor | None = None

    @property
    def single_token_units(self) -> bool:
        return self.unit_count == self.positions.shape[1]

    def latest(self) -> torch.Tensor:
        """(S,) newest position held per stream."""
        return self.positions.masked_fill(~self.valid, -1).amax(dim=1)


def window_share(rule, layer: int, length: torch.Tensor, window: int) -> torch.Tensor:
    """(S,) the budget ``rule`` gives a sliding-window layer of ``window`` tokens: asked at the tokens it can see
    (min(length, window)), never more than the window."""
    return rule(layer, length.clamp(max=window)).clamp(max=window)


class EvictionPolicy:
    """Decide per stream which tokens stay; see the module docstring."""

    name = "base"
    uses_attention = True  # False: the runtime need not accumulate attention for this policy
    uses_feature = False  # True: the runtime stores `token_feature` per token
    uses_token_classes = False  # True: the runtime records special/punctuation classes per token
    budgeted = True  # False: the kept set follows rules (FastGen), so it is re-selected every step
    evicts_while_decoding = True  # False: only multi-token forwards (prefill, a new chat turn) evict (RocketKV)
    # True (SnapKV and its variants, ChunkKV): at prefill the recent window is SnapKV's observation window (its queries
    # score the older tokens), at most ``window_share`` of the budget; decode steps keep the whole window. False: kept
    # whole: a recency guard against scores that favour old tokens (H2O's attention summed over every query: a smaller
    # one costs the question its first tokens), or a window the policy's budgets and weights count (CAKE, PyramidInfer)
    observes_window = False
    window_aware_budgets = False  # True: `budget_rule` counts sliding-window layers' visible tokens itself (CAKE)
    # the sums of the attention received in a forward of several tokens the policy reads (one token: always its own):
    # "all" (from every query: `StreamView.attention`, which later steps keep adding to) and/or "window" (from the
    # last ``window`` queries: `window_attention`, `current_attention`); the runtime forms only these
    attention_from: tuple[str, ...] = ("all", "window")

    def __init__(self, spec: EvictionSpec, profile: dict[str, torch.Tensor] | None = None) -> None:
        self.spec = spec
        self.profile = profile or {}  # tensors of `kvtool profile` (FastGen head policies), when given

    def token_scores(self, view: StreamView) -> torch.Tensor:
        """(S, N) float scores, higher = more worth keeping."""
        raise NotImplementedError

    def token_feature(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(S, t) a fixed score part of new tokens from their keys/values (S, t, D) float32 (keys after RoPE)."""
        raise NotImplementedError

    def window_observer(self, t: int, window: int):
        """A `WindowStats` fed the attention of the last ``window`` queries of a forward of ``t`` > 1 tokens, or None."""
        return None

    def recent_window(self, visible: torch.Tensor) -> torch.Tensor:
        """(S,) int64 recent window of streams whose layer sees ``visible`` (S,) tokens: ``window`` tokens; for a policy
        that ``observes_window``, at most ``window_share`` of the recipe's budget there (at least one token; see
        `EvictionSpec.window_share`).

        At a multi-token forward the observation window (the queries that score the older tokens) and the
        protected recent tokens are this one window; decode steps protect the recipe's whole ``window``. The
        recipe's budget, not a layer's own share (pyramids, CAKE, AdaKV), sizes it: the question it observes is
        the same in every layer."""
        spec = self.spec
        full = torch.full_like(visible, spec.window)
        if spec.window_share is None or not self.observes_window or not self.budgeted:
            return full
        budget = torch.full_like(visible, spec.budget_tokens) if spec.budget_tokens is not None else ratio_budget(spec.budget, visible)
        share = torch.floor(spec.window_share * budget.double() + 1e-9).long()  # (S,)
        return torch.minimum(full, share.clamp(min=1))

    def layer_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """(L,) per-layer budget weights (mean 1) the runtime's budget rule uses; default: the recipe's."""
        return weights

    def budget_rule(self, rule, num_layers: int, windows: tuple = ()):
        """The budget callable ``(layer, length (S,)) -> (S,)`` the runtime asks; default: its own ``rule``.

        windows: each layer's sliding window or None. Unless the policy is ``window_aware_budgets``, the
        runtime asks a sliding-window layer's budget as `window_share` of the returned rule."""
        return rule

    def protected(self, view: StreamView) -> torch.Tensor:
        """(S, N) bool: sinks (first positions) and the recent window (last positions) are always kept."""
        window = view.window if view.window is not None else self.spec.window  # (S,) or the recipe's
        recent = view.positions > (view.latest() - window)[:, None]
        return view.valid & ((view.positions < self.spec.sink_tokens) | recent)

    def head_scores(self, view: StreamView) -> torch.Tensor:
        """(S, N) scores comparable across the KV heads of a sequence (AdaKV's budget sharing); default `token_scores`."""
        return self.token_scores(view)

    def keep(self, view: StreamView, budget: torch.Tensor) -> torch.Tensor:
        """(S, N) bool keep mask with at most ``budget`` (S,) tokens per stream (all tokens where they fit).

        With ``head_budgets: adaptive`` the budgets of one sequence's streams are first pooled
        and shared by score (`adaptive_budgets`); each stream then keeps its own best tokens.
        """
        protected = self.protected(view)
        scores = self.token_scores(view).float().masked_fill(~view.valid, -math.inf)
        if self.spec.head_budgets == "adaptive":
            shared = scores if type(self).head_scores is EvictionPolicy.head_scores else self.head_scores(view).float()
            budget = adaptive_budgets(shared.masked_fill(~view.valid, -math.inf), protected, view, budget, self.spec.head_floor)
        over = protected.sum(dim=1) >= budget  # the budget cannot even hold the protected tokens
        if view.single_token_units:
            keep = _top_tokens(scores, protected, view.valid, budget)
        else:
            keep = _fill_units(scores, protected, view, budget)
        keep = torch.where(over[:, None], self._sinks_and_newest(view, budget), keep)
        fits = view.valid.sum(dim=1) <= budget
        return torch.where(fits[:, None], view.valid, keep)

    def _sinks_and_newest(self, view: StreamView, budget: torch.Tensor) -> torch.Tensor:
        """Budget smaller than the protected set: keep sinks, then the newest tokens (whole units by majority)."""
        priority = view.positions.float().masked_fill(view.positions < self.spec.sink_tokens, math.inf)
        keep = rank_desc(priority.masked_fill(~view.valid, -math.inf)) < budget[:, None]
        return whole_units(keep & view.valid, view)


def adaptive_budgets(scores: torch.Tensor, protected: torch.Tensor, view: StreamView, budget: torch.Tensor,
                     floor: float) -> torch.Tensor:
    """(S,) budgets of AdaKV (Feng et al., "Ada-KV", 2024): one budget per sequence and layer shared among its heads.

    Streams are sequence-major (stream = sequence x heads + head, ``view.heads``). Each stream
    keeps its protected tokens and its ceil(floor x budget) best tokens (the safeguard); the
    rest of the sequence's summed budget goes to the best-scored remaining tokens of *any* of
    its heads, so a head whose attention is concentrated hands room to a head whose attention
    is spread. Scores must be comparable across heads (softmax attention is: it sums to one
    per query). The sequence's total never exceeds the sum of the uniform budgets.
    """
    s, n = scores.shape
    heads = int(view.heads.max()) + 1 if s else 1
    open_ = view.valid & ~protected
    own_rank = rank_desc(scores.masked_fill(~open_, -math.inf))  # (S, N)
    guaranteed_room = (torch.ceil(floor * budget.double() - 1e-9).long() - protected.sum(dim=1)).clamp(min=0)  # (S,)
    guaranteed = open_ & (own_rank < guaranteed_room[:, None])
    fixed = (protected | guaranteed).sum(dim=1)  # (S,)
    room = (budget.reshape(-1, heads).sum(dim=1) - fixed.reshape(-1, heads).sum(dim=1)).clamp(min=0)  # (B,)
    candidates = (open_ & ~guaranteed).reshape(-1, heads * n)
    joint = rank_desc(scores.reshape(-1, heads * n).masked_fill(~candidates, -math.inf))  # (B, heads N)
    chosen = (candidates & (joint < room[:, None])).reshape(s, n)
    # a stream whose uniform budget cannot hold its protected tokens keeps that budget (sinks and newest)
    return torch.where(protected.sum(dim=1) >= budget, budget, fixed + chosen.sum(dim=1))


def by_position(values: torch.Tensor, view: StreamView, fill) -> torch.Tensor:
    """(S, P) the valid slots' ``values`` (S, N) at their positions, ``fill`` elsewhere (P = largest position + 1)."""
    position = view.positions.masked_fill(~view.valid, 0).long()  # (S, N)
    width = int(position.max()) + 1 if position.numel() else 1
    dense = torch.full((values.shape[0], width), fill, dtype=values.dtype, device=values.device)
    rows = torch.arange(values.shape[0], device=values.device)[:, None].expand_as(position)
    dense[rows[view.valid], position[view.valid]] = values[view.valid]
    return dense


def at_positions(dense: torch.Tensor, view: StreamView, fill) -> torch.Tensor:
    """(S, N) ``dense`` (S, P) read back at the view's slots; ``fill`` for invalid slots and positions >= P."""
    position = view.positions.masked_fill(~view.valid, 0).clamp(max=dense.shape[1] - 1).long()
    inside = view.valid & (view.positions < dense.shape[1])
    return dense.gather(1, position).masked_fill(~inside, fill)


@dataclass
class LayerKept:
    """What one layer kept in one forward, by position (S, P) bool: for a later layer of the same forward."""

    layer: int
    length: torch.Tensor  # (S,) tokens seen by each stream's sequence
    kept: torch.Tensor

    @classmethod
    def record(cls, keep: torch.Tensor, view: StreamView) -> "LayerKept":
        return cls(view.layer, view.length.clone(), by_position(keep, view, False))

    def at(self, view: StreamView, layer: int) -> torch.Tensor | None:
        """(S, N) bool: what ``layer`` kept of the view's slots, when it is this record's layer in the same forward
        (same streams, same lengths); else None."""
        kept = self.at_layer(view, layer)
        return None if kept is None else at_positions(kept, view, False)

    def at_layer(self, view: StreamView, layer: int) -> torch.Tensor | None:
        """(S, P) bool by position, when this is ``layer``'s record of the view's forward; else None."""
        if layer != self.layer or self.length.shape != view.length.shape or not torch.equal(self.length, view.length):
            return None
        return self.kept


def rank_desc(scores: torch.Tensor) -> torch.Tensor:
    """(S, N) rank of each entry in its row, 0 = highest (ties: lower index first)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(1, order, torch.arange(scores.shape[1], device=scores.device).expand_as(order))


def _top_tokens(scores: torch.Tensor, protected: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Protected tokens, then the best-scored others while the budget allows."""
    room = (budget - protected.sum(dim=1)).clamp(min=0)  # (S,)
    rank = rank_desc(scores.masked_fill(protected | ~valid, -math.inf))
    return protected | (valid & ~protected & (rank < room[:, None]))


def unit_sums(values: torch.Tensor, view: StreamView) -> torch.Tensor:
    """(S, U) sum of per-slot values (S, N) over each unit."""
    out = torch.zeros(values.shape[0], view.unit_count, dtype=values.dtype, device=values.device)
    return out.scatter_add_(1, view.units, values)


def whole_units(keep: torch.Tensor, view: StreamView) -> torch.Tensor:
    """Make a keep mask uniform per unit: a unit stays when at least half of its tokens stay."""
    if view.single_token_units:
        return keep
    kept = unit_sums((keep & view.valid).float(), view)
    size = unit_sums(view.valid.float(), view)
    return (kept * 2 >= size).gather(1, view.units) & view.valid & (size.gather(1, view.units) > 0)


def _fill_units(scores: torch.Tensor, protected: torch.Tensor, view: StreamView, budget: torch.Tensor) -> torch.Tensor:
    """Keep protected units, then units by mean score while they fit; leftover room goes to single tokens."""
    size = unit_sums(view.valid.float(), view)  # (S, U)
    mean = unit_sums(scores.masked_fill(~view.valid, 0.0), view) / size.clamp(min=1)
    unit_protected = unit_sums(protected.float(), view) > 0
    open_units = (size > 0) & ~unit_protected
    room = budget.float() - (size * unit_protected).sum(dim=1)  # (S,)
    order = torch.sort(mean.masked_fill(~open_units, -math.inf), dim=1, descending=True, stable=True).indices
    sorted_size = size.gather(1, order) * open_units.gather(1, order)
    fits = torch.cumsum(sorted_size, dim=1) <= room[:, None]  # the best prefix that fits
    keep_unit = unit_protected.clone()
    keep_unit.scatter_(1, order, fits & open_units.gather(1, order) | keep_unit.gather(1, order))
    left = room - (size * (keep_unit & ~unit_protected)).sum(dim=1)  # room the prefix left unused
    singles = open_units & ~keep_unit & (size == 1)
    rank = rank_desc(mean.masked_fill(~singles, -math.inf))
    keep_unit |= singles & (rank < left.clamp(min=0)[:, None])
    return keep_unit.gather(1, view.units) & view.valid


POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(name: str):
    """Class decorator adding an `EvictionPolicy` subclass to the registry under ``name``."""

    def bind(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        if name in POLICIES and POLICIES[name] is not cls:
            raise ValueError(f"eviction policy '{name}' registered twice")
        if not cls.attention_from or not set(cls.attention_from) <= {"all", "window"}:
            raise ValueError(f"eviction policy '{name}': attention_from must name 'all' and/or 'window', not {cls.attention_from}")
        cls.name = name
        POLICIES[name] = cls
        return cls

    return bind


def _load_builtin() -> None:
    from kvtool.methods.evict import (  # noqa: F401  (register on import)
        cake, chunkkv, fastgen, h2o, knorm, pyramidinfer, rocketkv, snapkv, streamingllm, tova, vatp,
    )


def policy_class(name: str) -> type[EvictionPolicy]:
    """The policy registered under ``name``; a clear error if there is none."""
    _load_builtin()
    if name not in POLICIES:
        raise RecipeError(f"unknown eviction policy '{name}'; registered policies: {sorted(POLICIES)}")
    return POLICIES[name]


def registered_policies() -> list[str]:
    _load_builtin()
    return sorted(POLICIES)


def ratio_budget(ratio: float | torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Tokens a stream may keep when it keeps ``ratio`` of ``length`` tokens (at least one), elementwise."""
    kept = torch.ceil(torch.as_tensor(ratio, dtype=torch.float64) * length.to(torch.float64) - 1e-9)
    return kept.clamp(min=1).to(torch.int64)
