"""The compile barrier: no rank leaves a graph's compile before its peers have compiled it.

Note [Compile barrier]

Background
    A rank whose compile is served from a cache reaches the first collective after
    a compile long before a rank that compiles, and the collective times out
    (the process group's timeout, ``train.timeout_s`` in the launcher) although
    nothing is wrong. A collective cannot wait longer than its timeout; a wait in
    the store can.

Algorithm
    :class:`GraphBarrier` serves one group of ranks, with the store keys of
    :class:`compiler.ranks.share.CompileShare` (a graph is named by its digest and by
    how often this rank met that digest before, so ranks that compile the same
    graph use the same key). Around each graph a rank marks the graph started,
    compiles, marks it done, then waits until every peer that compiles the same
    graph is done (:meth:`GraphBarrier.meet`, polling the store, progress
    logged, at most ``timeout_s``). Each rank's state (compiling, meeting
    graph X, running) is in the store too.

Why it cannot deadlock
    Ranks compile different graphs when shapes depend on the data (a recompile
    for shapes only some ranks saw). A rank waits for a peer while the peer has
    started the graph or is compiling (its collectives would wait for it
    anyway). It stops waiting for a peer that sits at *another* graph's barrier
    (neither can start the other's graph before leaving its own barrier, so it
    also marks itself done with the peer's graph), or that has been idle for
    ``grace_s`` since this rank started the graph (SPMD ranks start a graph they
    share at about the same time), with an info line. Letting go of an idle peer
    is no fault: it is busy elsewhere (an evaluation on rank 0 only, as nanoGPT
    does before training), and this rank's first collective waits for it, as it
    would without compile.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

from .liveness import PeerWatch

log = logging.getLogger(__name__)

POLL_S = 0.05


def key_label(key: str) -> str:
    """``<digest>/<n>`` at the end of a store key, as people read it: ``3f9a0c1b2d4e#0``."""
    digest, n = key.rsplit("/", 2)[-2:]
    return f"{digest[:12]}#{n}"


class GraphBarrier:
    """The barrier of one group of ranks (Note [Compile barrier]).

    Args:
        store, rank, ranks, prefix: the group's store, this rank, the group's ranks
            and the prefix of this barrier's state keys.
        timeout_s: longest wait for a peer to finish a graph; after it the barrier is off.
        grace_s: how long after this rank started a graph an idle peer (one that
            neither compiles nor waits at a barrier) may still start it.
        stats: gets the seconds waited (``wait_s``); ``warn``: says what went wrong.
    """

    def __init__(self, store: Any, rank: int, ranks: Sequence[int], prefix: str, *, timeout_s: float,
                 grace_s: float, progress_s: float, stats: Any, warn: Callable[[str], None]) -> None:
        self.store, self.rank, self.ranks, self.prefix = store, rank, list(ranks), prefix
        self.timeout_s, self.grace_s, self.progress_s = timeout_s, grace_s, progress_s
        self.stats, self.warn = stats, warn
        self.on = True
        self.watch = PeerWatch(store, rank, describe=self._describe)

    def enter(self, base: str) -> float:
        """This rank starts compiling graph ``base``; returns when (``perf_counter``)."""
        self.store.set(f"{base}/start/{self.rank}", b"1")
        self._set_state("compiling")
        return time.perf_counter()

    def done(self, base: str) -> None:
        self.store.set(f"{base}/done/{self.rank}", b"1")

    def meet(self, base: str, started: float) -> None:
        """Wait until every peer that compiles graph ``base`` has compiled it."""
        self._set_state(f"meeting {base}")
        t0 = time.perf_counter()
        try:
            self._wait_for_peers(base, started, t0)
        finally:
            self.stats.wait_s += time.perf_counter() - t0
            self._set_state("running")

    def _wait_for_peers(self, base: str, started: float, t0: float) -> None:
        waiting = {r: started for r in self.ranks if r != self.rank}  # peer -> last seen compiling
        late: list[int] = []
        next_note = t0 + self.progress_s
        while waiting:
            now = time.perf_counter()
            for r, seen in list(waiting.items()):
                if self.store.check([f"{base}/done/{r}"]):
                    del waiting[r]
                    continue
                state = self._peer_state(r)
                if self.store.check([f"{base}/start/{r}"]) or state == "compiling":
                    waiting[r] = now  # compiling (this graph or one before it): its collectives wait for it
                elif state.startswith("meeting ") or now - seen >= self.grace_s:
                    # at another graph's barrier (it cannot start this one before it leaves), or idle
                    # for the grace since this rank started the graph
                    del waiting[r]
                    late.append(r)
                    if state.startswith("meeting "):
                        self._excuse(state.split(" ", 1)[1])
            if not waiting:
                break
            self.watch.check(sorted(waiting),
                             f"rank(s) {sorted(waiting)} to finish compiling graph {key_label(base)}")
            if now - t0 >= self.timeout_s:
                self.on = False
                self.warn(f"rank(s) {sorted(waiting)} did not finish compiling graph {key_label(base)} within "
                          f"{self.timeout_s:.0f}s; no longer waiting for peers after a compile")
                return
            if now >= next_note:
                log.info("rank %d: waiting for rank(s) %s to finish compiling graph %s (%.0fs)", self.rank,
                         sorted(waiting), key_label(base), now - t0)
                next_note += self.progress_s
            time.sleep(POLL_S)
        if late:
            self._late(late, base)

    def _set_state(self, state: str) -> None:
        self.store.set(f"{self.prefix}/state/{self.rank}", state)

    def _peer_state(self, rank: int) -> str:
        key = f"{self.prefix}/state/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else "running"

    def _describe(self, rank: int) -> str:
        state = self._peer_state(rank)
        if state.startswith("meeting "):
            return f"waiting at the barrier of graph {key_label(state.split(' ', 1)[1])}"
        return "compiling" if state == "compiling" else state

    def _excuse(self, theirs: str) -> None:
        """A peer waits at the barrier of a graph this rank is not compiling now: mark this rank done
        with it, so that the peer stops waiting for this rank as this rank stops waiting for it."""
        if not self.store.check([f"{theirs}/start/{self.rank}"]):
            self.store.set(f"{theirs}/done/{self.rank}", b"excused")

    def _late(self, late: list[int], base: str) -> None:
        log.info("Shared compile, rank %d: rank(s) %s did not start graph %s within %.0fs of this rank (busy "
                 "elsewhere, such as an evaluation on one rank, or a graph only some ranks compile); not waiting "
                 "for them: the next collective does.", self.rank, late, key_label(base), self.grace_s)
