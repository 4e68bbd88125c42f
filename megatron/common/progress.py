"""Progress of long work on a terminal: a line redrawn in place (a bar when the size is
known, a count and a rate when not), and "starting ..." lines before slow phases.

Only on a terminal: in CI (CI=true, as GitHub Actions, GitLab and most runners set it) and
when the output goes to a file or a pipe, nothing is drawn, so logs keep only the lines
that say what was done. MEGATRON_SYSX_PROGRESS=1 or 0 forces it on or off.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

_TRUE = ("1", "true", "yes", "on")
BAR_WIDTH = 24
REDRAW_EVERY_S = 0.2


def progress_enabled(stream: TextIO | None = None) -> bool:
    """Whether progress may be drawn on `stream` (default stdout)."""
    forced = os.environ.get("MEGATRON_SYSX_PROGRESS", "").strip().lower()
    if forced:
        return forced in _TRUE
    if os.environ.get("CI", "").strip().lower() in _TRUE:
        return False
    stream = stream if stream is not None else sys.stdout
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def say_starting(line: str, stream: TextIO | None = None) -> None:
    """`line` (a phase that is about to take a while) on a terminal only."""
    stream = stream if stream is not None else sys.stdout
    if progress_enabled(stream):
        print(line, file=stream, flush=True)


class Progress:
    """`label [#####-------]  40/100 files  3.1 s` redrawn in place, or without a total
    `label 1200 documents (400/s)  3.1 s`; `close()` ends the line. Does nothing where
    progress_enabled() is false (or `enabled` says so)."""

    def __init__(self, label: str, total: float | None = None, unit: str = "",
                 stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.enabled = progress_enabled(self.stream) if enabled is None else enabled
        self.label, self.total, self.unit = label, total, unit
        self.done = 0.0
        self.start = self._last = time.monotonic()
        self._drawn = False

    def update(self, done: float) -> None:
        """Set the amount done so far; redrawn at most every REDRAW_EVERY_S."""
        self.done = done
        now = time.monotonic()
        if self.enabled and now - self._last >= REDRAW_EVERY_S:
            self._last = now
            self._draw(now)

    def advance(self, amount: float = 1) -> None:
        self.update(self.done + amount)

    def close(self) -> None:
        """Draw the final state and end the line (only if anything was drawn)."""
        if self.enabled and self._drawn:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def text(self, now: float) -> str:
        """The line as drawn at time `now`."""
        seconds = now - self.start
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            share = min(max(self.done / self.total, 0.0), 1.0)
            filled = int(round(share * BAR_WIDTH))
            return (f"{self.label} [{'#' * filled}{'-' * (BAR_WIDTH - filled)}] "
                    f"{_number(self.done)}/{_number(self.total)}{unit} {seconds:.1f} s")
        rate = self.done / seconds if seconds > 0 else 0.0
        return f"{self.label} {_number(self.done)}{unit} ({_number(rate)}/s) {seconds:.1f} s"

    def _draw(self, now: float) -> None:
        self.stream.write("\r" + self.text(now) + "\x1b[K")  # erase what a longer line left
        self.stream.flush()
        self._drawn = True


def _number(value: float) -> str:
    return f"{value:.0f}" if value >= 100 or float(value).is_integer() else f"{value:.1f}"
