"""CAKE (Qin et al., "CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences", ICLR 2025).

Layer preferences. At prefill each layer looks at the attention of the last ``window``
prompt queries (the observation window) over the older tokens: spatial dispersion
H_l = the window rows' summed entropy, temporal shift V_l = the summed variance of each
token's attention across the window rows, and the preference P_l = H_l^(1/tau1) x V_l^(1/tau2).
A sequence's total budget (L x the uniform budget) is split among its layers in proportion to
P_l: B_l = P_l / sum P x total, counted beyond each layer's sinks and window (always kept), and
capped at what a layer holds, the excess going to the other layers (water-filling). Each
sequence of a batch has its own preferences and budgets.

Cascade. The paper decides as layers are prefilled: when layer l is prefilled the total is
split among layers 0..l (B_j^(l) = P_j / sum_{i<=l} P_i x total) and the earlier layers are
re-trimmed to their new share, so prefill never holds more than the total. kvtool's runtime
evicts a layer only while that layer runs, so here layer l keeps its cascade share B_l^(l)
when it is prefilled (never less than its final share: shares only shrink as layers are
added) and is trimmed to its final share B_l^(L-1) at its next forward (the first decoded
token), ranked by the same prefill scores, which the policy keeps until then (one float per
prompt position and stream). The kept sets are then the paper's final ones; between the end
of prefill and the first decode step the cache holds the cascade shares, more than the budget.

Eviction indicator. A token's score is its mean attention over the window rows + gamma x
the variance of that attention, average-pooled over ``pooling`` neighbouring positions (the
paper: kernel 5; ``pooling_mode: max`` pools by SnapKV's max instead, which keeps the tokens
around an attended one at its score: the bundled `cake-maxpool`, built for retrieval). While
decoding, the final shares are recomputed at each length (ratio budgets grow as uniform ones do)
and tokens are ranked by the attention accumulated since, pooled the same way (as SnapKV after
its prefill); the paper's decoder ranks by the current query alone.

GQA: a KV head's statistics pool the G x w (query head, window query) rows of its group, so
its variance is over those rows (for MHA exactly the paper's per-head variance); preferences
sum a sequence's KV heads. Rows are counted by their attention mass (each row sums to 1; with
learned sink logits, gpt-oss, the count is low and the variance slightly off). After
`batch_repeat_interleave` (contrastive search) the per-sequence preferences no longer line up
with the streams, and the budgets fall back to the uniform ones.

Sliding-window layers (Gemma 2/3, Mistral). Such a layer can see only its last W tokens, so
it counts min(n, W) tokens, not n: its uniform budget is the share of those (as the runtime's
`WindowedBudget`), the total is the sum of the layers' uniform budgets, and its share is
capped at what it can see. The runtime still frees what the window hides (`SlidingWindowRule`)
and lets CAKE choose only among the visible tokens (`window_aware_budgets`).
"""

from __future__ import annotations

import math

import torch

from kvtool.methods.evict.base import (
    EvictionPolicy, StreamView, at_positions, by_position, rank_desc, register_policy, window_share,
)
from kvtool.methods.evict.snapkv import pool_by_position
from kvtool.methods.evict.window_stats import WindowStats


