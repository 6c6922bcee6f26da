"""Telling the user about a bad config once, also under torchrun.

Note [Config errors under torchrun]

Background
    Every rank finds the same config error. torchrun's agent, as soon as one worker
    exits non-zero, SIGTERMs the others, prints a ``ChildFailedError`` table and, under
    ``--max-restarts N``, restarts the group N times. So a rank that prints and exits can
    get the rank about to print killed first (no message), and the error is retried.

Algorithm
    - Local rank 0 prints ``error: <message>``, writes it to ``TORCHELASTIC_ERROR_FILE``
      (so the failure table's root cause shows it), then a marker keyed by the run id
      and the agent's pid, and exits 2. The marker lives in this user's private runtime
      folder, written and read without following links (Note [Trusted folders]): its
      name is guessable, and a planted link or marker must not be obeyed.
    - The other local ranks wait (at most ``WAIT_S``) for the marker, then exit 2; if it
      never comes they print the message themselves.
    - A restarted worker that finds the marker exits 2 at once: a config error is not
      retried and not printed again.

Notes
    A worker cannot stop torchrun itself from exiting 1 with its own traceback and
    table, nor from restarting the group (each attempt ends right after the imports);
    exiting 0 would hide the failure. Without a usable runtime folder every local rank
    prints the message with a warning that says why.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

from compiler.cache import UnsafePath, read_private, runtime_dir, write_private

__all__ = ["CONFIG_ERROR_EXIT", "WAIT_S", "report_config_error", "config_error_reported_before"]

CONFIG_ERROR_EXIT = 2
WAIT_S = 10.0  # how long local ranks > 0 wait for local rank 0 to have printed
_PREFIX = "config-error-"  # in the private runtime folder, which names the tool


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def _marker_path(agent_pid: int | None = None) -> str:
    """One marker per torchrun invocation on this machine, in this user's private runtime
    folder (Note [Trusted folders]): its run id (``none`` unless ``--rdzv-id`` or
    ``--standalone``) and the agent's pid (the workers' parent).

    Raises:
        UnsafePath: the runtime folder's path is taken by another user or a link.
    """
    run_id = "".join(c if c.isalnum() or c in "-_" else "_" for c in os.environ.get("TORCHELASTIC_RUN_ID", ""))
    return os.path.join(runtime_dir(), f"{_PREFIX}{run_id}-{agent_pid or os.getppid()}")


def config_error_reported_before() -> bool:
    """True in a worker torchrun restarted after this run's config error was reported.
    Local rank 0 then hands the message to torchrun's failure table once more (its
    error file), without printing it. A marker this job did not write reads as none."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if not (_under_torchrun() and restarted):
        return False
    try:
        marker = _marker_path()
    except UnsafePath:
        return False  # no marker could have been written: compose the config and find the error again
    message = read_private(marker)
    if message is None:
        return False
    # Local rank 0 fails first, with the message; the others follow it.
    attempt = f"{marker}.attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        _write_error_file(message.decode("utf-8", errors="replace"))
        try:
            write_private(attempt, b"", replace=True)
        except OSError:
            pass  # the other ranks stop after WAIT_S instead
    else:
        _wait_for(attempt)
    return True


def _wait_for(path: str) -> bool:
    """Wait at most WAIT_S for ``path`` to be a file this user wrote; False if it never was."""
    deadline = time.monotonic() + WAIT_S
    while read_private(path) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def report_config_error(message: str) -> int:
    """Print ``error: message`` once per machine (see the Note); returns the exit code, 2."""
    if not _under_torchrun():
        _print(message)
        return CONFIG_ERROR_EXIT
    try:
        marker = _marker_path()
    except UnsafePath as e:
        _print(message)  # every local rank says it: without a marker they cannot agree who does
        print(f"warning: the config error was not recorded for torchrun's restarts, so each rank printed it and a "
              f"restart will find it again: {e}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        _print(message)
        _write_error_file(message)
        _remove_stale_markers()
        try:
            write_private(marker, message.encode(), replace=True)
        except OSError as e:
            print(f"warning: the config error could not be recorded at {marker} ({e.strerror}), so the other ranks "
                  "print it too and a torchrun restart finds it again. Clear that folder of what is in the way, or "
                  "free space.", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    if not _wait_for(marker):  # local rank 0 did not find this error: say it here
        _print(message)
        _write_error_file(message)
    return CONFIG_ERROR_EXIT


def _print(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def _write_error_file(message: str) -> None:
    """The message in torchrun's error-file format (``ErrorHandler.record_exception``)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"ConfigError: {message}",
                        "extraInfo": {"py_callstack": f"error: {message}", "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the message is on stderr anyway


def _remove_stale_markers() -> None:
    """Markers of torchrun agents that are gone (markers are small, but do not pile up)."""
    for path in glob.glob(os.path.join(runtime_dir(), _PREFIX + "*")):
        try:
            pid = int(path.rsplit("-", 1)[1].split(".")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.remove(path)
            except OSError:
                pass
        except (ValueError, PermissionError, OSError):
            continue
