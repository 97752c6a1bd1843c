"""Plain progress lines for long work whose stderr is not a terminal (`kvtool.progress_lines`), and the CLI's use of them."""

from __future__ import annotations

from typer.testing import CliRunner

import kvtool.progress_lines
from kvtool.cli import app
from kvtool.progress_lines import clock_text, progress_line, progress_lines
from tests.conftest import shared_path


class FakeClock:
    """Advances ``step`` seconds at every reading."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        value = self.now
        self.now += self.step
        return value


def eval_ppl_on_stories():
    """`kvtool eval ppl` on stories260K (1 window of 40 tokens, kivi-2bit, no baseline) under CliRunner: a few seconds."""
    model = str(shared_path("models/stories260K"))
    data = f"{shared_path('data/text/tinystories_val_head.txt')}[0:0.05]"
    return CliRunner().invoke(app, ["eval", "ppl", "-m", model, "-r", "kivi-2bit", "-d", data, "--samples", "1",
                                    "--seq-len", "40", "--no-baseline"])


def test_clock_text():
    assert clock_text(0) == "0s"
    assert clock_text(12.4) == "12s"
    assert clock_text(245) == "4m05s"
    assert clock_text(3720) == "1h02m"
    assert clock_text(-3) == "0s"


def test_progress_line_with_and_without_a_total():
    assert progress_line("scoring", 300, 1000, 245) == "scoring: 300/1000 (30%), 4m05s elapsed, about 9m32s left"
    assert progress_line("scoring", 0, 1000, 61) == "scoring: 0/1000 (0%), 1m01s elapsed"
    assert progress_line("scoring", 7, None, 61) == "scoring: 7 done, 1m01s elapsed"


def test_lines_come_at_most_once_per_interval_and_count_the_items_done():
    lines: list[str] = []
    # the clock advances 25 s per reading: the start reads 0, item i is handed out at 25 (i + 1)
    items = list(progress_lines(range(10), "work", 10, lines.append, interval=60.0, clock=FakeClock(25.0)))
    assert items == list(range(10))  # unchanged, in order
    # lines when 60 s have passed since the last: before items 2 (75 s), 5 (150 s) and 8 (225 s)
    assert lines == [
        "work: 2/10 (20%), 1m15s elapsed, about 5m00s left",
        "work: 5/10 (50%), 2m30s elapsed, about 2m30s left",
        "work: 8/10 (80%), 3m45s elapsed, about 56s left",
    ]


def test_short_work_writes_nothing():
    lines: list[str] = []
    assert list(progress_lines(range(100), "quick", 100, lines.append, interval=60.0, clock=FakeClock(0.01))) == list(range(100))
    assert lines == []


def test_the_default_interval_is_read_at_call_time(monkeypatch):
    monkeypatch.setattr(kvtool.progress_lines, "DEFAULT_INTERVAL_S", 10.0)
    lines: list[str] = []
    list(progress_lines(range(3), "work", 3, lines.append, clock=FakeClock(6.0)))
    assert lines == ["work: 1/3 (33%), 12s elapsed, about 24s left"]


def test_cli_writes_plain_progress_lines_when_stderr_is_not_a_terminal(monkeypatch):
    """A real `kvtool eval ppl` on stories260K under CliRunner (stderr is not a terminal): with the interval at 0 every
    scored token writes a line, and stdout (the table) has none of them."""
    monkeypatch.setattr(kvtool.progress_lines, "DEFAULT_INTERVAL_S", 0.0)
    result = eval_ppl_on_stories()
    assert result.exit_code == 0, result.output
    progress = [line for line in result.stderr.splitlines() if "scoring while decoding:" in line]
    assert len(progress) >= 10, result.stderr
    assert progress[-1].startswith("kivi-2bit: scoring while decoding: ") and "elapsed, about" in progress[-1]
    assert "scoring while decoding:" not in result.stdout


def test_cli_quick_commands_write_no_progress_lines():
    result = eval_ppl_on_stories()
    assert result.exit_code == 0, result.output
    assert "elapsed" not in result.stderr