def water_fill(weights: torch.Tensor, room: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """(B, K) float64 shares min(cap, lam x weights) summing to ``room`` (B,) as far as the caps (B,) or (B, K) allow.

    weights (B, K) >= 0 (a row of zeros splits evenly). Adding a column never raises another
    column's share (lam only falls): the cascade's shares shrink towards the final ones.
    """
    w = weights.double()
    w = torch.where(w.sum(dim=1, keepdim=True) > 0, w, torch.ones_like(w))
    room, cap = room.double()[:, None], _columns(cap)  # (B, 1), (B, 1) or (B, K)
    shares = torch.zeros_like(w)
    for _ in range(w.shape[1]):
        open_ = (shares < cap - 1e-9).double()  # columns below the cap
        missing = (room - shares.sum(dim=1, keepdim=True)).clamp(min=0)
        if bool((missing <= 1e-9).all()):
            break
        weight = (w * open_).sum(dim=1, keepdim=True)
        shares = torch.minimum(shares + missing * w * open_ / weight.clamp(min=1e-300), cap)
    return shares


def integer_shares(shares: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """(B, K) int64: floors of ``shares`` plus one for the largest remainders (below ``cap`` (B,) or (B, K)), same row sums."""
    base = torch.floor(shares + 1e-9)
    left = torch.round(shares.sum(dim=1)) - base.sum(dim=1)  # (B,)
    remainder = (shares - base).masked_fill(base >= _columns(cap), -1.0)
    return (base + (rank_desc(remainder) < left[:, None])).long()


def _columns(cap: torch.Tensor) -> torch.Tensor:
    """A cap per row (B,) as (B, 1), or per row and column (B, K) as is; float64."""
    cap = cap.double()
    return cap[:, None] if cap.dim() == 1 else cap


def squared(p: torch.Tensor, age: torch.Tensor) -> torch.Tensor:
    return p * p


def entropy(p: torch.Tensor, age: torch.Tensor) -> torch.Tensor:
    return torch.special.entr(p)  # -p log p, 0 at p = 0


@register_policy("cake")
class CAKE(EvictionPolicy):
    def __init__(self, spec, profile=None) -> None:
        super().__init__(spec, profile)
        self._windows: tuple = ()  # each layer's sliding window or None (`budget_rule`)
        self._uniform = None  # the runtime's budget rule: (layer, length (S,)) -> (S,) uniform budgets
        self._layers = 0
        self._groups = 1  # KV streams per sequence
        self._log_preference: torch.Tensor | None = None  # (B, L) float64 log P_l of the last prefill, NaN = not measured
        self._final: tuple[torch.Tensor, torch.Tensor] | None = None  # (length (S,), budgets (S, L)) of the last call
        self._prefill_scores: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (length (S,), score (S, P))
        self._scores: torch.Tensor | None = None  # (S, N) while `keep` runs

    # --- runtime hooks --------------------------------------------------------------------------
    def window_observer(self, t: int, window: int | torch.Tensor) -> WindowStats:
        return WindowStats(t, window, {"square": squared, "entropy": entropy})

    window_aware_budgets = True  # its shares count what each sliding-window layer can see (module docstring)

    def budget_rule(self, rule, num_layers: int, windows: tuple = ()):
        self._uniform, self._layers = rule, num_layers
        self._windows = tuple(windows[:num_layers]) + (None,) * (num_layers - len(windows[:num_layers]))
        return self.layer_budget

    def _layer_uniform(self, layer: int, length: torch.Tensor) -> torch.Tensor:
        """(S,) the uniform budget of ``layer``: on a sliding-window layer the share of the window."""
        window = self._windows[layer] if layer < len(self._windows) else None
        return self._uniform(layer, length) if not window else window_share(self._uniform, layer, length, window)

    def layer_budget(self, layer: int, length: torch.Tensor) -> torch.Tensor:
        """(S,) budgets of ``layer``: its final share once the last prefill measured every layer, else uniform."""
        stored = self._prefill_scores.get(layer)
        if stored is not None and not _next_step(stored[0], length):
            del self._prefill_scores[layer]  # the layer was not trimmed at the first step after prefill: drop its scores
        uniform = self._layer_uniform(layer, length)
        pref = self._log_preference
        if pref is None or bool(torch.isnan(pref).any()) or pref.shape[0] * self._groups != length.shape[0]:
            return uniform
        if self._final is None or not torch.equal(self._final[0], length):
            self._final = (length.clone(), self._budgets(pref, length, final=True))
        return self._final[1][:, layer]

    # --- choosing -----------------------------------------------------------------------------------
    def keep(self, view: StreamView, budget: torch.Tensor) -> torch.Tensor:
        prefill = view.window_attention is not None and view.window_stats is not None
        if prefill:
            self._groups = int(view.heads.max()) + 1
            score, log_pref = self._window_statistics(view)
            self._scores = pool_by_position(score, view.positions, view.valid, self.spec.pooling, mean=self.spec.pools_by_mean)
            if self._uniform is not None:
                budget = self._cascade_budget(view, log_pref)
        else:
            self._scores = self._decode_scores(view)
        try:
            keep = super().keep(view, budget)
        finally:
            scores, self._scores = self._scores, None
        if prefill and self._uniform is not None:
            self._prefill_scores[view.layer] = (view.length.clone(), by_position(scores, view, -math.inf))
        return keep

    def token_scores(self, view: StreamView) -> torch.Tensor:
        return self._scores if self._scores is not None else self._decode_scores(view)

    def _window_statistics(self, view: StreamView) -> tuple[torch.Tensor, torch.Tensor]:
        """(token score mean + gamma x variance over the window rows (S, N), the layer's log preference per sequence (B,))."""
        valid = view.valid
        mass = view.window_attention.float().masked_fill(~valid, 0.0)  # (S, N) summed over the window rows
        square = view.window_stats["square"].masked_fill(~valid, 0.0)  # (S, N) sum of squares over the rows
        rows = mass.sum(dim=1, keepdim=True).round().clamp(min=1.0)  # (S, 1) window rows: each sums to 1
        mean = mass / rows
        variance = ((square - mass * mean) / (rows - 1).clamp(min=1.0)).clamp(min=0.0)  # (S, N) unbiased, over the rows
        older = valid & (view.positions <= (view.latest() - self.spec.window)[:, None])  # not the window itself
        dispersion = (view.window_stats["entropy"] * older).sum(dim=1).reshape(-1, self._groups).sum(dim=1)  # (B,) H_l
        shift = (variance * older).sum(dim=1).reshape(-1, self._groups).sum(dim=1)  # (B,) V_l
        log_pref = torch.log(dispersion.double()) / self.spec.tau1 + torch.log(shift.double()) / self.spec.tau2
        return mean + self.spec.gamma * variance, log_pref

    def _decode_scores(self, view: StreamView) -> torch.Tensor:
        """(S, N): at the first step after prefill the prompt's own scores (new tokens are in the window), else pooled
        accumulated attention."""
        stored = self._prefill_scores.pop(view.layer, None)
        if stored is not None and _next_step(stored[0], view.length):
            return at_positions(stored[1], view, math.inf)
        return pool_by_position(view.attention, view.positions, view.valid, self.spec.pooling, mean=self.spec.pools_by_mean)

    # --- budgets ------------------------------------------------------------------------------------
    def _cascade_budget(self, view: StreamView, log_pref: torch.Tensor) -> torch.Tensor:
        """(S,) layer l's share of the total among layers 0..l (records P_l; layer 0 starts a new prefill)."""
        b, layer = log_pref.shape[0], view.layer
        pref = self._log_preference
        if layer == 0 or pref is None or pref.shape[0] != b:
            pref = self._log_preference = torch.full((b, self._layers), math.nan, dtype=torch.float64, device=log_pref.device)
        pref[:, layer] = log_pref
        self._final = None
        seen = pref[:, : layer + 1].nan_to_num(nan=-math.inf)  # a layer not measured gets no share (its own is larger)
        return self._budgets(seen, view.length, final=False)[:, layer]

    def _budgets(self, log_pref: torch.Tensor, length: torch.Tensor, final: bool) -> torch.Tensor:
        """(S, K) budgets of the first K layers splitting the layers' summed uniform budgets beyond the protected
        tokens by preference (each layer counting the tokens it can see: min(n, W) on a sliding-window layer).

        final: integer shares summing to the total (largest remainders); else rounded up (the cascade, >= final).
        """
        b, k = log_pref.shape
        n = length.reshape(b, -1)[:, 0]  # (B,) every stream of a sequence alike
        streams = length.shape[0]
        uniform = torch.stack([self._layer_uniform(i, length).reshape(b, -1)[:, 0] for i in range(self._layers)], 1)  # (B, L)
        visible = torch.stack([n.clamp(max=w) if w else n for w in self._windows], dim=1)  # (B, L)
        protected = visible.clamp(max=self.spec.sink_tokens + self.spec.window)  # sinks + window, always kept
        room = (uniform - protected).clamp(min=0).sum(dim=1)  # (B,) tokens the layers share beyond their protected ones
        cap = (visible - protected).clamp(min=0)[:, :k]  # (B, K)
        weights = torch.exp(log_pref - log_pref.amax(dim=1, keepdim=True)).nan_to_num(nan=1.0)  # P / max P, no overflow
        shares = water_fill(weights, room, cap)  # (B, K)
        own = integer_shares(shares, cap) if final else torch.ceil(shares - 1e-9).long()
        below = uniform[:, :k] <= protected[:, :k]  # below the protected tokens: the uniform budget
        budgets = torch.where(below, uniform[:, :k], protected[:, :k] + own)
        return budgets.repeat_interleave(streams // b, dim=0)


def _next_step(stored_length: torch.Tensor, length: torch.Tensor) -> bool:
    """True when ``length`` (S,) is one token past the prefill that stored ``stored_length``."""
    return stored_length.shape == length.shape and torch.equal(stored_length + 1, length)
