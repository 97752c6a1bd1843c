"""Eviction on the paged store: budgets per layer and stream, the policies' view, applying their choice.

Sliding-window layers (Gemma 2/3, Mistral) free the tokens no future query can see
(`SlidingWindowRule`) through the same machinery: as the layer's only rule when the recipe
evicts nothing, and beside a budgeted policy otherwise (the rule runs on its own schedule,
the policy chooses among the tokens inside the window, and its budget is a share of the
window, `WindowedBudget`), so such a layer never holds more than the model's own cache.

Every forward of a layer whose recipe evicts: the attention each stored and new token
received is added to its score, a `StreamView` of all streams (stored slots, then the new
tokens) goes to the policy with a budget per stream, and the keep mask comes back split
into float slots (freed one by one), body blocks (freed whole) and new tokens (stored or
not). All batched over streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from kvtool.methods.evict.base import EvictionPolicy, StreamView, ratio_budget, unit_sums, window_share


class BudgetRule:
    """Tokens each stream of ``layer`` may keep when its sequence has seen ``length`` (S,) tokens.

    ``never_shrinks``: a longer sequence never gets a smaller budget (the runtime may then skip
    the budget check for decode steps that cannot reach it); rules without it are asked every step.
    """

    never_shrinks = True

    def __init__(
        self, ratio: float, tokens: int | None, layer_weights: torch.Tensor, sliding_layers: frozenset[int] = frozenset(),
        sliding_fraction: float | None = None, layer_sliding_fractions: Mapping[int, float] | None = None,
    ) -> None:
        self.ratio, self.tokens, self.weights = ratio, tokens, layer_weights.double()
        self.fractions = layer_fractions(ratio, self.weights)  # (L,) per-layer fraction kept, mean = ratio
        # `EvictionSpec.sliding_budget`: these layers keep this fraction of what they can see (the runtime asks them
        # through `WindowedBudget`, at most their window), whatever ``ratio`` / ``tokens`` give the others;
        # ``layer_sliding_fractions``: some of them another fraction (``layer_overrides`` with eviction.sliding_budget)
        self.sliding = frozenset(sliding_layers) if sliding_fraction is not None else frozenset()
        self.sliding_fraction = sliding_fraction
        self.sliding_fractions = {layer: float((layer_sliding_fractions or {}).get(layer, sliding_fraction))
                                  for layer in self.sliding}

    def keeps_everything(self, layer: int) -> bool:
        """``layer`` runs without the policy (`layer_policy`): one of the others of a ``sliding_budget`` recipe whose
        budget keeps every token it sees (``budget: 1.0``), or a sliding-window layer given its whole window (a
        per-layer override or ``sliding_budget: 1.0`` (the window rule alone then keeps what the policy would)."""
        if self.sliding_fraction is None:
            return False
        if layer in self.sliding:
            return self.sliding_fractions[layer] >= 1.0
        return self.tokens is None and float(self.fractions[layer]) >= 1.0

    def __call__(self, layer: int, length: torch.Tensor) -> torch.Tensor:
        if layer in self.sliding:
            return ratio_budget(self.sliding_fractions[layer], length)
        if self.tokens is not None:
            return torch.full_like(length, max(1, round(self.tokens * float(self.weights[layer]))))
        return ratio_budget(float(self.fractions[layer]), length)

    def growth(self, layer: int) -> float:
        """g such that k more tokens of a sequence raise ``layer``'s budget by at least floor(g k): the fraction
        kept (ceil(f (L + k)) >= ceil(f L) + floor(f k)), 0 for a fixed token budget."""
        if layer in self.sliding:
            return self.sliding_fractions[layer]
        return 0.0 if self.tokens is not None else float(self.fractions[layer])


def layer_policy(policy, budget, layer: int):
    """(policy, budget rule) of ``layer``: (None, None) where a recipe that evicts on its sliding-window layers only
    (`EvictionSpec.sliding_budget` with ``budget: 1.0``) keeps every token of this one. Such a layer stores no per-slot
    positions and scores (8 bytes per token and stream) and scores no attention; evicting nothing, it would have
    kept the same tokens."""
    keeps = getattr(budget, "keeps_everything", None)
    if policy is not None and keeps is not None and keeps(layer):
        return None, None
    return policy, budget


class WindowedBudget:
    """A budget rule on a sliding-window layer of ``window`` tokens: the share of what the layer can see.

    A full cache holds min(length, window) tokens on such a layer, so a kept fraction f means
    f x min(length, window) here (the wrapped rule asked at the clamped length), never more than
    the window. Once the length passes the window the budget stops growing: ``growth`` is 0.
    """

    def __init__(self, rule, window: int) -> None:
        self.rule, self.window = rule, window
        self.never_shrinks = getattr(rule, "never_shrinks", False)

    def __call__(self, layer: int, length: torch.Tensor) -> torch.Tensor:
        return window_share(self.rule, layer, length, self.window)

    def growth(self, layer: int) -> float:
        return 0.0


def quiet_steps(room: int, growth: float, most: int = 4096) -> int:
    """Decode steps after which a stream with ``room`` tokens to spare is surely still within its budget, when
    each step adds one token and k steps raise the budget by at least floor(growth k): the largest k with
    k - floor(growth k) <= room (at most ``most``)."""
    if room < 0:
        return 0
    if growth >= 1:  # the budget keeps up with every token
        return most
    k = min(most, int(room / (1 - growth)) + 2)
    while k > room and k - math.floor(growth * k - 1e-9) > room:  # 1e-9: float rounding never overshoots
        k -= 1
    return k


def layer_fractions(ratio: float, weights: torch.Tensor) -> torch.Tensor:
    """Per-layer fractions ratio x w_l capped at 1, the excess of capped layers handed to the others.

    Keeps the mean at ``ratio`` (the uniform allocation's) whenever that is possible (ratio <= 1).
    """
    fractions = (ratio * weights).clamp(max=1.0)
    for _ in range(len(weights)):
        missing = ratio * len(weights) - float(fractions.sum())
        open_layers = fractions < 1.0
        if missing <= 1e-12 or not bool(open_layers.any()):
            break
        share = weights * open_layers / float((weights * open_layers).sum())
        fractions = (fractions + missing * share).clamp(max=1.0)
    return fractions


@dataclass
class SlotTable:
    """Per-slot values (S, N) of the view in its order: float slots, body slots, new tokens."""

    float_width: int  # F
    body_blocks: int  # Bn
    block_size: int
    new_width: int  # t

    @property
    def width(self) -> int:
        return self.float_width + self.body_blocks * self.block_size + self.new_width

    def units(self, streams: int, device) -> tuple[torch.Tensor, int]:
        """(S, N) unit ids (each float/new token its own unit, each body block one) and the unit count."""
        f, bn, bs, t = self.float_width, self.body_blocks, self.block_size, self.new_width
        ids = torch.cat([
            torch.arange(f, device=device),
            f + torch.arange(bn * bs, device=device) // bs,
            f + bn + torch.arange(t, device=device),
        ])
        return ids.expand(streams, -1), f + bn + t

    def split(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(S, N) -> float (S, F), body blocks (S, Bn) (first slot of each block), new (S, t)."""
        f, bn, bs = self.float_width, self.body_blocks, self.block_size
        body = mask[:, f : f + bn * bs].reshape(mask.shape[0], bn, bs)[:, :, 0] if bn else mask[:, :0]
        return mask[:, :f], body, mask[:, f + bn * bs :]


def choose(policy: EvictionPolicy, view: StreamView, budget: torch.Tensor) -> torch.Tensor:
    """The policy's keep mask (S, N), never more than the valid slots."""
    return policy.keep(view, budget) & view.valid


@dataclass(frozen=True)
class _RuleSpec:
    interval: int  # tokens a stream may gain past its budget before the rule runs (as `EvictionSpec.interval`)
    window: int
    head_budgets: str = "uniform"


class SlidingWindowRule:
    """Frees what a sliding-window layer can never attend to again (used when the recipe evicts nothing).

    A query at position q of a layer with window W sees stored positions p > q - W, and every later
    query is further right, so once a stream's newest position is ``latest`` only p > latest - W can
    ever be seen again. The rule keeps those (whole body blocks while any of their tokens is
    inside) and frees the rest. Attention masks by position as before, so what it keeps is exactly
    what the model reads.

    When it runs: a store of float tokens (``block_size`` 0) frees them one by one, so the rule waits
    until a stream holds ``interval`` - 1 tokens more than W (one run per ``interval`` steps, at most
    W + interval - 1 tokens). A quantized store frees body blocks whole, and its oldest block is wholly
    outside the window exactly when the stream holds W + ``block_size`` tokens (its newest W tokens
    are the visible ones): the rule runs then, once per block, and a stream holds at most
    W + block_size - 1 tokens between runs (W + block_size / 2 on average, against W - 1 for
    transformers' `DynamicSlidingWindowLayer`). A later run would free the same block, only later.
    """

    name = "sliding-window"
    never_shrinks = True  # it is its own budget rule (`__call__`)
    uses_attention = False
    uses_feature = False
    uses_token_classes = False
    budgeted = True
    evicts_while_decoding = True

    def __init__(self, window: int, block_size: int, interval: int = 16) -> None:
        self.window, self.block_size = window, block_size
        if block_size:  # due the step its oldest body block leaves the window: W + block_size tokens held
            self.limit, interval = window + block_size - 1, 1
        else:
            self.limit = window  # tokens a stream may hold before the rule runs (plus the interval)
        self.spec = _RuleSpec(interval=interval, window=window)

    def __call__(self, layer: int, length: torch.Tensor) -> torch.Tensor:
        """(S,) tokens a stream may hold before the rule runs (`limit`; the rule runs past limit + interval - 1)."""
        return torch.full_like(length, self.limit)

    def keep(self, view: StreamView, budget: torch.Tensor) -> torch.Tensor:
        """(S, N) bool: tokens (whole units) with a position inside the newest query's window."""
        inside = view.valid & (view.positions > (view.latest() - self.window)[:, None])
        if not view.single_token_units:
            inside = (unit_sums(inside.float(), view) > 0).gather(1, view.units) & view.valid
        return inside
