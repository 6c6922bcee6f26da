"""Progress of long compiles: what is compiling and for how long, said at least every
``every_s`` seconds while it lasts, so that a minute of compile is not a minute of silence.

Code that compiles marks it with :func:`compiling` (a label per compile; marks nest, the
innermost is what is compiling now). A :class:`ProgressTicker` (the launcher runs one on
rank 0) says a line whenever the marked compile has gone on for ``every_s`` without one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

__all__ = ["ProgressTicker", "compiling", "now_compiling"]

_lock = threading.Lock()
_marks: list[tuple[str, float]] = []  # (label, monotonic start), outermost first


@contextlib.contextmanager
def compiling(label: str) -> Iterator[None]:
    """Mark the block as compiling ``label`` (``"partition 2/4"``)."""
    mark = (label, time.monotonic())
    with _lock:
        _marks.append(mark)
    try:
        yield
    finally:
        with _lock:
            _marks.remove(mark)


def now_compiling() -> list[tuple[str, float]]:
    """The marks in force, outermost first: ``(label, seconds so far)``."""
    now = time.monotonic()
    with _lock:
        return [(label, now - start) for label, start in _marks]


class ProgressTicker:
    """A daemon thread that calls ``say(line)`` when a compile has gone on ``every_s``
    seconds since it started or since the last line; a context manager.

    Args:
        say: what prints a line (rank 0's ``print0``).
        every_s: the longest silence while compiling.
        poll_s: how often the marks are read.
    """

    def __init__(self, say: Callable[[str], None], every_s: float = 10.0, poll_s: float = 0.5) -> None:
        self.say, self.every_s, self.poll_s = say, every_s, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="compile-progress", daemon=True)
        self._last = 0.0

    def __enter__(self) -> ProgressTicker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            line = self.line(time.monotonic())
            if line is not None:
                self.say(line)

    def line(self, now: float) -> str | None:
        """The line to say at ``now`` (a ``time.monotonic()`` reading), or None: nothing
        compiling, or said less than ``every_s`` ago."""
        with _lock:
            marks = list(_marks)
        if not marks:
            return None
        (outer, outer_start), (inner, inner_start) = marks[0], marks[-1]
        if now - max(self._last, outer_start) < self.every_s:
            return None
        self._last = now
        line = f"still compiling {inner} ({now - inner_start:.0f}s so far)"
        return line + (f"; {outer}: {now - outer_start:.0f}s" if len(marks) > 1 else "")
