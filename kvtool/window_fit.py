"""`kvtool fit-windows`: how much of its window each sliding-window layer keeps, fitted from what each layer costs.

Gemma 2/3, windowed Mistral and GPT-OSS layers with a sliding window attend to their newest W tokens only.
Keeping fewer (``eviction.sliding_budget``: StreamingLLM keeps the newest share of the window) costs some layers
more than others: on Gemma-3-270M, cut alone to a quarter of its window, one of the 15 local layers moves the
next-token distributions 1.5 to 7.6 times as far (KL) as each of the others (benchmarks/RESULTS.md, "Per-layer
shares of the sliding windows"). The fit:

1. **measure** (teacher forcing, float cache, on calibration windows; the mean KL divergence of the next-token
   distributions from the uncompressed model's over each window's second half): every sliding-window layer at
   ``mean_share`` (the uniform point), then each layer l in turn at each candidate share f with the others still
   at ``mean_share``: cost(l, f) = that KL minus the uniform point's. Each cut is a band mask through kvtool's
   attention handler (layer l sees its newest ceil(f W) keys): exactly the tokens StreamingLLM at that share
   keeps once its sinks have left the window;
2. **allocate**: the shares that minimize the summed costs with no more kept tokens than the uniform point (an
   exact multiple-choice knapsack over tokens, the costs as measured);
3. **check**: the fitted shares measured together on the same windows, against the uniform point. The recipe
   gets the fitted shares only where their joint KL is lower, else ``mean_share`` on every layer;
4. **write** (`fitted_recipe`): the recipe with StreamingLLM on the sliding-window layers only (``budget: 1.0``),
   ``sliding_budget`` the most common share and a ``layer_overrides`` entry per other share.

Why around the uniform point and with the KL: costs measured one layer at a time from the full model do not
add up. On Gemma-3-270M an allocation fitted from them (each layer cut alone, everything else whole) measured a
joint KL of 0.166 against 0.156 for one share of 0.3 on every layer (perplexity +19.1% against +15.7% on 4 x 1024
tokens), and from the loss alone (2 x 2048 tokens) +14.9% against +10.1%: a single cut's loss change on a few
thousand tokens is noise of either sign (three layers "gained" 1-3%). Measured at the point it departs from,
a layer's cost includes what the other layers' cuts already took. A policy that scores tokens (H2O, SnapKV)
keeps others than the newest, so the shares are written for StreamingLLM.
Shapes: input ids (N, T); hidden states (1, T, d_model).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kvtool.capture import Progress, no_progress
from kvtool.errors import RecipeError, RuntimeConfigError
from kvtool.models.adapter import adapter_for
from kvtool.models.attention_hook import attention_handler, eager_attention, install, sdpa_reference
from kvtool.methods.evict.base import ratio_budget
from kvtool.models.layer_stack import head_logits, record_layer_calls, run_layer
from kvtool.recipe import EvictionSpec, Recipe
from kvtool.recipe_layers import LayerOverride, resolve_layer_kinds

DEFAULT_SHARES = (0.125, 0.25, 0.5, 0.75, 1.0)  # candidate shares of the window (besides --mean-share itself)


@dataclass(frozen=True)
class WindowFit:
    """What `fit_window_shares` measured and chose. NLLs are mean nats per scored token."""

    layers: tuple[int, ...]  # the model's sliding-window layers
    windows: tuple[int, ...]  # their windows (tokens)
    shares: tuple[float, ...]  # the options, ascending: the candidate shares and mean_share
    # (layers, shares): with that layer at that share and every other one at mean_share, the KL from the uncompressed
    # model / the loss, each minus its value with every layer at mean_share (0 at mean_share itself)
    costs: tuple[tuple[float, ...], ...]
    nll_deltas: tuple[tuple[float, ...], ...]
    fitted: tuple[float, ...]  # per sliding-window layer: the knapsack's share (1.0 = its whole window)
    mean_share: float
    baseline_nll: float
    fitted_nll: float  # every layer at its fitted share at once
    uniform_nll: float  # every layer at mean_share at once
    fitted_kl: float
    uniform_kl: float
    scored_tokens: int

    @property
    def fitted_wins(self) -> bool:
        """The fitted shares measured a lower joint KL than mean_share on every layer (else the recipe keeps that)."""
        return self.fitted_kl < self.uniform_kl

    @property
    def chosen(self) -> tuple[float, ...]:
        """The shares the recipe gets: the fitted ones where they won the joint check, else mean_share everywhere."""
        return self.fitted if self.fitted_wins else (self.mean_share,) * len(self.layers)

    @property
    def held_share(self) -> float:
        """Tokens the chosen shares keep over the windows' total (about mean_share: ceil per layer)."""
        return sum(_kept(f, w) for f, w in zip(self.chosen, self.windows)) / sum(self.windows)

    def to_dict(self) -> dict:
        pct = lambda nll: 100.0 * math.expm1(nll - self.baseline_nll)  # noqa: E731  perplexity delta in %
        return {
            "mean_share": self.mean_share, "held_share": self.held_share, "scored_tokens": self.scored_tokens,
            "baseline_ppl": math.exp(self.baseline_nll), "fitted_ppl_delta_pct": pct(self.fitted_nll),
            "uniform_ppl_delta_pct": pct(self.uniform_nll), "fitted_kl": self.fitted_kl, "uniform_kl": self.uniform_kl,
            "chosen": "fitted" if self.fitted_wins else "uniform",
            "shares": list(self.shares),
            "layers": [{"layer": l, "window": w, "fitted_share": f, "share": c, "kept_tokens": _kept(c, w),
                        "kl": {str(s): c for s, c in zip(self.shares, kl)},
                        "ppl_delta_pct": {str(s): 100.0 * math.expm1(c) for s, c in zip(self.shares, nll)}}
                       for l, w, f, c, kl, nll in zip(self.layers, self.windows, self.fitted, self.chosen, self.costs,
                                                      self.nll_deltas)],
        }


