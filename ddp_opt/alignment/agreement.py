"""Plan agreement across ranks: every rank must split its graph into the same
buckets, or their per-bucket all-reduces pair up wrongly and the job deadlocks.

Note [Plan agreement]

Background
    Each rank plans its buckets from its own captured graph. Ranks that capture
    different graphs (rank-dependent branches, other caps, another torch) would plan
    different buckets, and the first symptom would be a silent hang in backward.

Algorithm
    - After planning, each rank publishes a summary (bytes and parameter names per
      bucket) in the store under (optimizer index, compile index, rank)
      (:func:`publish_plan`), compiles, and before handing the graph back (so before
      any collective) compares every rank's summary (:func:`verify_plans`): a mismatch
      fails on every rank, naming the first differing bucket. Checking after the
      compile keeps the exchange from being a barrier in its middle.
    - A rank that finds a mismatch waits (bounded) until every rank has seen it before
      raising: the store's host would otherwise take the store with it and a peer
      would fail on a broken connection instead of this error.
    - Realignment (:func:`agree_on_caps`): a rank re-creating its reducer alone would
      pair all-reduces with buckets of another size and abort the backend. So every
      rank publishes its caps, the first to conclude writes one decision
      (``compare_set``), and every rank follows it.

Notes
    - The exchange uses the store, not a collective: a graph only one rank compiles
      makes the wait time out, and the check is skipped with a warning.
    - Keys follow creation and compile order, identical across SPMD ranks. Plans are
      compared within DDP's own process group; messages name global ranks.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from compiler.ranks import dead_after_s

from .._torch_internals import default_store
from ..planning.buckets import Bucket

log = logging.getLogger(__name__)

__all__ = [
    "PLAN_TIMEOUT_S", "PlanMismatchError", "agree_on_caps", "check_plan_agreement", "next_plan_namespace",
    "peers_plans_if_ready",
    "plan_summary", "publish_plan", "verify_plans",
]

_namespaces = itertools.count()

PLAN_TIMEOUT_S = 120.0  # how long a rank waits for its peers' plans, and for them to see a mismatch


class PlanMismatchError(RuntimeError):
    """Ranks planned different buckets for the same graph."""


def _bounded(timeout_s: float, store: Any) -> timedelta:
    """A wait for the peers' plans never outlasts the store's timeout (the launcher's
    train.timeout_s; Note [Peer liveness] in ``compiler.ranks.liveness``): a dead peer ends it then."""
    return timedelta(seconds=min(timeout_s, dead_after_s(store)))


def next_plan_namespace(kind: str = "plan") -> str:
    """A store namespace for one DDPOptimizer (``kind="plan"``) or one realignment
    (``"realign"``), equal across ranks in SPMD code."""
    return f"ddp_opt/{kind}/{next(_namespaces)}"


def plan_summary(buckets: list[Bucket]) -> list[list]:
    """What must agree across ranks: per bucket, its bytes and parameter names."""
    return [[b.size, list(b.params)] for b in buckets]


def _members(group: dist.ProcessGroup | None) -> tuple[int, list[str], list[int]] | None:
    """This rank's index in ``group`` (None: the default group) and the key suffix of every
    member; None without peers. Suffixes name the group by its global ranks, so that
    disjoint groups (DDP on one dimension of a mesh, pipeline stages with other graphs)
    share the default store without reading each other's plans."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if len(ranks) <= 1 or dist.get_rank() not in ranks:
        return None
    tag = "g" + "-".join(map(str, ranks)) if len(ranks) <= 8 else f"g{ranks[0]}-{ranks[-1]}x{len(ranks)}"
    return ranks.index(dist.get_rank()), [f"{tag}/{r}" for r in range(len(ranks))], ranks


