"""The step gate: ranks meet in the store before a step's first collective, so that a
compile on one rank is waited for outside any collective.

Note [Step gate]

Background
    A rank that compiles while its peers do not (a shape only it has seen, a cold
    cache on one node, an evaluation graph) reaches the step's first collective late,
    and its peers wait for it inside the collective, which gives up after the process
    group's timeout (``train.timeout_s`` in the launcher; NCCL's watchdog kills the
    job). A compile can take longer than that and nothing is wrong. The compile
    barrier (Note [Compile barrier]) holds ranks that compile the *same* graph; a rank
    whose graphs were all compiled has nothing to wait at, and goes on into the
    collective. PyTorch's answers are opt-in and inside collectives: guard
    collectives make every rank recompile when one must, compiler collectives let
    ranks that compile together agree on shapes; a compile longer than the timeout
    on one rank still trips it.

Algorithm
    :meth:`StepGate.meet` is called by every rank of the group at the same point of
    each step: after everything that may compile, before the first collective (for
    DDP's reducer: after the forward, whose compile also compiles the backward; for a
    traced backward: after compiled autograd compiled it, before its graph runs). A
    rank adds one to the group's arrival counter in the store; the one whose add
    brings it to ``n * world`` (the last to reach step ``n``) sets the key
    ``open/<n>`` (and deletes ``open/<n-2>``, which every rank has passed); the others
    poll for that key (every 0.2 ms at first, backing off to every 50 ms; the store's
    blocking ``wait`` logs a warning each time it times out, and a wait must time out
    to read the peers' heartbeats). A few requests to the store per step when no rank
    compiles: an add, then a set (and a delete) by the last rank, a few polls by the others. The wait has no timeout of its own: it ends when the key is set,
    when a peer stops beating (:class:`compiler.liveness.PeerLost`: a dead or stopped
    peer fails every rank after the store's timeout, as a collective would have), or
    after a stop request (SIGTERM). A wait longer than ``progress_s`` says so.

    The counter works because no rank can pass gate ``n`` before every rank has
    arrived at it, so every add of step ``n + 1`` comes after the ``n * world``-th.
    It needs every rank to meet the gate once per synchronised step, which SPMD
    training does; forwards without a synchronised backward to follow (evaluation
    under ``no_grad``, ``no_sync`` micro-steps) do not meet it, so an evaluation on
    one rank only (nanoGPT's) passes freely, and the peers wait for it at the next
    step's gate instead of inside a collective.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Sequence

from .liveness import Heartbeat, PeerWatch, on_default_store

log = logging.getLogger(__name__)

__all__ = ["StepGate", "gate_for_group"]

POLL_FIRST_S, POLL_MAX_S = 0.0002, 0.05  # how often a waiting rank looks for the open gate
_instances: dict[str, itertools.count] = {}


class StepGate:
    """Every rank of a group meets here once per synchronised step (Note [Step gate]).

    Args:
        store: a key-value store every rank of the group reaches (the default group's).
        rank: this process's global rank; ``ranks``: the group's global ranks.
        name: names the entry point in store keys (``ddp``); the keys' prefix also holds
            the group and a creation index, equal across ranks in SPMD code; ``prefix``
            replaces that prefix (ranks simulated in one process).
        progress_s: a wait longer than this is logged, and again every ``progress_s``.

    Attributes:
        steps: how often this rank met the gate; ``longest_s``: its longest wait.
    """

    def __init__(self, store: Any, rank: int, ranks: Sequence[int], *, name: str = "ddp",
                 prefix: str | None = None, progress_s: float = 30.0) -> None:
        self.store, self.rank, self.ranks = store, rank, list(ranks)
        self.peers = [r for r in self.ranks if r != rank]
        tag = "-".join(map(str, self.ranks)) if len(self.ranks) <= 8 else f"{ranks[0]}-{ranks[-1]}x{len(ranks)}"
        instance = next(_instances.setdefault(f"{name}/{tag}", itertools.count()))
        self.prefix = prefix or f"distcompile/gate/{name}/{tag}/{instance}"
        self.progress_s = progress_s
        self.steps, self.longest_s = 0, 0.0
        Heartbeat.start(store, rank, self)  # a peer waiting here learns that this rank is alive
        self.watch = PeerWatch(store, rank)

    def meet(self) -> None:
        """Return once every rank of the group has met the gate as often as this one."""
        self.steps += 1
        n, world = self.steps, len(self.ranks)
        if self.store.add(f"{self.prefix}/arrived", 1) >= n * world:  # the last to arrive opens the gate
            self.store.set(f"{self.prefix}/open/{n}", b"1")
            if n > 2:
                self.store.delete_key(f"{self.prefix}/open/{n - 2}")
            return
        self._wait(n)

    def others_waiting(self) -> bool:
        """True when every other rank has arrived at this rank's next gate: they passed the step
        this rank is in without compiling what it compiles now."""
        return self.store.add(f"{self.prefix}/arrived", 0) >= (self.steps + 1) * len(self.ranks) - 1

    def _wait(self, n: int) -> None:
        key, start = f"{self.prefix}/open/{n}", time.perf_counter()
        said, poll = start, POLL_FIRST_S
        while not self.store.check([key]):
            time.sleep(poll)
            poll = min(poll * 1.5, POLL_MAX_S)
            self.watch.check(self.peers, f"its peers at step {n}'s gate (Note [Step gate])")
            now = time.perf_counter()
            if now - said >= self.progress_s:
                said = now
                log.info("rank %d has waited %.0fs at step %d's gate for a peer still in its step (compiling, or "
                         "evaluating alone); it waits as long as the peer is alive", self.rank, now - start, n)
        waited = time.perf_counter() - start
        self.longest_s = max(self.longest_s, waited)
        if waited >= self.progress_s:
            log.info("rank %d passed step %d's gate after %.0fs", self.rank, n, waited)


def gate_for_group(ranks: Sequence[int] | None, **kw: Any) -> StepGate | None:
    """A :class:`StepGate` over ``ranks`` (None: the default group) on the default store, or
    None without an initialised process group of more than one rank."""
    found = on_default_store(ranks)
    return StepGate(*found, **kw) if found is not None else None
