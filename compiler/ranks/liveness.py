"""Waits in the store that end when a peer dies, stops, or the job is told to stop.

Note [Peer liveness]

Background
    The compile barrier and the shared compile wait in the store for a peer, up to
    ``share_timeout_s`` (long: a live peer that compiles must be waited for). A peer
    that died (``kill -9``, an OOM kill, a lost node) or was stopped (SIGSTOP) never
    answers; without liveness its survivors would wait the whole timeout, deaf to
    SIGTERM, where a collective would have failed after the process group's timeout.

Algorithm
    - Heartbeat: every rank that shares compiles or meets the step gate runs a daemon
      thread that adds one to ``distcompile/alive/<rank>`` every ``beat_s``, through a
      store client of its own (a client runs one request at a time, so a blocking
      wait of the main thread must not hold the beats back). The store's ``add``
      releases the GIL, so a rank busy compiling still beats.
    - A waiter reads its peers' counters about once a second and notes, on its own
      clock, when each last moved (no clocks compared across machines). A counter
      still for ``dead_after_s`` (the store's timeout: ``train.timeout_s`` in the
      launcher) raises :class:`PeerLost` naming the peer, what it was doing and for
      how long it has been silent.
    - Every wait polls :func:`stop_requested`; a wait still going ``STOP_GRACE_S``
      after SIGTERM raises :class:`WaitInterrupted`, before torchrun's SIGKILL, so a
      longer compile ends with a line said instead of a silent kill.
    - :class:`PeerMonitor` is the watchdog for a rank blocked inside a collective
      (which reads no counter): its own thread calls ``on_silent`` once when a peer
      is silent for ``dead_after_s``, deferring to a store wait in progress so one
      peer is reported once; :meth:`PeerMonitor.find_lost` names the peer after a
      collective failed. Heartbeats publish boot id, pid namespace and pid, so a peer
      on the same machine is seen stopped or gone directly (:func:`process_state`).

Notes
    A stopped process stops all its threads, its heartbeat's too: that is what makes
    it detectable; a live rank compiling for an hour still beats.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)

__all__ = ["PeerLost", "WaitInterrupted", "Heartbeat", "PeerWatch", "PeerMonitor", "request_stop", "stop_requested",
           "clear_stop", "dead_after_s", "on_default_store", "process_identity", "process_state"]

KEY = "distcompile/alive"
PROC_KEY = "distcompile/proc"  # where each rank's process runs: process_identity()
DEFAULT_DEAD_AFTER_S = 300.0  # a store without a timeout of its own
CHECK_S = 1.0  # how often a waiter reads its peers' heartbeats
STOP_GRACE_S = 10.0  # how long a wait goes on after a stop request (torchrun's agent SIGKILLs after 30 s)

_stop: tuple[str, float] | None = None  # the reason, and when (monotonic)
_store_wait_checked = -1e9  # when a PeerWatch last checked (monotonic): a store wait is in progress


class PeerLost(RuntimeError):
    """A peer this rank waits for in the store stopped beating: dead or stopped."""


class WaitInterrupted(RuntimeError):
    """The job was told to stop (SIGTERM) while this rank waited for a peer in the store."""


def request_stop(reason: str) -> None:
    """Make every store wait of this process end with :class:`WaitInterrupted` once it has
    gone on ``STOP_GRACE_S`` after this call (called from a signal handler: it only sets a flag)."""
    global _stop
    if _stop is None:
        _stop = (reason, time.monotonic())


def clear_stop() -> None:
    global _stop
    _stop = None


def stop_requested() -> str | None:
    """The reason of a stop request whose grace has passed, else None."""
    return _stop[0] if _stop is not None and time.monotonic() - _stop[1] >= STOP_GRACE_S else None


def dead_after_s(store: Any) -> float:
    """How long a silent peer is waited for: the store's timeout (the launcher's
    ``train.timeout_s``), else :data:`DEFAULT_DEAD_AFTER_S`."""
    timeout = getattr(store, "timeout", None)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else 0.0
    return seconds if seconds > 0 else DEFAULT_DEAD_AFTER_S


class Heartbeat:
    """One rank's heartbeat in one store, while any of its owners lives (see the Note).
    ``Heartbeat.start(store, rank, owner)`` starts it once per (store, rank) and adds the
    owner (a :class:`compiler.ranks.share.CompileShare` or a :class:`compiler.ranks.step_gate.StepGate`); the
    thread ends with the last owner."""

    _running: dict[tuple[int, int], "Heartbeat"] = {}
    _lock = threading.Lock()

    def __init__(self, store: Any, rank: int, beat_s: float) -> None:
        # Its own connection: a store client runs one request at a time, and a long blocking wait of the
        # main thread (a plan exchange, a shared compile) must not hold the beats back.
        self.store, self.rank, self.beat_s = _own_client(store), rank, beat_s
        self.source = store
        self.owners: list[weakref.ref] = []
        self._thread = threading.Thread(target=self._run, name=f"distcompile-heartbeat-{rank}", daemon=True)

    @classmethod
    def start(cls, store: Any, rank: int, owner: Any, beat_s: float | None = None) -> "Heartbeat":
        with cls._lock:
            key = (id(store), rank)
            beat = cls._running.get(key)
            if beat is None or not beat._thread.is_alive() or beat.source is not store:
                beat = cls(store, rank, beat_s if beat_s is not None else min(1.0, dead_after_s(store) / 10))
                beat._beat()  # the first beat before anyone waits for it
                beat.store.set(f"{PROC_KEY}/{rank}", process_identity())
                cls._running[key] = beat
                beat.owners.append(weakref.ref(owner))
                beat._thread.start()
            else:
                beat.owners.append(weakref.ref(owner))
            return beat

    def _beat(self) -> None:
        self.store.add(f"{KEY}/{self.rank}", 1)

    def _run(self) -> None:
        while not _EXITING.wait(self.beat_s):
            with self._lock:
                if all(owner() is None for owner in self.owners):  # nobody waits on this rank through it
                    if self._running.get((id(self.source), self.rank)) is self:
                        del self._running[(id(self.source), self.rank)]
                    return
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone (the group was torn down): stop beating
                return


# Set at interpreter exit: every heartbeat ends before the interpreter tears down, so none is inside a
# store request while C++ objects are destroyed (a rank of a job that ended without os._exit aborted once
# with "terminate called without an active exception", torch 2.15, cause not established).
_EXITING = threading.Event()


@atexit.register
def _end_heartbeats() -> None:
    _EXITING.set()
    for beat in list(Heartbeat._running.values()):
        beat._thread.join(timeout=2 * beat.beat_s)


def on_default_store(ranks: Sequence[int] | None) -> tuple[Any, int, list[int]] | None:
    """The default group's store, this rank and ``ranks`` (None: the default group), for a
    wait among those ranks (the shared compile, the step gate); None without an
    initialised process group of more than one rank, or when this rank is not in ``ranks``."""
    import torch.distributed as dist

    from .. import _torch_internals as _ti

    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = list(ranks) if ranks is not None else list(range(dist.get_world_size()))
    if len(ranks) <= 1 or dist.get_rank() not in ranks:
        return None
    return _ti.default_store(), dist.get_rank(), ranks


def _own_client(store: Any) -> Any:
    """A client of ``store`` that the heartbeat thread alone uses (``Store.clone``, documented for
    using a store from several threads); ``store`` itself where it cannot be cloned."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):  # a store type without clone
        return store