def _kept(share: float, window: int) -> int:
    """Tokens a share of a window keeps: the runtime's own budget rule (`ratio_budget`)."""
    return int(ratio_budget(share, torch.tensor([window]))[0])


def band_handler(widths: dict[int, int]) -> Callable:
    """An attention handler (`attention_handler`) under which layer l attends to its newest ``widths[l]`` keys only.

    The model's own mask (causal, its sliding window) still applies; other layers run unchanged. Calls carrying
    ``softcap`` / ``s_aux`` go to the family's eager attention, as kvtool's attention does without a handler."""

    def handler(module, query, key, value, attention_mask, scaling, **extra):
        width = widths.get(getattr(module, "layer_idx", None))
        if width is not None:
            t, total = query.shape[2], key.shape[2]
            rows = torch.arange(total - t, total, device=query.device)[:, None]  # (t, 1) query positions
            cols = torch.arange(total, device=query.device)[None, :]  # (1, T) key positions
            band = (cols <= rows) & (rows - cols < width)  # (t, T)
            if attention_mask is None:
                attention_mask = band[None, None]
            elif attention_mask.dtype == torch.bool:
                attention_mask = attention_mask & band
            else:  # additive
                attention_mask = attention_mask.masked_fill(~band, torch.finfo(attention_mask.dtype).min)
        if extra:
            return eager_attention(module, query, key, value, attention_mask, scaling=scaling, **extra)[0]
        return sdpa_reference(query, key, value, attention_mask, scaling)

    return handler


class _Stack:
    """One window's recorded layer calls and every layer's input, so a cut at layer l reruns layers l.. only.

    Keeps the uncompressed model's log-probabilities at the scored positions (second half x vocabulary, float32:
    Gemma 3's 262K-word vocabulary makes that 0.5 GB per 1K scored tokens) for the KL of every cut."""

    def __init__(self, model, layers, ids: torch.Tensor) -> None:  # ids (1, T)
        self.model, self.layers, self.ids = model, layers, ids
        self.first = ids.shape[1] // 2  # first scored token
        with torch.no_grad(), attention_handler(band_handler({})):
            call = record_layer_calls(model, layers, ids, None)
            self.kwargs = call.kwargs
            hidden, self.inputs = call.hidden, []
            for layer, kwargs in zip(layers, self.kwargs):
                self.inputs.append(hidden)
                hidden = run_layer(layer, hidden, kwargs, None)
            self.reference = self._log_probs(hidden)  # (T - first, V), the model's head run once
            self.baseline = float(F.nll_loss(self.reference, ids[0, self.first:], reduction="mean"))

    def _log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = head_logits(self.model, self.layers, self.ids, hidden, None, keep=self.ids.shape[1] - self.first + 1)
        return torch.log_softmax(logits[0, :-1].float(), dim=-1)  # (T - first, V): predicts tokens first..T-1

    def run_from(self, start: int, hidden: torch.Tensor) -> tuple[float, float]:
        """(mean loss, mean KL(uncompressed || this)) over the scored tokens after running layers ``start``.. on
        ``hidden`` under the current handler."""
        with torch.no_grad():
            for index in range(start, len(self.layers)):
                hidden = run_layer(self.layers[index], hidden, self.kwargs[index], None)
            log_probs = self._log_probs(hidden)
            nll = float(F.nll_loss(log_probs, self.ids[0, self.first:], reduction="mean"))
            kl = F.kl_div(log_probs, self.reference, log_target=True, reduction="sum") / log_probs.shape[0]
            return nll, float(kl)

    def cut(self, widths: dict[int, int]) -> tuple[float, float]:
        """(loss, KL) with the given layers cut to their widths (the layers below the lowest run as recorded)."""
        start = min(widths)
        with attention_handler(band_handler(widths)):
            return self.run_from(start, self.inputs[start])