class _Exchange:
    """One plan exchange: the store, every member's key under ``key``, this rank's index
    and the members' global ranks."""

    def __init__(self, key: str, index: int, suffixes: list[str], ranks: list[int]) -> None:
        self.key, self.index, self.suffixes, self.ranks = key, index, suffixes, ranks
        self.store = default_store()
        self.keys = [f"{key}/{suffix}" for suffix in suffixes]

    @classmethod
    def of(cls, key: str, group: dist.ProcessGroup | None) -> _Exchange | None:
        """None without peers (no process group, or one rank)."""
        found = _members(group)
        return cls(key, *found) if found is not None else None

    def compare(self, timeout_s: float) -> None:
        """Compare every published plan; on a mismatch, wait until every rank has seen it, then raise."""
        plans = [json.loads(self.store.get(k)) for k in self.keys]
        differs = next((r for r in range(1, len(plans)) if plans[r] != plans[0]), None)
        if differs is None:
            return
        self._wait_until_seen(timeout_s)
        raise PlanMismatchError(_describe_mismatch(plans[0], plans[differs], self.ranks[0], self.ranks[differs]))

    def _wait_until_seen(self, timeout_s: float) -> None:
        """Mark the mismatch seen by this rank and wait for every rank to see it (Note [Plan agreement])."""
        seen = [f"{self.key}/seen/{suffix}" for suffix in self.suffixes]
        try:
            self.store.set(seen[self.index], "1")
            if not self.store.check(seen):
                log.warning("Ranks planned different DDP buckets (a PlanMismatchError follows); waiting up to "
                            "%.0fs for every rank to compare the plans, so that all fail with the same error",
                            timeout_s)
                self.store.wait(seen, _bounded(timeout_s, self.store))
        except RuntimeError as e:  # a peer that never compares, or a store gone: raise anyway
            log.info("Not every rank saw the plan mismatch (%s); raising it here", e)


def publish_plan(buckets: list[Bucket], key: str, group: dist.ProcessGroup | None = None) -> bool:
    """Publish this rank's plan under ``key`` for the members of ``group`` (DDP's process
    group; None: the default group); False when there is nothing to agree with (no
    process group, or one rank)."""
    exchange = _Exchange.of(key, group)
    if exchange is None:
        return False
    exchange.store.set(exchange.keys[exchange.index], json.dumps(plan_summary(buckets)))
    return True


def peers_plans_if_ready(key: str, group: dist.ProcessGroup | None = None,
                         timeout_s: float = PLAN_TIMEOUT_S) -> bool:
    """Compare the published plans under ``key`` if every rank has published
    (no waiting); True when they were compared and agree.

    Raises:
        PlanMismatchError: when every rank has published and two plans differ (once
            every rank has seen the mismatch, or after ``timeout_s``).
    """
    exchange = _Exchange.of(key, group)
    if exchange is None or not exchange.store.check(exchange.keys):
        return False
    exchange.compare(timeout_s)
    return True


def verify_plans(key: str, timeout_s: float = PLAN_TIMEOUT_S, group: dist.ProcessGroup | None = None,
                 elsewhere: Callable[[], bool] | None = None) -> bool | None:
    """Wait for every rank's plan under ``key`` and compare them.

    Args:
        elsewhere: True once every peer has passed the step without this graph (they wait at
            the step gate, Note [Step gate]): the graph is this rank's alone, and the wait ends.

    Returns:
        True when all ranks agree; False when the check could not run (no process
        group, one rank, or a rank that did not publish within ``timeout_s``); None
        when the peers passed the step without the graph: this rank's plan is
        withdrawn from the store, and its caller must not count the exchange, so that
        the next one pairs with the peers' next graph.

    Raises:
        PlanMismatchError: on every rank, when any two ranks' plans differ.
    """
    exchange = _Exchange.of(key, group)
    if exchange is None:
        return False
    if elsewhere is not None:
        found = _poll_plans(exchange, _bounded(timeout_s, exchange.store).total_seconds(), elsewhere)
        if found == "elsewhere":
            exchange.store.delete_key(exchange.keys[exchange.index])
            log.info("Plan agreement check skipped for %s: every peer passed this step without compiling this "
                     "graph (a recompile for a shape only this rank saw)", key)
            return None
        if found == "timeout":
            log.warning("Plan agreement check skipped for %s: not every rank published its bucket plan within "
                        "%.0fs (a graph compiled on this rank only?)", key, timeout_s)
            return False
    try:
        exchange.store.wait(exchange.keys, _bounded(timeout_s, exchange.store))
    except dist.DistNetworkError as e:
        log.warning(
            "Plan agreement check skipped for %s: the process group's store could not be reached (has the "
            "rank hosting it, rank 0 unless torchrun started the job, exited?). Error: %s", key, e,
        )
        return False
    except RuntimeError as e:
        log.warning(
            "Plan agreement check skipped for %s: not every rank published its bucket plan within %.0fs "
            "(a graph compiled on this rank only, such as a recompile for a shape the other ranks did not "
            "see?). Error: %s", key, timeout_s, e,
        )
        return False
    exchange.compare(timeout_s)
    return True


