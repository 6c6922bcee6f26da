"""Note [Peer liveness]: a wait in the store for a peer ends when the peer dies or stops (no
heartbeat for the store's timeout) with one message naming it, or at once on a stop request,
instead of waiting share_timeout_s (two hours by default)."""

from __future__ import annotations

import gc
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from compiler.ranks.liveness import PeerLost, PeerWatch, WaitInterrupted, clear_stop, dead_after_s, request_stop
from compiler.ranks.barrier import key_label
from compiler.ranks.share import CompileShare, Pending, graph_digest

DEAD_AFTER_S = 2.0


def _store():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=DEAD_AFTER_S))  # as the launcher sets it to train.timeout_s
    return store


def _gm():
    return torch.fx.symbolic_trace(lambda x: x + 1)


def _share(store, rank):
    # share_timeout_s is long: only liveness can end these waits early.
    return CompileShare(store, rank, [0, 1], prefix="t", grace_s=60.0, timeout_s=600.0)


def test_the_silence_limit_is_the_stores_timeout():
    assert dead_after_s(_store()) == DEAD_AFTER_S


def test_the_barrier_stops_waiting_for_a_peer_that_died_while_compiling_and_names_it():
    store = _store()
    rank0, rank1 = _share(store, 0), _share(store, 1)
    base = rank1._key("g", "0" * 32)
    rank1.barrier.enter(base)  # rank 1 started compiling the graph ...
    del rank1  # ... and was killed: its CompileShare gone with its process, its heartbeat stops
    gc.collect()
    rank0._key("g", "0" * 32)  # rank 0 meets the same graph key
    with pytest.raises(PeerLost, match=r"rank 0 waited for rank\(s\) \[1\] to finish compiling graph 000000000000#0, "
                                       r"but rank 1 has been silent for \d+s \(no heartbeat in the store; it was "
                                       r"compiling\): it died or was stopped .*train.timeout_s"):
        rank0.barrier.meet(base, started=0.0)


def test_a_compile_claimed_by_a_peer_that_died_ends_the_job_instead_of_falling_back_to_eager():
    store = _store()
    rank0, rank1 = _share(store, 0), _share(store, 1)
    gm, inputs = _gm(), [torch.ones(2)]
    key = rank1._key("c", graph_digest(gm, inputs))
    store.add(f"{key}/claim", 1), store.set(f"{key}/owner", "1")  # rank 1 claimed the compile, then died
    del rank1
    gc.collect()
    pending = rank0.wrap_compile(lambda gm, inputs: gm)(gm, inputs)
    assert isinstance(pending, Pending)
    fallen = []
    pending.failure_callbacks.append(lambda e: fallen.append(e) or (lambda x: x))
    with pytest.raises(PeerLost, match=rf"waited for another rank to compile {key_label(key)}, but rank 1 has been silent"):
        pending.resolve()
    assert fallen == []


def test_a_live_peer_is_waited_for_beyond_the_silence_limit():
    store = _store()
    rank0, rank1 = _share(store, 0), _share(store, 1)
    base = rank1._key("g", "2" * 32)
    rank1.barrier.enter(base)
    rank0._key("g", "2" * 32)
    # rank 1 compiles for twice the silence limit, beating all along, then finishes
    timer = threading.Timer(2 * DEAD_AFTER_S, lambda: rank1.barrier.done(base))
    timer.start()
    rank0.barrier.meet(base, started=0.0)  # returns: no PeerLost
    timer.join()
    assert rank0.barrier.on


def test_a_stop_request_ends_a_wait_after_its_grace(monkeypatch):
    import compiler.ranks.liveness as liveness

    watch = PeerWatch(_store(), 0)
    request_stop("SIGTERM")
    try:
        watch.check([1], "a compile")  # within the grace: a short compile still finishes (and the step saves)
        monkeypatch.setattr(liveness, "STOP_GRACE_S", 0.0)
        with pytest.raises(WaitInterrupted, match=r"rank 0 stopped waiting for a compile: SIGTERM"):
            watch.check([1], "a compile")
    finally:
        clear_stop()
    watch.check([1], "a compile")  # cleared: nothing raised


