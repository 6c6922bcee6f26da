"""The peer watchdog of the main job: a rank whose peer stops answering or dies in the middle of
a step ends by itself, with one line naming that peer.

Note [Silent peer mid-step]

Background
    A rank whose peer stopped (SIGSTOP, a debugger, a frozen node) mid-backward waits
    inside the all-reduce, in C++, until the process group's timeout, then fails with a
    traceback naming no rank; torchrun's SIGTERM does nothing to the stopped peer. A peer
    that died closes its sockets, and the survivor fails at once, as namelessly.

Algorithm
    :class:`PeerWatchdog` holds the launcher's run (world size above 1):
    - It starts a :class:`compiler.ranks.liveness.PeerMonitor` (keeping this rank's heartbeat
      for the whole run) with ``dead_after_s = train.timeout_s``. On the entry point's
      path, a peer silent that long makes the monitor's thread print one line naming it
      and this rank's step, and end the process (``EXIT_PEER_LOST``): the main thread is
      stuck in C++ and cannot raise.
    - An error leaving the run is checked first: a peer gone or stopped (``/proc`` on
      this machine) or silent within a few beats turns it into
      :class:`compiler.ranks.liveness.PeerLost`, printed without a traceback. A peer dead while
      this cgroup's OOM kill count grew is named as probably OOM-killed (Note [OOM kill
      count]).

Notes
    The heartbeat runs until ``run()`` returns, so a peer still finishing never sees it
    silent. One line per process (``claim_exit``). ``run()`` called from Python never
    ends the process: the monitor only records.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from compiler.ranks import PeerLost, PeerMonitor, WaitInterrupted, on_default_store

from ..config.schema import ConfigError
from .dist import DistEnv, exit_now
from .leave import EXIT_PEER_LOST, claim_exit
from .oom import oom_kills

log = logging.getLogger(__name__)

__all__ = ["LostPeer", "PeerWatchdog", "lost_peer_line"]

_CLOSED = ("connection closed", "connection reset", "closed by peer", "broken pipe", "remote process exited")
_COLLECTIVE = ("gloo", "nccl", "timed out", *_CLOSED)  # an error of a collective, worth waiting a few beats for
_RESTART = ("restart the job; with checkpoints, resume with train.resume=true "
            "(Note [Silent peer mid-step] in launch/runtime/watchdog.py)")


@dataclass(frozen=True)
class LostPeer:
    """What a rank knows of a peer that stopped answering.

    Attributes:
        peer, rank: the silent peer and this rank; ``where``: what this rank was in (``step 20``).
        silent_s: how long the peer's heartbeat has not moved.
        state: its process seen from here: ``stopped``, ``gone``, ``running``; None on another machine.
        closed: its connection closed (a collective failed so): it ended.
        timeout_s: ``train.timeout_s``; ``oom_kills``: OOM kills in this cgroup since the run started.
    """

    peer: int
    rank: int
    where: str
    silent_s: float
    state: str | None
    closed: bool
    timeout_s: float
    oom_kills: int | None = None

    @property
    def died(self) -> bool:
        return self.state == "gone" or (self.state is None and self.closed)


def lost_peer_line(p: LostPeer) -> str:
    """The one line (what, why, how to fix) for a peer that died or stopped answering."""
    if p.died:
        how = "its process is gone" if p.state == "gone" else "its connection closed"
        if p.oom_kills:
            return (f"rank {p.peer} died in {p.where} ({how}; no heartbeat for {p.silent_s:.0f}s), probably killed "
                    f"by the out-of-memory killer: this machine's memory cgroup counted {p.oom_kills} OOM kill(s) "
                    f"since the run started; rank {p.rank} stops too. Use less memory per rank (a smaller "
                    f"train.batch_size or train.seq_len, or more ranks), then {_RESTART}.")
        return (f"rank {p.peer} died in {p.where} ({how}; no heartbeat for {p.silent_s:.0f}s): it was killed "
                f"(kill -9, the out-of-memory killer) or ended on an error of its own (see its output); rank "
                f"{p.rank} stops too. Find what ended it, then {_RESTART}.")
    seen = {"stopped": "its process is stopped: SIGSTOP or a debugger",
            "running": "its process runs but does not beat: it hangs"}.get(
        p.state or "", "it was stopped (SIGSTOP, a debugger), hangs, or its machine or network was lost")
    return (f"rank {p.peer} stopped answering {p.silent_s:.0f}s ago (no heartbeat; {seen}) while rank {p.rank} "
            f"waited for it in {p.where}; rank {p.rank} ends instead of waiting for it (the limit is "
            f"train.timeout_s={p.timeout_s:g}; a larger value waits longer for a silent peer). Find what stopped "
            f"it, then {_RESTART}.")


def _ours(e: BaseException) -> bool:
    """An exception that already says what it has to (a config error, a stop all ranks agreed on,
    a peer lost in a store wait), or no error at all (KeyboardInterrupt, SystemExit)."""
    if not isinstance(e, Exception) or isinstance(e, ConfigError) or isinstance(getattr(e, "exit_code", None), int):
        return True
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, (PeerLost, WaitInterrupted)):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _says(e: BaseException, needles: tuple[str, ...]) -> bool:
    text = str(e).lower()
    return any(needle in text for needle in needles)


def _from_collective(e: BaseException) -> bool:
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    return (dist_error is not None and isinstance(e, dist_error)) or (isinstance(e, RuntimeError)
                                                                      and _says(e, _COLLECTIVE))


class PeerWatchdog:
    """Held around the launcher's run (Note [Silent peer mid-step]); inert on one rank.

    Args:
        env: this rank's process group.
        timeout_s: ``train.timeout_s``: a peer silent this long is taken for dead.
        exit_on_silence: end the process from the monitor's thread (the entry point's choice);
            False: only translate the error that leaves the run.
    """

    def __init__(self, env: DistEnv, timeout_s: float, exit_on_silence: bool = False) -> None:
        self.env, self.timeout_s, self.exit_on_silence = env, timeout_s, exit_on_silence
        self.where = "setup or warm-up, before step 1"
        self.monitor: PeerMonitor | None = None
        self._beating: PeerMonitor | None = None
        self._oom_start: int | None = None

    def __enter__(self) -> "PeerWatchdog":
        found = on_default_store(None) if self.env.world_size > 1 else None
        if found is not None:
            self._oom_start = oom_kills()
            on_silent = self._on_silent if self.exit_on_silence else None
            self.monitor = PeerMonitor(*found, dead_after_s=self.timeout_s, on_silent=on_silent).start()
        return self

    def at_step(self, job: Any, step: int) -> None:
        """A step callback of ``launch.train``: the step this rank is in, for the line."""
        self.where = f"step {step}"

    def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> bool:
        monitor, self.monitor = self.monitor, None
        if monitor is None:
            return False
        monitor.stop()
        self._beating = monitor  # beats on until run() returns: a peer still finishing its run waits for it
        if e is None or _ours(e):
            return False
        # A collective's error waits a few beats for a dead peer's counter to stop; any other looks once.
        found = monitor.find_lost(within_s=4 * monitor.beat.beat_s + 2.0 if _from_collective(e) else 0.0)
        if found is None:  # every peer beats: this rank's own error
            return False
        raise PeerLost(lost_peer_line(self._lost(*found, closed=_says(e, _CLOSED)))) from e

    def _lost(self, peer: int, silent_s: float, state: str | None, closed: bool) -> LostPeer:
        now = oom_kills() if self._oom_start is not None else None
        new = now - self._oom_start if now is not None and self._oom_start is not None else None
        return LostPeer(peer, self.env.rank, self.where, silent_s, state, closed, self.timeout_s,
                        new if state == "gone" else None)

    def _on_silent(self, peer: int, silent_s: float) -> None:
        """The monitor's thread: a peer silent for train.timeout_s while the main thread is blocked."""
        monitor = self.monitor
        state = monitor.state_of(peer) if monitor is not None else None
        line = lost_peer_line(self._lost(peer, silent_s, state, closed=False))
        if not claim_exit():  # the main thread is already leaving with its own line
            return
        print(f"error: {line}", file=sys.stderr, flush=True)
        exit_now(EXIT_PEER_LOST)