class PeerWatch:
    """What a waiter knows of its peers' heartbeats: raise when the one waited for is silent
    for ``dead_after_s``, or when the job was told to stop.

    Args:
        store, rank: the store the peers beat in, and this rank (for messages).
        dead_after_s: silence after which a peer is taken for dead (default: the store's timeout).
        describe: ``rank -> str``, what a peer was doing, for the message.
    """

    def __init__(self, store: Any, rank: int, dead_after_s: float | None = None,
                 describe: Callable[[int], str] | None = None) -> None:
        self.store, self.rank = store, rank
        self.dead_after_s = dead_after_s if dead_after_s is not None else globals()["dead_after_s"](store)
        self.describe = describe or (lambda r: "")
        self._last: dict[int, tuple[bytes | None, float]] = {}
        self._checked = 0.0

    def check(self, peers: Sequence[int], what: str) -> None:
        """Called in a wait loop: raises :class:`WaitInterrupted` when a stop was requested, and
        :class:`PeerLost` when one of ``peers`` has been silent for ``dead_after_s``."""
        global _store_wait_checked
        _store_wait_checked = time.monotonic()  # a PeerMonitor leaves this wait to report a silent peer
        reason = stop_requested()
        if reason is not None:
            raise WaitInterrupted(f"rank {self.rank} stopped waiting for {what}: {reason}.")
        now = time.monotonic()
        if now - self._checked < CHECK_S:
            return
        self._checked = now
        for peer in peers:
            key = f"{KEY}/{peer}"
            value = self.store.get(key) if self.store.check([key]) else None
            seen, since = self._last.get(peer, (None, now))
            if peer not in self._last or value != seen:
                self._last[peer] = (value, now)
                continue
            if now - since >= self.dead_after_s:
                doing = self.describe(peer)
                raise PeerLost(
                    f"rank {self.rank} waited for {what}, but rank {peer} has been silent for {now - since:.0f}s "
                    f"(no heartbeat in the store{'; it was ' + doing if doing else ''}): it died or was stopped "
                    "(kill -9, an out-of-memory kill, SIGSTOP, a lost node). Every rank stops here instead of "
                    f"waiting for it; the limit is the process group's timeout ({self.dead_after_s:.0f}s, "
                    "train.timeout_s in the launcher). Restart the job; with checkpoints, resume with "
                    "train.resume=true (Note [Peer liveness] in compiler/ranks/liveness.py)."
                )