# --- two real gloo ranks: a rank killed or stopped inside its first compile ------------------------


def _rank(rank: int, port: int, out_dir: str, fault: str) -> None:
    import os
    import pickle
    import signal
    import sys
    import time
    import traceback

    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_opt import compile_ddp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=DEAD_AFTER_S * 2))  # the store's timeout: the silence limit

    def backend(gm, example_inputs):
        if rank == 1:  # dies (or stops) in the middle of its first compile, after the barrier saw it start
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        return gm.forward

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    compiled = compile_ddp(model, backend=backend)  # share on (the default), share_timeout_s two hours
    t0 = time.monotonic()
    try:
        compiled(torch.randn(4, 8)).sum().backward()
        outcome = ("finished", "")
    except BaseException:  # noqa: BLE001 - what this rank saw, for the parent
        outcome = ("raised", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump((*outcome, time.monotonic() - t0), f)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
@pytest.mark.alone  # liveness (2 s of silence) must end the wait before the store's timeout (4 s)
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_rank_killed_or_stopped_in_its_first_compile_ends_the_survivor_within_the_group_timeout(tmp_path, fault):
    import os
    import pickle
    import time

    import torch.multiprocessing as mp

    import _dist

    ctx = mp.start_processes(_rank, args=(_dist.free_port(), str(tmp_path), fault), nprocs=2, join=False,
                             start_method="spawn")
    result = tmp_path / "rank0.pkl"
    deadline = time.monotonic() + 120  # the share timeout is 7200 s: only liveness ends rank 0's wait in time
    while not result.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in ctx.processes:  # rank 1 is dead, or stopped: end it
        if p.is_alive():
            os.kill(p.pid, 9)
        p.join()
    assert result.exists(), "rank 0 still waited for its dead or stopped peer after 120 s"
    status, text, seconds = pickle.loads(result.read_bytes())
    assert status == "raised" and "PeerLost" in text, text[-3000:]
    assert "but rank 1 has been silent for" in text and "it died or was stopped" in text, text[-3000:]


# --- the watchdog of a rank blocked in a collective: PeerMonitor -----------------------------------


def _monitor(store, silent, **kw):
    from compiler.ranks.liveness import PeerMonitor

    return PeerMonitor(store, 0, [0, 1], dead_after_s=DEAD_AFTER_S, check_s=0.1,
                       on_silent=lambda peer, s: silent.append((peer, s)), **kw)


def _beating(store, rank: int):
    """A peer's heartbeat in a thread, until the returned event is set."""
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            store.add(f"distcompile/alive/{rank}", 1)

    threading.Thread(target=beat, daemon=True).start()
    return stop


def test_the_monitor_names_a_peer_silent_for_the_limit_once():
    import time

    store, silent = _store(), []
    store.add("distcompile/alive/1", 1)  # rank 1 beat once, then stopped
    monitor = _monitor(store, silent).start()
    deadline = time.monotonic() + 30  # the call comes DEAD_AFTER_S after the last beat seen
    while not silent and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    monitor.stop()
    assert len(silent) == 1 and silent[0][0] == 1 and silent[0][1] >= DEAD_AFTER_S, silent


def test_the_monitor_never_names_a_peer_that_beats():
    import time

    store, silent = _store(), []
    stop = _beating(store, 1)
    monitor = _monitor(store, silent).start()
    time.sleep(2.5 * DEAD_AFTER_S)
    monitor.stop(), stop.set()
    assert silent == [] and monitor.find_lost(within_s=0.0) is None


def test_the_monitor_leaves_a_silent_peer_to_a_store_wait_that_watches_it():
    import time

    store, silent = _store(), []
    store.add("distcompile/alive/1", 1)
    monitor = _monitor(store, silent).start()
    watch = PeerWatch(store, 0)
    with pytest.raises(PeerLost, match=r"rank 0 waited for a compile, but rank 1 has been silent"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # a store wait, as the step gate's
            watch.check([1], "a compile")
            time.sleep(0.05)
    monitor.stop()
    assert silent == []  # the wait said it: the monitor did not
