"""The commands' progress bars: tqdm on stderr, drawn only when stderr is a terminal.

``rev88 submit`` (the upload), ``rev88 evaluate`` (the draws) and ``rev88 sweep --wait`` (the
cells) each make one with :func:`bar`. Off a terminal (a log, a pipe, a test's captured stream)
the bar is disabled -- its updates cost nothing and print nothing -- and each command writes its
own plain summary lines instead, so a log holds no carriage returns.
"""

from __future__ import annotations

import sys
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm


def on_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def bar(total: int, desc: str, unit: str, stream: IO[str] | None = None, **options) -> tqdm:
    """A tqdm bar on ``stream`` (default stderr), disabled unless that stream is a terminal."""
    from tqdm import tqdm  # (here: a command that draws no bar does not pay tqdm's import)

    stream = stream if stream is not None else sys.stderr
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not on_terminal(stream), **options)
