"""Base class of token-eviction policies: the plumbing every policy shares.

A policy looks at one (sequence, KV head) stream of n kept tokens (oldest first)
and says which to keep. Subclasses override `token_scores` (higher = keep) and
nothing else; `keep` protects the first ``sink_tokens`` positions and the last
``window`` positions, then fills the rest of the budget with the best-scored
*units*. A unit is one token, or one quantized block of ``block_size`` tokens when
the stream stores its body compressed (blocks are freed whole: their codes share
per-block scales). FastGen overrides `keep` (its per-head policies imply their own
sizes). Policies never import the runtime; the runtime calls them through the
registry (`policy_class`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtool.errors import RecipeError
from kvtool.recipe import EvictionSpec


@dataclass
class StreamView:
    """What a policy may look at for one stream; all tensors are per kept token, oldest first.

    positions (n,) int: original positions; length: tokens the sequence has seen;
    attention (n,) float32: attention received, summed over the group's query heads
    and every query so far; window_attention (n,) or None: at prefill only, attention
    from the last ``window`` prompt queries (SnapKV); keys/values (n, D): float K/V
    (keys after RoPE; None unless the policy sets ``uses_keys`` / ``uses_values``); is_special / is_punct (n,) bool: FastGen token classes;
    units (n,) int64: unit id per token (0..U-1, non-decreasing); layer, head: where.
    """

    positions: torch.Tensor
    length: int
    attention: torch.Tensor
    window_attention: torch.Tensor | None
    keys: torch.Tensor | None
    values: torch.Tensor | None
    is_special: torch.Tensor
    is_punct: torch.Tensor
    units: torch.Tensor
    layer: int
    head: int

    @property
    def n(self) -> int:
        return self.positions.shape[0]


class EvictionPolicy:
    """Decide per stream which tokens stay; see the module docstring."""

    name = "base"
    uses_attention = True  # False: the runtime need not accumulate attention for this policy
    uses_keys = False  # True: the view carries the float keys (n, D)
    uses_values = False  # True: the view carries the float values (n, D)
    uses_token_classes = False  # True: the runtime records special/punctuation classes per token
    budgeted = True  # False: the kept set follows rules (FastGen), so it is re-selected every step

    def __init__(self, spec: EvictionSpec, profile: dict[str, torch.Tensor] | None = None) -> None:
        self.spec = spec
        self.profile = profile or {}  # tensors of `kvtool profile` (FastGen head policies), when given

    def token_scores(self, view: StreamView) -> torch.Tensor:
        """(n,) float scores, higher = more worth keeping."""
        raise NotImplementedError

    def protected(self, view: StreamView) -> torch.Tensor:
        """(n,) bool: sinks (first positions) and the recent window (last positions) are always kept."""
        latest = int(view.positions.max()) if view.n else 0
        return (view.positions < self.spec.sink_tokens) | (view.positions > latest - self.spec.window)

    def keep(self, view: StreamView, budget: int) -> torch.Tensor:
        """(n,) bool keep mask with at most ``budget`` tokens (all tokens if they fit)."""
        if view.n <= budget:
            return torch.ones(view.n, dtype=torch.bool)
        protected = self.protected(view)
        if int(protected.sum()) >= budget:
            return self._sinks_and_newest(view, budget)
        return _fill_units(self.token_scores(view).float(), protected, view.units, budget)

    def _sinks_and_newest(self, view: StreamView, budget: int) -> torch.Tensor:
        """Budget smaller than the protected set: keep sinks, then the newest tokens."""
        sinks = view.positions < self.spec.sink_tokens
        keep = sinks.clone()
        room = budget - int(sinks.sum())
        if room > 0:
            newest = torch.nonzero(~sinks).flatten()[-room:]
            keep[newest] = True
        return keep


def _fill_units(scores: torch.Tensor, protected: torch.Tensor, units: torch.Tensor, budget: int) -> torch.Tensor:
    """Keep protected units, then unprotected units by descending mean score while they fit the budget."""
    n_units = int(units[-1]) + 1
    size = torch.zeros(n_units).index_add_(0, units, torch.ones_like(scores))  # (U,)
    unit_score = torch.zeros(n_units).index_add_(0, units, scores) / size  # (U,)
    unit_protected = torch.zeros(n_units, dtype=torch.bool).index_put_((units,), protected, accumulate=True)
    room = budget - float(size[unit_protected].sum())
    order = torch.argsort(unit_score.masked_fill(unit_protected, -math.inf), descending=True, stable=True)
    order = order[~unit_protected[order]]
    keep_unit = unit_protected.clone()
    if bool((size == 1).all()):  # single tokens: plain top-k
        keep_unit[order[: max(0, int(room))]] = True
        return keep_unit[units]
    for unit, unit_size in zip(order.tolist(), size[order].tolist()):  # greedy: a block that does not fit is skipped
        if unit_size <= room:
            keep_unit[unit] = True
            room -= unit_size
    return keep_unit[units]


POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(name: str):
    """Class decorator adding an `EvictionPolicy` subclass to the registry under ``name``."""

    def bind(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        if name in POLICIES and POLICIES[name] is not cls:
            raise ValueError(f"eviction policy '{name}' registered twice")
        cls.name = name
        POLICIES[name] = cls
        return cls

    return bind


def _load_builtin() -> None:
    from kvtool.methods.evict import fastgen, h2o, knorm, snapkv, streamingllm, vatp  # noqa: F401  (register on import)


def policy_class(name: str) -> type[EvictionPolicy]:
    """The policy registered under ``name``; a clear error if there is none."""
    _load_builtin()
    if name not in POLICIES:
        raise RecipeError(f"unknown eviction policy '{name}'; registered policies: {sorted(POLICIES)}")
    return POLICIES[name]


def registered_policies() -> list[str]:
    _load_builtin()
    return sorted(POLICIES)


def ratio_budget(ratio: float, length: int) -> int:
    """Tokens a stream may keep when it keeps ``ratio`` of ``length`` tokens (at least one)."""
    return max(1, math.ceil(ratio * length))
