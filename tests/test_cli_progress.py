"""The commands' progress bars (rev88/cli/progress.py): tqdm on a terminal, summary lines otherwise.

Each bar is drawn on a stream that says it is a terminal, and on one that does not (a log, a
pipe): there no carriage return reaches the stream, only the command's plain lines. The commands
themselves run against real servers in test_submit.py, test_evaluate.py and test_sweeps.py (whose
captured stderr is not a terminal: the summary lines)."""

from __future__ import annotations

import io

import pytest

from rev88.cli import datasets, evaluate, progress, tasks
from rev88.client import SweepResult


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_a_bar_draws_only_on_a_terminal():
    assert progress.on_terminal(Stream(True)) and not progress.on_terminal(Stream(False))
    assert not progress.on_terminal(object())  # no isatty at all: not a terminal
    off = Stream(False)
    bar = progress.bar(10, "x", "it", off)
    bar.update(10)
    bar.close()
    assert bar.disable and off.getvalue() == ""
    on = Stream(True)
    bar = progress.bar(10, "x", "it", on)
    bar.update(10)
    bar.close()
    assert on.getvalue().startswith("\rx:") and "10/10" in on.getvalue() and on.getvalue().endswith("\n")


def test_the_upload_bar_on_a_terminal():
    tty = Stream(True)
    bar = tasks.Progress(2_000_000, stream=tty)
    bar.update(1_000_000)
    bar.update(1_000_000)
    bar.finish()
    text = tty.getvalue()
    assert "\rupload: 100%" in text and "2.00M/2.00M" in text, text
    assert text.endswith("\nwaiting for the result (queue + training)...\n")


def test_the_upload_off_a_terminal_is_one_summary_line():
    log = Stream(False)
    report = tasks.upload_progress("waiting for the server to accept it...", stream=log)
    for sent in (0, 1_000_000, 2_500_000):
        report(sent, 2_500_000)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 2, lines
    assert lines[0].startswith("uploaded 2.5 MB in ") and lines[0].endswith(" s")
    assert lines[1] == "waiting for the server to accept it..."


def test_a_retried_upload_ends_the_first_bar_and_draws_a_new_one():
    tty = Stream(True)
    report = tasks.upload_progress("waiting...", stream=tty)
    report(0, 2_000_000)
    report(1_000_000, 2_000_000)  # the try fails here; the client starts again from 0
    report(0, 2_000_000)
    report(2_000_000, 2_000_000)
    first, second, waiting, end = tty.getvalue().split("\n")
    assert first.startswith("\rupload:") and "1.00M/2.00M" in first.rsplit("\r", 1)[-1], first  # ended where it stood
    assert second.startswith("\rupload:") and "2.00M/2.00M" in second.rsplit("\r", 1)[-1], second
    assert (waiting, end) == ("waiting...", "")


def test_the_draws_bar_on_a_terminal():
    tty = Stream(True)
    bar = evaluate.Progress(2, stream=tty)
    bar.start(0)
    bar.finish(0, 8887, 10000, 1.25)
    bar.start(3)
    bar.finish(3, 8901, 10000, 1.5)
    text = tty.getvalue()
    assert "\revaluate: 100%" in text and "2/2" in text and "draw 3: 8,901 / 10,000 (89.01 %) in 1.50 s" in text
    assert "running draw 0" in text and text.endswith("\n") and text.count("\n") == 1


def test_the_draws_off_a_terminal_are_one_line_each():
    log = Stream(False)
    bar = evaluate.Progress(2, stream=log)
    bar.start(0)
    bar.finish(0, 8887, 10000, 1.25)
    bar.start(3)
    bar.finish(3, 8901, 10000, 1.5)
    assert log.getvalue() == ("evaluate 1/2 draw 0: 8,887 / 10,000 (88.87 %) in 1.25 s\n"
                              "evaluate 2/2 draw 3: 8,901 / 10,000 (89.01 %) in 1.50 s\n")


def _sweep(succeeded: int, running: int, failed: int = 0, queued: int = 0) -> SweepResult:
    counts = {"queued": queued, "running": running, "succeeded": succeeded, "failed": failed, "cancelled": 0}
    return SweepResult({"id": "sw", "status": "running", "counts": counts, "rows": []})


def test_the_cells_bar_on_a_terminal():
    tty = Stream(True)
    bar = datasets.SweepProgress(stream=tty)
    bar(_sweep(0, 2, queued=2))
    bar(_sweep(3, 0, failed=1))
    bar.close()
    text = tty.getvalue()
    assert "\rsweep: 100%" in text and "4/4" in text and "0 running, 1 failed" in text
    assert text.endswith("\n") and text.count("\n") == 1


@pytest.mark.parametrize("finished", [True, False])
def test_the_cells_off_a_terminal_are_one_summary_line(finished):
    log = Stream(False)
    bar = datasets.SweepProgress(stream=log)
    bar(_sweep(0, 2, queued=2))
    if finished:
        bar(_sweep(3, 0, failed=1))
    bar.close()  # also when the wait ends early (its timeout): where the sweep stood
    line = log.getvalue()
    want = "sweep 4/4 cells (0 running, 1 failed) in " if finished else "sweep 0/4 cells (2 running, 0 failed) in "
    assert line.startswith(want) and line.endswith(" s\n") and line.count("\n") == 1, line


def test_no_bar_is_left_open():
    """A closed bar leaves tqdm no instance (its monitor thread, if any, ends with the last one)."""
    from tqdm import tqdm

    before = len(tqdm._instances)
    tty = Stream(True)
    bar = evaluate.Progress(1, stream=tty)
    bar.finish(0, 1, 2, 0.1)
    sweep = datasets.SweepProgress(stream=tty)
    sweep(_sweep(1, 0))
    sweep.close()
    assert len(tqdm._instances) == before
