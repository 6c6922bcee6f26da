"""The plan exchange's failure paths, in one process against a stand-in store: a peer
that never publishes, a store that went away, and a mismatch that waits for every
rank to see it before raising (Note [Plan agreement] in ddp_opt/alignment/agreement.py)."""

import json
import logging

import pytest
import torch.distributed as dist

from ddp_opt.alignment import agreement
from ddp_opt.alignment.agreement import PlanMismatchError, peers_plans_if_ready, verify_plans

KEY = "ddp_opt/plan/0/1"
PLAN_A = [[16384, ["0.weight"]], [16384, ["1.weight"]]]
PLAN_B = [[32768, ["0.weight", "1.weight"]]]


class Store:
    """A key-value store as rank 0 of two sees it; ``wait`` raises ``wait_error``, or
    sets ``on_wait`` (a peer acting meanwhile) when it is given."""

    def __init__(self, wait_error=None, on_wait=None):
        self.data, self.wait_error, self.on_wait, self.waited = {}, wait_error, on_wait or {}, []

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def wait(self, keys, timeout):
        self.waited.append((list(keys), timeout.total_seconds()))
        if self.wait_error is not None:
            raise self.wait_error
        for k, v in self.on_wait.items():
            self.set(k, v)
        assert self.check(keys), f"a real store would wait forever for {keys}"


@pytest.fixture
def store(monkeypatch):
    """Install a stand-in store with two ranks, this one rank 0; returns a setter."""
    monkeypatch.setattr(agreement, "_members", lambda group: (0, ["g0-1/0", "g0-1/1"], [0, 1]))

    def install(s):
        monkeypatch.setattr(agreement, "default_store", lambda: s)
        return s

    return install


def test_a_peer_that_never_publishes_skips_the_check_with_a_warning(store, caplog):
    s = store(Store(wait_error=dist.DistStoreError("Socket Timeout")))
    s.set(f"{KEY}/g0-1/0", json.dumps(PLAN_A))
    with caplog.at_level(logging.WARNING, logger="ddp_opt.alignment.agreement"):
        assert verify_plans(KEY, timeout_s=5) is False
    assert f"Plan agreement check skipped for {KEY}: not every rank published its bucket plan within 5s" \
        in caplog.text
    assert "a recompile for a shape the other ranks did not see?" in caplog.text


def test_a_store_that_went_away_is_named_as_such(store, caplog):
    store(Store(wait_error=dist.DistNetworkError("Broken pipe")))
    with caplog.at_level(logging.WARNING, logger="ddp_opt.alignment.agreement"):
        assert verify_plans(KEY, timeout_s=5) is False
    assert "the process group's store could not be reached" in caplog.text
    assert "rank 0 unless torchrun started the job, exited?" in caplog.text and "Broken pipe" in caplog.text


def test_a_mismatch_waits_for_every_rank_to_see_it_before_raising(store, caplog):
    # Both plans are in: rank 0 finds the mismatch, marks it seen and waits for rank 1
    # to mark it too (the stand-in store's wait sets rank 1's mark), then raises.
    s = store(Store(on_wait={f"{KEY}/seen/g0-1/1": "1"}))
    s.set(f"{KEY}/g0-1/0", json.dumps(PLAN_A))
    s.set(f"{KEY}/g0-1/1", json.dumps(PLAN_B))
    with caplog.at_level(logging.WARNING, logger="ddp_opt.alignment.agreement"), \
            pytest.raises(PlanMismatchError, match=r"rank 0 planned 2 bucket\(s\), rank 1 planned 1"):
        peers_plans_if_ready(KEY, timeout_s=7)
    assert "(a PlanMismatchError follows); waiting up to 7s for every rank to compare the plans" in caplog.text
    assert s.get(f"{KEY}/seen/g0-1/0") == b"1"
    assert s.waited == [([f"{KEY}/seen/g0-1/0", f"{KEY}/seen/g0-1/1"], 7.0)]


def test_a_mismatch_is_raised_even_when_a_peer_never_sees_it(store):
    s = store(Store())
    s.set(f"{KEY}/g0-1/0", json.dumps(PLAN_A))
    s.set(f"{KEY}/g0-1/1", json.dumps(PLAN_B))
    s.wait_error = dist.DistStoreError("Socket Timeout")  # rank 1 never compares (it failed elsewhere)
    with pytest.raises(PlanMismatchError, match="check_plans=False"):
        peers_plans_if_ready(KEY, timeout_s=3)
    assert s.waited == [([f"{KEY}/seen/g0-1/0", f"{KEY}/seen/g0-1/1"], 3.0)]


def test_agreeing_plans_do_not_wait_for_anything_more(store):
    s = store(Store())
    s.set(f"{KEY}/g0-1/0", json.dumps(PLAN_A))
    s.set(f"{KEY}/g0-1/1", json.dumps(PLAN_A))
    assert peers_plans_if_ready(KEY) is True and verify_plans(KEY) is True
    assert not any("/seen/" in k for k in s.data)


# --- realignment: one decision for every rank -------------------------------------------------


@pytest.fixture
def two_ranks(monkeypatch):
    """``run(rank, caps, timeout_s, delay_s)``: agree_on_caps as that rank of two, on one real
    in-memory store; run each rank on its own thread."""
    import threading
    import time

    local, store = threading.local(), dist.HashStore()
    monkeypatch.setattr(agreement, "_members", lambda group: (local.rank, ["g0-1/0", "g0-1/1"], [0, 1]))
    monkeypatch.setattr(agreement, "default_store", lambda: store)
    results = {}

    def run(rank, caps, timeout_s=5.0, delay_s=0.0):
        local.rank = rank
        time.sleep(delay_s)
        results[rank] = agreement.agree_on_caps(caps, "ddp_opt/realign/0", timeout_s=timeout_s)

    def both(*calls):
        threads = [threading.Thread(target=run, args=args) for args in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results[0], results[1]

    return both


def test_ranks_with_the_same_caps_realign_together(two_ranks):
    assert two_ranks((0, (64, 128)), (1, (64, 128))) == ((True, ""), (True, ""))


def test_ranks_with_different_caps_all_keep_ddps_buckets_and_say_why(two_ranks):
    r0, r1 = two_ranks((0, (64, 128)), (1, (192,)))
    assert r0 == r1 and r0[0] is False
    assert r0[1] == "rank 0 proposed caps [64, 128] and rank 1 [192] (different plans)"


def test_a_rank_that_comes_after_the_others_gave_up_follows_their_decision(two_ranks):
    # Rank 1 arrives after rank 0 stopped waiting: both caps are then published and equal, but rank 1
    # must not realign alone (its all-reduces would pair with buckets of another size on rank 0).
    r0, r1 = two_ranks((0, (64, 128), 0.3), (1, (64, 128), 5.0, 1.5))
    assert r0 == r1 and r0[0] is False and "not every rank reached the realignment within 0s" in r0[1]


def test_a_wait_for_the_peers_plans_never_outlasts_the_stores_timeout(store):
    # The launcher's store times out after train.timeout_s: a dead peer ends the wait then, not after 120 s.
    from datetime import timedelta

    s = store(Store(wait_error=dist.DistStoreError("Socket Timeout")))
    s.timeout = timedelta(seconds=20)
    s.set(f"{KEY}/g0-1/0", json.dumps(PLAN_A))
    assert verify_plans(KEY, timeout_s=120) is False
    assert [seconds for _, seconds in s.waited] == [20.0]
    s.timeout = timedelta(seconds=600)
    verify_plans(KEY + "x", timeout_s=120)
    assert s.waited[-1][1] == 120.0