def allocate(costs: torch.Tensor, windows: list[int], options: list[float], budget: int) -> list[float]:
    """Per layer the option minimizing the summed costs with the kept tokens sum_l ceil(f_l W_l) <= ``budget``.

    costs: (L, O) at ``options`` (ascending shares, any sign), taken as measured: around the uniform point a larger
    share can cost more (on Gemma-3-270M two layers given their whole window while the others keep 30% raised the
    KL by 0.03-0.04), and forcing costs to fall with the share hid that. Exact: a knapsack over kept tokens, one
    table row per layer.
    """
    table = costs.double()  # (L, O)
    smallest = sum(_kept(options[0], w) for w in windows)
    if smallest > budget:
        raise RuntimeConfigError(
            f"the budget keeps {budget} tokens over the sliding-window layers, but the smallest candidate share "
            f"({options[0]:g}) on every layer keeps {smallest}; raise --mean-share or add a smaller share"
        )
    inf = float("inf")
    best = torch.full((budget + 1,), inf, dtype=torch.float64)  # (budget + 1,) least cost at exactly t tokens
    best[0] = 0.0
    choice = torch.zeros(len(windows), budget + 1, dtype=torch.int64)  # option index that reached t at layer l
    for l, window in enumerate(windows):
        nxt = torch.full_like(best, inf)
        for o, share in enumerate(options):
            kept = _kept(share, window)
            if kept > budget:
                continue
            cand = torch.full_like(best, inf)
            cand[kept:] = best[: budget + 1 - kept] + float(table[l, o])
            better = cand < nxt
            nxt = torch.where(better, cand, nxt)
            choice[l] = torch.where(better, torch.full_like(choice[l], o), choice[l])
        best = nxt
    t = int(torch.nonzero(best == best.min())[0])  # least cost; among equal costs the fewest tokens
    picked = []
    for l in reversed(range(len(windows))):
        o = int(choice[l, t])
        picked.append(options[o])
        t -= _kept(options[o], windows[l])
    return picked[::-1]


