"""The step gate: ranks meet in the store before a step's first collective, so that a
compile on one rank is waited for outside any collective.

Note [Step gate]

Background
    A rank that compiles while its peers do not (a shape only it saw, a cold cache, an
    evaluation graph) reaches the step's first collective late, and its peers give up
    inside it after the process group's timeout although nothing is wrong. The compile
    barrier (Note [Compile barrier]) only holds ranks compiling the *same* graph;
    PyTorch's guard and compiler collectives are opt-in and still trip on a compile
    longer than the timeout.

Algorithm
    :meth:`StepGate.meet` is called by every rank at the same point of each step: after
    everything that may compile, before the first collective. A rank adds one to the
    group's arrival counter in the store; the add that reaches ``n * world`` sets
    ``open/<n>`` (and deletes ``open/<n-2>``); the others poll for it with backoff (a
    blocking ``wait`` would warn on each timeout, and a wait must time out to read the
    heartbeats). The wait ends when the key is set, when a peer stops beating
    (:class:`compiler.ranks.liveness.PeerLost`), or on a stop request.

Notes
    - The counter works because no rank passes gate ``n`` before every rank arrived, so
      every add of step ``n + 1`` comes after the ``n * world``-th.
    - Forwards without a synchronised backward (evaluation, ``no_sync``) do not meet the
      gate, so an evaluation on one rank passes freely and its peers wait at the next
      gate instead of inside a collective.
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
