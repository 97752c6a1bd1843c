"""What a retrieval evaluation is asked for (task, grid, plot), checked before torch or a model loads.

Light on purpose: the CLI builds and checks the request here and refuses a bad one in about a
second; `kvtool.eval.retrieval` runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtool.errors import DataError, RuntimeConfigError

TASKS = ("passkey", "copy")


@dataclass(frozen=True)
class RetrievalGrid:
    """Context lengths (tokens, prompt included) x depths (0 = start, 1 = just before the question) x seeds."""

    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    seeds: int = 3

    def __post_init__(self) -> None:
        lengths, depths = tuple(self.lengths), tuple(self.depths)
        if not lengths or not depths:
            raise RuntimeConfigError("the retrieval grid is empty: give at least one length (--lengths 256,512) "
                                     "and one depth (--depths 0,0.5,1)")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in lengths):
            raise RuntimeConfigError(f"--lengths {list(lengths)}: every length must be a whole number of tokens >= 2")
        if any(not isinstance(d, (int, float)) or not math.isfinite(d) or not 0 <= d <= 1 for d in depths):
            raise RuntimeConfigError(f"--depths {list(depths)}: every depth must be a fraction in [0, 1] "
                                     "(0 = start of the context, 1 = just before the question)")
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise RuntimeConfigError(f"--seeds {self.seeds} must be a whole number >= 1")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "depths", tuple(float(d) for d in depths))


def parse_numbers(text: str, kind: type, option: str) -> tuple:
    """'256,512' -> (256, 512) (kind int or float); RuntimeConfigError naming the option otherwise."""
    try:
        return tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        example = "256,512" if kind is int else "0,0.5,1"
        raise RuntimeConfigError(f"{option} '{text}' is not a comma-separated list of numbers, e.g. {example}") from None


def check_retrieval_request(task: str, data, facts: int, plot) -> None:
    """Refuse an unknown task, a passkey task without text, facts on the copy task and an unusable plot path."""
    if task not in TASKS:
        raise RuntimeConfigError(f"--task '{task}' is unknown: use one of {', '.join(TASKS)}")
    if task == "passkey" and data is None:
        raise DataError("the passkey task hides the key in text: give held-out text with --data "
                        "(e.g. 'book.txt[0.9:1]'); for models without a tokenizer use --task copy")
    if task == "copy" and facts != 1:
        raise RuntimeConfigError(f"--facts {facts} applies to the passkey task; the copy task hides one needle (leave out --facts)")
    if plot is not None:
        from kvtool.plotting import check_plot_path

        check_plot_path(plot)