def _poll_plans(exchange: _Exchange, bound_s: float, elsewhere: Callable[[], bool]) -> str:
    """Poll for every plan for at most ``bound_s``: ``"published"``, ``"elsewhere"`` as soon as
    ``elsewhere()``, or ``"timeout"``."""
    deadline, poll = time.monotonic() + bound_s, 0.001
    while not exchange.store.check(exchange.keys):
        if elsewhere():
            return "elsewhere"
        if time.monotonic() >= deadline:
            return "timeout"
        time.sleep(poll)
        poll = min(poll * 1.5, 0.05)
    return "published"


def check_plan_agreement(buckets: list[Bucket], key: str, timeout_s: float = PLAN_TIMEOUT_S,
                         group: dist.ProcessGroup | None = None) -> bool:
    """Publish this rank's plan under ``key`` and compare it with every rank's
    (:func:`publish_plan` then :func:`verify_plans`).

    Returns:
        True when all ranks agree; False when the check could not run (no process
        group, one rank, or a rank that did not publish within ``timeout_s``).

    Raises:
        PlanMismatchError: on every rank, when any two ranks' plans differ.
    """
    return publish_plan(buckets, key, group) and verify_plans(key, timeout_s, group)


def agree_on_caps(caps: tuple[int, ...], key: str, group: dist.ProcessGroup | None = None,
                  timeout_s: float = PLAN_TIMEOUT_S) -> tuple[bool, str]:
    """Whether every rank of ``group`` re-creates DDP's reducer with ``caps`` now: one decision
    for all, taken through the store (see "Realignment" in Note [Plan agreement]).

    Returns:
        ``(True, "")`` when every rank proposed the same caps (or there are no peers), else
        ``(False, why)``; every rank gets the same answer.
    """
    exchange = _Exchange.of(key, group)
    if exchange is None:
        return True, ""
    mine = json.dumps(list(caps))
    exchange.store.set(exchange.keys[exchange.index], mine)
    try:
        exchange.store.wait(exchange.keys, _bounded(timeout_s, exchange.store))
        proposals = [exchange.store.get(k).decode() for k in exchange.keys]
        differs = next((r for r, p in enumerate(proposals) if p != proposals[0]), None)
        vote = "yes" if differs is None else (
            f"rank {exchange.ranks[0]} proposed caps {proposals[0]} and rank {exchange.ranks[differs]} "
            f"{proposals[differs]} (different plans)")
    except RuntimeError as e:  # a peer that never came (or a store gone): no realignment anywhere
        vote = f"not every rank reached the realignment within {timeout_s:.0f}s ({type(e).__name__})"
    try:
        decided = exchange.store.compare_set(f"{key}/decision", "", vote)
    except RuntimeError as e:
        return False, f"the decision could not be written to the store ({e})"
    decided = decided.decode() if isinstance(decided, bytes) else str(decided)
    return (True, "") if decided == "yes" else (False, decided)


def _describe_mismatch(plan0: list, plan_r: list, r0: int, r: int) -> str:
    def show(plan: list, i: int) -> str:
        if i >= len(plan):
            return "no such bucket"
        size, params = plan[i]
        listed = ", ".join(params[:4]) + (", ..." if len(params) > 4 else "")
        return f"{size} bytes, {len(params)} parameter(s) [{listed}]"

    first = next(i for i in range(max(len(plan0), len(plan_r))) if i >= min(len(plan0), len(plan_r)) or plan0[i] != plan_r[i])
    return (
        f"Ranks split the graph into different DDP buckets: rank {r0} planned {len(plan0)} bucket(s), rank {r} "
        f"planned {len(plan_r)}. First difference at bucket {first}: rank {r0} has {show(plan0, first)}; "
        f"rank {r} has {show(plan_r, first)}. Mismatched buckets pair up the wrong all-reduces and deadlock "
        "in backward. Make every rank build the same model with the same DDP bucket caps and the same "
        "code path (no rank-dependent branches in forward). To skip this check, pass check_plans=False "
        "to compile_ddp."
    )
