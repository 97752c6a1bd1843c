"""Per-token statistics of the observation window's attention beyond its sum (CAKE, PyramidInfer).

At prefill the runtime sums, per stream, the attention the last ``window`` query tokens give
every token (`StreamView.window_attention`, the query heads of the stream's group summed).
CAKE also needs the variance of that attention over the window's queries and the rows'
entropy; PyramidInfer a sum weighted by how recent each query is. A policy that needs more
returns a `WindowStats` from `EvictionPolicy.window_observer(t)`: the runtime's scored
attention calls it with every block of probabilities it forms anyway (stored chunks, then
the new tokens), and the view carries the sums in its slot order (`StreamView.window_stats`,
name -> (S, N)). Only one (S, C) sum per statistic and chunk is kept, never the rows.
"""

from __future__ import annotations

from typing import Callable

import torch

Stat = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (p (S, g, W, C), age (W,)) -> (S, g, W, C)


class WindowStats:
    """Sums over the window's query rows of ``stats[name](p, age)`` for every token.

    t: query tokens of the forward; rows of a stream are (query head, token) pairs with the
    token at ``row % t`` (the runtime's layout); a row is in the window when its token is one
    of the last ``window`` (an int, or (S,) int64: each stream its own; rows outside a stream's
    window count 0 there). age (W,) float: 0 for the newest query token, 1 for the one before...
    """

    def __init__(self, t: int, window: int | torch.Tensor, stats: dict[str, Stat]) -> None:
        self.t, self.window, self.stats = t, window, stats
        self.sums: dict[tuple[str, str, int], torch.Tensor] = {}  # (name, region, start) -> (S, C)

    def __call__(self, region: str, start: int, p: torch.Tensor, lo: int, hi: int) -> None:
        """Absorb probabilities p (S, g, hi - lo, C) of rows lo..hi against one chunk (region "new": the new tokens)."""
        token = torch.arange(lo, hi, device=p.device) % self.t  # (R_blk,) query token of each row
        per_stream = isinstance(self.window, torch.Tensor)
        widest = int(self.window.max()) if per_stream else self.window
        rows = (token >= self.t - widest).nonzero().flatten()
        if rows.numel() == 0:
            return
        window_p = p.index_select(2, rows)  # (S, g, W, C)
        if per_stream:  # rows past a stream's own window count 0 there
            inside = token[rows][None, :] >= (self.t - self.window.to(p.device))[:, None]  # (S, W)
            window_p = window_p * inside[:, None, :, None].to(p.dtype)
        age = (self.t - 1 - token[rows]).to(p.dtype)  # (W,)
        for name, stat in self.stats.items():
            value = stat(window_p, age).sum(dim=(1, 2))  # (S, C)
            key = (name, region, start)
            self.sums[key] = self.sums[key] + value if key in self.sums else value

    def compact_new(self, compact: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Reorder the new tokens' sums (S, t) as the runtime reorders the new tokens (real ones first)."""
        for key in [k for k in self.sums if k[1] == "new"]:
            self.sums[key] = compact(self.sums[key])

    def placed(self, table) -> dict[str, torch.Tensor] | None:
        """name -> (S, N) sums in the view's slot order: float slots, body slots, then the new tokens.

        table: the runtime's slot table (``float_width`` F, ``width`` N); tokens no window row
        saw (masked) hold 0. None when no window row was seen.
        """
        if not self.sums:
            return None
        first = next(iter(self.sums.values()))
        out = {name: torch.zeros(first.shape[0], table.width, device=first.device) for name in self.stats}
        offsets = {"float": 0, "body": table.float_width}
        for (name, region, start), values in self.sums.items():
            lo = table.width - values.shape[1] if region == "new" else offsets[region] + start
            out[name][:, lo : lo + values.shape[1]] = values
        return out
