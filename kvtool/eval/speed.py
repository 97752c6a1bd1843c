"""Decode speed from repeated timings: median and best of per-step rates, and whether the machine was busy.

One end-to-end figure (tokens / seconds) hides a machine that was busy for part of the run;
every decode step is a repeated measurement of the same thing, so kvtool reports the median
step rate (typical) and the best one (what the hardware does when nothing interferes), and
says when the timings cannot be trusted.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

BUSY_SPREAD = 1.5  # median step time above 1.5x the best: something else competed for the machine


@dataclass
class StepTimes:
    """Tokens and seconds of each decode step (one forward)."""

    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens.append(int(tokens))
        self.seconds.append(float(seconds))

    def rates(self) -> list[float]:
        """Tokens per second of every step (steps that took no measurable time are left out)."""
        return [t / s for t, s in zip(self.tokens, self.seconds) if s > 0]

    def summary(self, prefix: str = "") -> dict:
        """``{prefix}decode_tokens_per_s_median``, ``..._best`` and ``{prefix}decode_steps`` (0.0 without steps)."""
        rates = self.rates()
        return {
            f"{prefix}decode_tokens_per_s_median": statistics.median(rates) if rates else 0.0,
            f"{prefix}decode_tokens_per_s_best": max(rates) if rates else 0.0,
            f"{prefix}decode_steps": len(rates),
        }


def machine_load() -> dict:
    """1-minute load average and the cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return {"load_average": round(load, 2), "cores": cores}


def speed_note(times: list[StepTimes], load: dict | None = None) -> str | None:
    """A warning when the timings cannot be compared: spread between steps or a machine busier than its cores."""
    load = machine_load() if load is None else load
    spreads = []
    for steps in times:
        rates = steps.rates()
        if rates:
            spreads.append(max(rates) / statistics.median(rates))
    notes = []
    if spreads and max(spreads) > BUSY_SPREAD:
        notes.append(f"step times vary (best step {max(spreads):.1f}x faster than the median)")
    if load["load_average"] > load["cores"] + 0.5:
        notes.append(f"the machine was busy (load average {load['load_average']:.1f} on {load['cores']} cores)")
    if not notes:
        return None
    return "; ".join(notes) + ": speeds are noisy, compare the best figures or measure again on an idle machine"


class DecodeClock:
    """A `generate()` streamer that timestamps every step (and passes tokens on to ``inner``, if any).

    transformers calls ``put`` with the prompt before prefill, then once per generated step,
    so the gaps after the first generated token are the decode steps.
    """

    def __init__(self, inner=None) -> None:
        self.inner, self.stamps = inner, []

    def put(self, value) -> None:
        import time

        self.stamps.append(time.perf_counter())
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()

    def steps(self, batch: int) -> StepTimes:
        """Decode steps (not the prefill): ``batch`` tokens each."""
        times = StepTimes()
        for before, after in zip(self.stamps[1:], self.stamps[2:]):
            times.add(batch, after - before)
        return times

    def prefill_seconds(self) -> float:
        return self.stamps[1] - self.stamps[0] if len(self.stamps) > 1 else 0.0