# --- the watchdog of a rank blocked in a collective -----------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def process_identity(proc: str = "/proc") -> str:
    """Where this process runs, as ``boot_id:pid_namespace:pid@host``: a peer with the same boot id and
    pid namespace can look the pid up (:func:`process_state`)."""
    try:
        pidns = os.readlink(f"{proc}/self/ns/pid")
    except OSError:
        pidns = ""
    return f"{_read(f'{proc}/sys/kernel/random/boot_id') or ''}:{pidns}:{os.getpid()}@{socket.gethostname()}"


def process_state(identity: str, proc: str = "/proc") -> str | None:
    """What a peer's process (its :func:`process_identity`) is doing, seen from this one: ``"stopped"``
    (SIGSTOP, a debugger), ``"gone"`` (it ended; a zombie not yet reaped counts), ``"running"``; None
    when it runs on another machine or in another pid namespace, where nothing can be seen."""
    where, _, pid = identity.rpartition("@")[0].rpartition(":")
    here = process_identity(proc).rpartition("@")[0].rpartition(":")[0]
    if not where or where != here or where.startswith(":") or not pid.isdigit():
        return None
    stat = _read(f"{proc}/{pid}/stat")
    if stat is None:
        return "gone"
    state = stat.rpartition(")")[2].split()[:1]  # the field after "(comm)", which may hold spaces
    if state and state[0] in ("T", "t"):
        return "stopped"
    if state and state[0] in ("Z", "X"):
        return "gone"
    return "running"


