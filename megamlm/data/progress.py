"""Progress of long data work (a shard build, `shards inspect --verify`) on stderr: tqdm's bar on a
terminal; into a file or a pipe (a SLURM job's log, `2> build.log`) a line at most every minute. Redrawn
there as on a terminal, the bar was `\\r`-joined into one ever-longer line, ten redraws a second for the
hours of a Pile build, which `tail -f` shows as nothing at all."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm import tqdm

LOG_INTERVAL_S = 60.0
"""Seconds between two progress lines when stderr is not a terminal."""


class _Lines:
    """tqdm's output as lines: a redraw (`\\r`, the bar, padding) becomes one line; clearing, nothing."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable: Iterable | None = None, *, desc: str, unit: str, enabled: bool = True) -> tqdm:
    """A tqdm bar on stderr (`enabled=False`: silent); lines a minute apart unless stderr is a terminal."""
    if sys.stderr.isatty():
        return tqdm(iterable, desc=desc, unit=unit, disable=not enabled, file=sys.stderr)
    # tqdm's monitor thread redraws a bar not drawn for `maxinterval` s: no more often than the lines
    return tqdm(iterable, desc=desc, unit=unit, disable=not enabled, file=_Lines(sys.stderr),
                mininterval=LOG_INTERVAL_S, maxinterval=LOG_INTERVAL_S)
