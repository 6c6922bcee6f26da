"""How rank 0's log records look on the console: like the job's own lines, so that
everything it prints reads in one format (``configs/hydra/job_logging/distcompile.yaml``
installs it; the log file keeps time and logger)."""

from __future__ import annotations

import logging

__all__ = ["ConsoleFormatter"]


class ConsoleFormatter(logging.Formatter):
    """The message alone; ``warning: `` or ``error: `` before it at those levels."""

    def __init__(self) -> None:
        super().__init__("%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.ERROR:
            return f"error: {text}"
        if record.levelno >= logging.WARNING:
            return f"warning: {text}"
        return text
