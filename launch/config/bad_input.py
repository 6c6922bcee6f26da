"""Telling the user about a bad config once, also under torchrun.

Note [Config errors under torchrun]

Background
    Every rank validates the same config and finds the same error. torchrun's agent
    watches its workers: as soon as one exits non-zero it sends SIGTERM to the
    others, prints a ``ChildFailedError`` traceback with a failure table, and, under
    ``--max-restarts N``, starts the whole worker group again, N times. So a rank
    that prints the message and exits can get the rank that was about to print it
    killed first (no message at all), and a config error was retried N times.

Algorithm
    - Local rank 0 prints ``error: <message>`` on stderr, flushes, writes the message
      to torchrun's error file (``TORCHELASTIC_ERROR_FILE``, so the failure table's
      root cause shows it instead of "To enable traceback see ..."), then a marker
      file keyed by torchrun's run id and the agent's pid, and exits with code 2.
      The marker lives in this user's private runtime folder and is written and
      read without following links (``compiler.trust``, Note [Trusted folders]):
      its name is guessable from ``ps``, so in a shared ``/tmp`` another local user
      could plant a link there (the job would overwrite the link's target) or a
      marker of their own (a restart would exit 2 with their text). A marker this
      user did not write reads as none.
    - The other local ranks wait for that marker before they exit with code 2 (at
      most ``WAIT_S``; if it never comes, local rank 0 did not find the error, and
      the rank prints the message itself). Only the rank that printed writes the
      error file, so the table names the message once, as the root cause.
    - A worker that torchrun restarts (``TORCHELASTIC_RESTART_COUNT`` > 0) and finds
      the marker exits with code 2 at once, before composing the config: a config
      error is not retried, and not printed again (local rank 0 writes the error
      file again, so the table of the last attempt still shows the message).

Notes
    What torchrun still does, and a worker cannot change: any worker exiting
    non-zero makes the agent raise ``ChildFailedError``, so torchrun exits with code
    1 (the workers' code 2 shows in its failure table), prints its own Python
    traceback and the table (about 40 lines), and with ``--max-restarts N`` still
    starts the group N more times (each attempt ends after Python start-up and the
    imports, a few seconds). Exiting 0 instead would hide the failure from the shell.
    torchrun gives workers an error file only when it keeps per-attempt logs (it
    does by default in torch 2.13); without one the table says "To enable traceback
    see ...". When the runtime folder cannot be used (another user took its path),
    every local rank prints the message and a warning that says why, and a restart
    composes the config again and finds the same error.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

from compiler.trust import UnsafePath, read_private, runtime_dir, write_private

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
