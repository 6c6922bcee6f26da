"""A torchrun worker's last lines, kept in its error file for the launcher.

Note [A failed rank's last line]

Background
    torchrun gives each worker an error file (``TORCHELASTIC_ERROR_FILE``, in the agent's log
    folder: ``/tmp/torchelastic_*/<run id>_*/attempt_<n>/<local rank>/error.json``) to say why
    it failed; torch writes it only for an exception that escapes a function under its
    ``@record``. The job's ranks print one line (or a traceback) and end with ``os._exit``
    (Note [Exit on error], Note [Reliable exit]), so the file stayed unwritten and torchrun's
    failure table said only "To enable traceback see ...".

Algorithm
    - A worker under torchrun keeps the last ``MAX_LINES`` lines it writes to ``sys.stderr``
      (:func:`keep_stderr_tail` wraps the stream; every write still goes through at once).
    - When it ends with a non-zero code (``launch.runtime.dist.exit_now``),
      :func:`write_error_file` writes them in torchrun's format: ``message`` is the last line
      that is not empty, ``py_callstack`` all the kept lines; beside them the exit code and the
      time in nanoseconds, so that the launcher can tell which rank failed first.
    - A file already written (a config error's, Note [Config errors under torchrun]) is left.
    - ``distcompile-train`` reads the files back through torchrun's failures
      (``launch.runtime.elastic``): :func:`last_line` and :func:`failed_at`.

Notes
    Only what goes through Python's ``sys.stderr`` is kept: a line that C++ writes to file
    descriptor 2 (gloo, NCCL) is not, and a rank killed by a signal (SIGKILL, the OOM
    killer) writes nothing.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from typing import Any, TextIO

__all__ = ["MAX_LINES", "keep_stderr_tail", "write_error_file", "last_line", "failed_at"]

MAX_LINES = 60  # a traceback of the job's depth, and the lines just before it


class _StderrTail:
    """``sys.stderr`` as it was, keeping the last lines written through it."""

    def __init__(self, stream: TextIO, lines: int) -> None:
        self._stream = stream
        self.lines: collections.deque[str] = collections.deque(maxlen=lines)
        self._partial = ""

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        *done, self._partial = (self._partial + text).split("\n")
        self.lines.extend(done)
        self._partial = self._partial[-4096:]
        return n

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def tail(self) -> list[str]:
        return [*self.lines, *([self._partial] if self._partial else [])]

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def keep_stderr_tail() -> bool:
    """Under torchrun (an error file given): keep the last lines of ``sys.stderr`` from now on.
    Returns whether it does."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE") or isinstance(sys.stderr, _StderrTail):
        return isinstance(sys.stderr, _StderrTail)
    sys.stderr = _StderrTail(sys.stderr, MAX_LINES)
    return True


def write_error_file(code: int) -> None:
    """Write the kept lines to torchrun's error file, for a worker ending with ``code`` != 0
    (see the Note); nothing when the file exists or no line was written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if code == 0 or not path or not isinstance(sys.stderr, _StderrTail) or os.path.exists(path):
        return
    lines = [line.rstrip() for line in sys.stderr.tail()]
    said = [line for line in lines if line.strip()]
    if not said:
        return
    data = {"message": {"message": said[-1].strip(),
                        "extraInfo": {"py_callstack": "\n".join(lines), "timestamp": str(int(time.time()))}},
            "distcompile": {"exit_code": code, "time_ns": time.time_ns()}}
    try:
        with open(path, "x") as f:
            json.dump(data, f)
    except OSError:
        pass  # the lines are on stderr anyway


def last_line(record: dict[str, Any]) -> str | None:
    """The worker's last line from its error file's JSON (this module's, a config error's, or
    torch's ``@record``), without a leading ``error: ``; None when there is none."""
    message = record.get("message")
    if isinstance(message, dict):
        message = message.get("message")
    if not isinstance(message, str) or not message.strip() or message == "<NONE>":
        return None
    line = message.strip().splitlines()[-1].strip()
    for prefix in ("error: ", "ConfigError: "):
        line = line.removeprefix(prefix)
    return line


def failed_at(record: dict[str, Any]) -> float | None:
    """When the worker wrote its error file, in seconds (nanoseconds where this module wrote it);
    None when the file says nothing of it."""
    ours = record.get("distcompile")
    if isinstance(ours, dict) and isinstance(ours.get("time_ns"), int):
        return ours["time_ns"] / 1e9
    message = record.get("message")
    try:
        return float(message["extraInfo"]["timestamp"]) if isinstance(message, dict) else None
    except (KeyError, TypeError, ValueError):
        return None