class PeerMonitor:
    """Every peer's heartbeat, read by a daemon thread of its own while the monitor runs (Note [Peer
    liveness]): ``on_silent(peer, silent_s)`` is called once, from that thread, when a peer has been
    silent for ``dead_after_s`` and no store wait is reporting it already.

    Args:
        store, rank, ranks: the store every rank beats in, this rank, and the group's ranks.
        dead_after_s: the silence after which ``on_silent`` is called (default: the store's timeout).
        on_silent: called from the monitor's thread; None: the monitor only records.
        check_s: how often the counters are read (default: about once a second, less often
            beyond 64 peers, so that the store's load stays bounded).
    """

    def __init__(self, store: Any, rank: int, ranks: Sequence[int], dead_after_s: float | None = None,
                 on_silent: Callable[[int, float], None] | None = None, check_s: float | None = None) -> None:
        self.rank, self.peers = rank, [r for r in ranks if r != rank]
        self.dead_after_s = dead_after_s if dead_after_s is not None else globals()["dead_after_s"](store)
        self.on_silent = on_silent
        self.check_s = check_s if check_s is not None else CHECK_S * max(1.0, len(self.peers) / 64)
        self.beat = Heartbeat.start(store, rank, self)
        self.store = _own_client(store)
        self._moved: dict[int, tuple[bytes | None, float]] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._fired = False
        self._thread = threading.Thread(target=self._run, name=f"distcompile-peer-monitor-{rank}", daemon=True)

    def start(self) -> "PeerMonitor":
        self.poll()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()

    def poll(self) -> None:
        """Read every peer's counter once and note, on this clock, those that moved."""
        keys = [f"{KEY}/{p}" for p in self.peers]
        if self.store.check(keys):
            multi = getattr(self.store, "multi_get", None)
            values = multi(keys) if multi is not None else [self.store.get(k) for k in keys]
        else:  # a peer that has not beaten yet: get() would wait for its key
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        now = time.monotonic()
        with self._lock:
            for peer, value in zip(self.peers, values):
                seen = self._moved.get(peer)
                if seen is None or seen[0] != value:
                    self._moved[peer] = (value, now)

    def silent(self, at_least_s: float) -> list[tuple[int, float]]:
        """``(peer, seconds)`` for the peers whose counter has not moved for ``at_least_s``, longest first."""
        now = time.monotonic()
        with self._lock:
            found = [(p, now - t) for p, (_, t) in self._moved.items() if now - t >= at_least_s]
        return sorted(found, key=lambda f: -f[1])

    def state_of(self, peer: int) -> str | None:
        """:func:`process_state` of ``peer``'s process (None: unknown, or on another machine)."""
        try:
            key = f"{PROC_KEY}/{peer}"
            return process_state(self.store.get(key).decode()) if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store is gone: nothing seen
            return None

    def find_lost(self, within_s: float) -> tuple[int, float, str | None] | None:
        """After a collective failed: ``(peer, silent_s, state)`` for a peer that is gone or stopped
        (seen on this machine) or whose counter has not moved for three beats and a check; reads for
        up to ``within_s`` (a dead peer's counter stops at once, but is seen so only after a few
        beats); None when every peer still beats."""
        confirm_s = 3 * self.beat.beat_s + CHECK_S
        deadline = time.monotonic() + within_s
        while True:
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the store is gone too: the silence so far decides
                pass
            for peer, silent_s in self.silent(1.5 * self.beat.beat_s):
                state = self.state_of(peer)
                if state in ("gone", "stopped") or silent_s >= confirm_s:
                    return peer, silent_s, state
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(0.2, self.beat.beat_s / 4))

    def _run(self) -> None:
        while not self._done.wait(self.check_s) and not _EXITING.is_set():
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - the store is unreachable: the silence so far stands
                log.debug("rank %d could not read its peers' heartbeats: %s", self.rank, e)
            if self.on_silent is None or self._fired:
                continue
            lost = self.silent(self.dead_after_s)
            if lost and time.monotonic() - _store_wait_checked > 3 * CHECK_S:  # else the wait reports it
                self._fired = True
                self.on_silent(*lost[0])