def fit_window_shares(
    model, windows_ids: torch.Tensor, mean_share: float, shares: tuple[float, ...] = DEFAULT_SHARES,
    progress: Progress = no_progress,
) -> WindowFit:
    """Measure each sliding-window layer's cost at each share on ``windows_ids`` (N, T) and allocate (module doc)."""
    if not 0 < mean_share < 1:
        raise RuntimeConfigError(f"--mean-share must be in (0, 1) (the share of the sliding windows kept), got {mean_share}")
    if not shares or not all(0 < s <= 1 for s in shares):
        raise RuntimeConfigError(f"candidate shares must lie in (0, 1], got {list(shares)}")
    shares = tuple(sorted(set(shares) - {mean_share}))  # measured against every layer at mean_share
    options = tuple(sorted(set(shares) | {mean_share}))
    adapter = adapter_for(model)
    sliding = [(i, w) for i, w in enumerate(adapter.geometry.sliding_windows) if w]
    if not sliding:
        raise RuntimeConfigError(
            "the model has no sliding-window layers: there is no window to share out (use eviction.budget to evict on "
            "every layer)"
        )
    seq_len, widest = windows_ids.shape[1], max(w for _, w in sliding)
    if seq_len < 2 * widest:
        raise RuntimeConfigError(
            f"windows of {seq_len} tokens score positions {seq_len // 2}.. only, before a {widest}-token window is full: "
            f"use --seq-len of at least {2 * widest} (twice the largest sliding window)"
        )
    install(model)  # kvtool attention: the handler sees every attention call
    layers = adapter.layers
    uniform = [mean_share] * len(sliding)
    n = windows_ids.shape[0]
    costs = torch.zeros(len(sliding), len(options), dtype=torch.float64)  # KL over the uniform point's
    deltas = torch.zeros(len(sliding), len(options), dtype=torch.float64)  # loss over the uniform point's
    at_uniform, baseline = [0.0, 0.0], 0.0
    per_window = 2 + len(sliding) * len(shares) + 1
    steps = iter(progress(range(n * per_window), "fitting window shares", n * per_window))
    fitted_joint = [0.0, 0.0]
    stacks = []
    for row in windows_ids:
        stack = _Stack(model, layers, row[None])
        baseline += stack.baseline / n
        nll0, kl0 = _joint(stack, sliding, uniform)
        at_uniform[0] += nll0 / n
        at_uniform[1] += kl0 / n
        next(steps, None)
        for a in range(len(sliding)):
            for share in shares:
                nll, kl = _joint(stack, sliding, uniform[:a] + [share] + uniform[a + 1:])
                b = options.index(share)
                costs[a, b] += (kl - kl0) / n
                deltas[a, b] += (nll - nll0) / n
                next(steps, None)
        stacks.append(stack)
    budget = sum(_kept(mean_share, w) for _, w in sliding)  # what the uniform share keeps: always feasible
    fitted = allocate(costs, [w for _, w in sliding], list(options), budget)
    for stack in stacks:
        nll, kl = _joint(stack, sliding, fitted)
        fitted_joint[0] += nll / n
        fitted_joint[1] += kl / n
        next(steps, None)
    for _ in steps:  # drain (a progress bar that counts)
        pass
    rows = lambda t: tuple(tuple(float(c) for c in row) for row in t)  # noqa: E731
    return WindowFit(
        layers=tuple(i for i, _ in sliding), windows=tuple(w for _, w in sliding), shares=options,
        costs=rows(costs), nll_deltas=rows(deltas), fitted=tuple(fitted), mean_share=mean_share,
        baseline_nll=baseline, fitted_nll=fitted_joint[0], uniform_nll=at_uniform[0],
        fitted_kl=fitted_joint[1], uniform_kl=at_uniform[1], scored_tokens=n * (seq_len - seq_len // 2),
    )


def _joint(stack: _Stack, sliding: list[tuple[int, int]], shares: list[float]) -> tuple[float, float]:
    widths = {layer: _kept(share, window) for (layer, window), share in zip(sliding, shares) if share < 1.0}
    return stack.cut(widths) if widths else (stack.baseline, 0.0)


def check_fit_base(base: Recipe) -> None:
    """RecipeError unless ``base`` can take fitted shares (checked before anything is measured)."""
    spec = base.eviction
    if spec.policy not in ("none", "streamingllm"):
        raise RecipeError(
            f"recipe '{base.name}' evicts with {spec.policy}; the shares are measured for the newest tokens of each window "
            "(StreamingLLM): start from a recipe without eviction or with policy streamingllm"
        )
    if spec.sliding_budget is not None or any(o.eviction for o in base.layer_overrides):
        raise RecipeError(f"recipe '{base.name}' already sets sliding-window shares (eviction.sliding_budget); start from "
                          "one that does not")


def fitted_recipe(base: Recipe, fit: WindowFit, sliding_windows, name: str | None = None, note: str = "") -> Recipe:
    """``base`` with StreamingLLM on the sliding-window layers at the fitted shares (module doc, step 4).

    base: its keys, values and cache are kept; its eviction must be none or streamingllm (the shares were measured
    for the newest tokens) without a sliding_budget of its own. Its ``layer_overrides`` (keys/values) are kept,
    resolved to this model's layers, each split where its layers' shares differ."""
    check_fit_base(base)
    spec = base.eviction
    shares = dict(zip(fit.layers, fit.chosen))
    default = Counter(fit.chosen).most_common(1)[0][0]
    eviction = (dataclasses.replace(spec, sliding_budget=default) if spec.policy == "streamingllm"
                else EvictionSpec(policy="streamingllm", budget=1.0, sliding_budget=default))
    resolved = resolve_layer_kinds(base, sliding_windows)
    entries, covered = [], set()
    for override in resolved.layer_overrides:  # keys/values entries, split by their layers' shares
        groups: dict[float, list[int]] = {}
        for layer in override.layers:
            groups.setdefault(shares.get(layer, default), []).append(layer)
        for share, layers in sorted(groups.items()):
            extra = (("sliding_budget", share),) if share != default else ()
            entries.append(dataclasses.replace(override, layers=tuple(layers), eviction=extra))
        covered.update(override.layers)
    others: dict[float, list[int]] = {}
    for layer, share in shares.items():
        if share != default and layer not in covered:
            others.setdefault(share, []).append(layer)
    entries += [LayerOverride(tuple(layers), eviction=(("sliding_budget", share),)) for share, layers in sorted(others.items())]
    text = (f"{base.description} " if base.description else "") + (
        f"Sliding-window layers keep fitted shares of their windows (`kvtool fit-windows`, mean {fit.mean_share:g}, "
        f"{fit.held_share:.1%} of the windows' tokens held){note}."
    )
    return dataclasses.replace(base, name=name or f"{base.name}-fitted-windows", description=text, eviction=eviction,
                               layer_overrides=tuple(entries))
