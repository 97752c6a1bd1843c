"""Progress as plain log lines, for long work whose stderr is not a terminal (a log file, `nohup`, CI).

A rich progress bar draws nothing when stderr is redirected, so a 90-minute `kvtool eval ppl` run
under `nohup` said nothing until it finished. `progress_lines` wraps an iterable like the bar does
(same `Progress` signature as `kvtool.capture.no_progress`) and writes one line at most every
``interval`` seconds: items done, percent, time elapsed and an estimate of the time left from the rate
so far. Work shorter than ``interval`` writes nothing, so quick commands (and the tests) stay quiet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

DEFAULT_INTERVAL_S = 60.0


def clock_text(seconds: float) -> str:
    """Seconds as ``1h02m``, ``4m05s`` or ``12s``."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def progress_line(description: str, done: int, total: int | None, elapsed: float) -> str:
    """``description: 300/1000 (30%), 4m05s elapsed, about 9m32s left`` (no percent or estimate without a total)."""
    if not total:
        return f"{description}: {done} done, {clock_text(elapsed)} elapsed"
    line = f"{description}: {done}/{total} ({100 * done / total:.0f}%), {clock_text(elapsed)} elapsed"
    if done:
        line += f", about {clock_text(elapsed * (total - done) / done)} left"
    return line


def progress_lines(
    items: Iterable,
    description: str,
    total: int | None,
    write: Callable[[str], None],
    interval: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator:
    """Yield ``items`` unchanged; before handing out item i (i items done), write `progress_line` when ``interval``
    seconds (default `DEFAULT_INTERVAL_S`) have passed since the start or the last line."""
    interval = DEFAULT_INTERVAL_S if interval is None else interval
    start = last = clock()
    for done, item in enumerate(items):
        now = clock()
        if now - last >= interval:
            write(progress_line(description, done, total, now - start))
            last = now
        yield item
