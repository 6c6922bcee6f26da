"""How a rank ends after an error once the process group is up (Note [Exit on error] in
``launch.runtime.dist``): one line and its own exit code for a stop every rank agreed
on or was told of, this rank's traceback and exit code 1 for anything else."""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Iterator

from compiler.ranks import PeerLost, WaitInterrupted

from ..config.bad_input import report_config_error
from ..config.schema import ConfigError
from .dist import DistEnv, exit_now
from .preempt import EXIT_PREEMPTED, Preempted

__all__ = ["leave", "claim_exit", "EXIT_PEER_LOST"]

EXIT_PEER_LOST = 1  # a failure: a peer died or stopped; torchrun's --max-restarts may restart the group
_LEAVING = threading.Lock()  # held by whoever prints this process's last line: leave(), or the peer watchdog


def claim_exit() -> bool:
    """True for the first caller in this process, which then prints its line and ends the process;
    the peer watchdog's thread (``launch.runtime.watchdog``) and :func:`leave` never both speak."""
    return _LEAVING.acquire(blocking=False)


def _chain(e: BaseException) -> Iterator[BaseException]:
    """``e`` and what it was raised from (dynamo wraps a backend's error in its own)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def leave(e: BaseException, env: DistEnv) -> None:
    """Print ``e`` and end the process before any destructor of the model or the process
    group runs. :class:`ConfigError` is one message with code 2; an exception with an
    ``exit_code`` (:class:`Preempted`, ``NonFinite``) one line from rank 0 with that code;
    a wait for a peer's compile that ended because the peer died or stopped
    (:class:`compiler.ranks.liveness.PeerLost`) or on SIGTERM/SIGINT (``WaitInterrupted``) one
    line from every rank that saw it, with code 1 or 75 (Note [Peer liveness])."""
    if not claim_exit():  # the peer watchdog said why this rank ends, and ends it now
        threading.Event().wait()
    if isinstance(e, ConfigError):  # found in the group (ranks' configs, the checkpoint): as before it
        exit_now(report_config_error(str(e)))
    code = getattr(e, "exit_code", None)
    stop = next((x for x in _chain(e) if isinstance(x, (PeerLost, WaitInterrupted))), None)
    if isinstance(code, int):
        if env.is_main or getattr(e, "every_rank", False):
            print(f"{'preempted' if isinstance(e, Preempted) else 'error'}: {e}", file=sys.stderr, flush=True)
    elif isinstance(stop, WaitInterrupted):
        code = EXIT_PREEMPTED
        print(f"preempted: {stop} Nothing was saved in this run's compile; an earlier checkpoint, if any, is "
              f"kept: continue with train.resume=true (exit code {EXIT_PREEMPTED}, to requeue on)",
              file=sys.stderr, flush=True)
    elif isinstance(stop, PeerLost):
        code = EXIT_PEER_LOST
        print(f"error: {stop}", file=sys.stderr, flush=True)
    else:
        traceback.print_exception(e)
        code = 1
    exit_now(code)
