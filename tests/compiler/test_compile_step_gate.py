"""Note [Step gate], in one process: ranks as threads on one in-memory store. The gate holds a
rank until every rank has met it as often, a silent peer ends the wait naming it, and a
peer that passed the step is seen by a rank still compiling (the plan check's early end)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from compiler.ranks.liveness import PeerLost, WaitInterrupted, clear_stop, request_stop
from compiler.ranks.step_gate import StepGate


def _store(dead_after_s: float = 30.0):
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=dead_after_s))  # as the launcher sets it to train.timeout_s
    return store


def _gates(store, n=2):
    return [StepGate(store, rank, list(range(n)), prefix="t") for rank in range(n)]


def test_no_rank_passes_a_step_before_every_rank_reached_it():
    store = _store()
    gates, passed = _gates(store, 3), []

    def rank_loop(gate, delays):
        for step, delay in enumerate(delays, start=1):
            time.sleep(delay)
            gate.meet()
            passed.append((step, gate.rank, time.monotonic()))

    # rank 2 is 0.4 s late at step 2 (a compile of its own); the others must wait for it there
    threads = [threading.Thread(target=rank_loop, args=(g, d)) for g, d in
               zip(gates, [(0, 0, 0), (0, 0, 0), (0, 0.4, 0)])]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    assert [g.steps for g in gates] == [3, 3, 3]
    arrival_of_late_rank = min(t for step, rank, t in passed if (step, rank) == (2, 2))
    assert all(t >= arrival_of_late_rank - 0.05 for step, rank, t in passed if step >= 2)
    assert gates[0].longest_s >= 0.3 and gates[2].longest_s < 0.3
    prefix = gates[0].prefix
    assert not store.check([f"{prefix}/open/1"]) and store.check([f"{prefix}/open/3"])  # old steps deleted


def test_a_silent_peer_ends_the_wait_naming_it():
    store = _store(dead_after_s=1.0)
    gate = StepGate(store, 0, [0, 1], prefix="t")  # rank 1 never starts: no heartbeat, never arrives
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match=r"rank 0 waited for its peers at step 1's gate .* rank 1 has been silent"):
        gate.meet()
    assert time.monotonic() - t0 < 10


def test_a_stop_request_ends_the_wait(monkeypatch):
    import compiler.ranks.liveness as liveness

    monkeypatch.setattr(liveness, "STOP_GRACE_S", 0.0)
    store = _store()
    gate, peer = _gates(store)
    request_stop("SIGTERM (preemption)")
    try:
        with pytest.raises(WaitInterrupted, match=r"stopped waiting for its peers at step 1's gate .*SIGTERM"):
            gate.meet()
    finally:
        clear_stop()


def test_a_rank_compiling_alone_sees_that_its_peers_passed_the_step():
    store = _store()
    rank0, rank1 = _gates(store)
    waiting = threading.Thread(target=rank0.meet)
    assert not rank1.others_waiting()
    waiting.start()
    deadline = time.monotonic() + 10
    while not rank1.others_waiting() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rank1.others_waiting()  # rank 0 waits at step 1's gate: it passed step 1 without rank 1's graph
    rank1.meet()
    waiting.join(timeout=10)
    assert not rank1.others_waiting() and not waiting.is_alive()
