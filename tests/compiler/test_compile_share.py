"""Shared compile (Note [Shared compile]): the protocol on one in-memory store (the first rank to
reach a compile does it and the others load its artifacts; a damaged publication or a failed load
makes a rank compile for itself; the compile barrier), and its settings. Real 2-rank jobs:
tests/compiler/test_compile_share_ranks.py."""

import logging
import os
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from compiler.ranks.share import CompileShare, Pending
from test_compile_cache import artifact_payload

ARTIFACTS = artifact_payload("fartifacts")


class FakeBackend:
    """Records what it compiled; returns a callable that doubles its input."""

    def __init__(self, fail: bool = False) -> None:
        self.compiled: list[str] = []
        self.fail = fail

    def __call__(self, gm, example_inputs):
        if self.fail:
            raise RuntimeError("backend broke")
        self.compiled.append(gm.code)
        return lambda x: x * 2


def _gm(op: str) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace({"add": lambda x: x + 1, "mul": lambda x: x * 3}[op])


def _pair(store=None, **kw):
    store = store if store is not None else dist.HashStore()
    return [CompileShare(store, r, [0, 1], prefix="t", grace_s=5.0, timeout_s=5.0, **kw) for r in (0, 1)]


@pytest.fixture
def artifacts(monkeypatch):
    """torch.compiler's artifact save/load replaced: a payload naming the compiles so far."""
    loaded = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (ARTIFACTS, None))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda payload: loaded.append(payload))
    return loaded


def _header_key(share: CompileShare) -> str:
    return next(k for k in share._published if "/part" not in k)


def test_the_first_rank_to_reach_a_compile_compiles_it_and_the_others_load_it(artifacts):
    ranks, backends = _pair(), [FakeBackend(), FakeBackend()]
    fns = {0: [ranks[0].wrap_compile(backends[0])(_gm("add"), [torch.ones(2)])],
           1: [ranks[1].wrap_compile(backends[1])(_gm(op), [torch.ones(2)]) for op in ("add", "mul")]}
    fns[0].append(ranks[0].wrap_compile(backends[0])(_gm("mul"), [torch.ones(2)]))
    assert isinstance(fns[0][1], Pending) and isinstance(fns[1][0], Pending)  # claimed by the other rank
    assert not isinstance(fns[0][0], Pending) and not isinstance(fns[1][1], Pending)
    for r in (0, 1):
        ranks[r].resolve_pending()
        assert [float(f(torch.ones(1))) for f in fns[r]] == [2.0, 2.0]
        assert (ranks[r].stats.compiled, ranks[r].stats.loaded, ranks[r].stats.fell_back) == (1, 1, 0)
        assert len(backends[r].compiled) == 2  # the backend still runs (served from the loaded cache)
    assert artifacts == [ARTIFACTS, ARTIFACTS]


def test_the_same_graph_twice_is_two_compiles_and_graphs_one_rank_alone_compiles_make_nobody_wait(artifacts):
    ranks, backend = _pair(), FakeBackend()
    first, second = (ranks[0].wrap_compile(backend)(_gm("add"), [torch.ones(2)]) for _ in range(2))
    assert not isinstance(first, Pending) and not isinstance(second, Pending)  # both claimed by rank 0
    theirs = [ranks[1].wrap_compile(backend)(_gm("add"), [torch.ones(2)]) for _ in range(2)]
    assert all(isinstance(p, Pending) for p in theirs)  # rank 1 meets them in the same order: both load
    alone = ranks[1].wrap_compile(backend)(_gm("mul"), [torch.ones(2)])
    assert not isinstance(alone, Pending)  # nobody else has this graph: rank 1 compiles it, waiting for no one
    ranks[1].resolve_pending()
    assert (ranks[1].stats.compiled, ranks[1].stats.loaded, ranks[1].stats.warnings) == (1, 2, [])


def test_a_damaged_publication_and_a_failed_load_each_make_the_rank_compile(artifacts, monkeypatch, caplog):
    store = dist.HashStore()
    ranks, backend = _pair(store), FakeBackend()
    ranks[0].wrap_compile(backend)(_gm("add"), [torch.ones(2)])
    part = _header_key(ranks[0]) + "/part0"
    store.set(part, store.get(part)[:-1] + b"X")  # one flipped byte in the payload
    with caplog.at_level(logging.WARNING, "compiler.ranks.share"):
        ranks[1].wrap_compile(backend)(_gm("add"), [torch.ones(2)]).resolve()
    assert re.search(r"rank 0's compile artifacts for \w{12}#0 are damaged \(checksum mismatch\)", caplog.text)
    assert artifacts == [] and ranks[1].stats.fell_back == 1

    ranks = _pair()

    def broken(payload):
        raise ValueError("unpickling failed")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", broken)
    ranks[0].wrap_compile(backend)(_gm("add"), [torch.ones(2)])
    with caplog.at_level(logging.WARNING, "compiler.ranks.share"):
        ranks[1].wrap_compile(backend)(_gm("add"), [torch.ones(2)]).resolve()
    assert re.search(r"could not load rank 0's compile artifacts for \w{12}#0 \(ValueError: unpickling failed\)",
                     caplog.text)
    assert ranks[1].stats.fell_back == 1 and ranks[1].stats.compiled == 1


def test_an_owner_whose_compile_fails_does_not_leave_the_others_waiting(artifacts):
    ranks = _pair()
    with pytest.raises(RuntimeError, match="backend broke"):
        ranks[0].wrap_compile(FakeBackend(fail=True))(_gm("add"), [torch.ones(2)])
    pending = ranks[1].wrap_compile(FakeBackend(fail=True))(_gm("add"), [torch.ones(2)])
    fallen = []
    pending.failure_callbacks.append(lambda e: fallen.append(str(e)) or (lambda x: x))
    t0 = time.perf_counter()
    pending.resolve()
    assert fallen == ["backend broke"] and time.perf_counter() - t0 < 2  # no wait for a publication
    assert artifacts == []


class _GoneStore:
    """A store that breaks (as when the rank hosting it has exited) once ``gone`` is set."""

    def __init__(self):
        self.inner, self.gone = dist.HashStore(), False

    def __getattr__(self, name):
        if self.gone:
            raise dist.DistNetworkError("Broken pipe")
        return getattr(self.inner, name)


def test_a_compile_error_is_not_hidden_by_a_store_gone_with_a_failed_peer():
    # A peer failed (say with a plan mismatch) and exited, taking the store: this rank's own
    # compile error must reach the user, not the broken pipe of marking the graph done.
    store = _GoneStore()
    rank0 = CompileShare(store, 0, [0, 1], prefix="t", grace_s=5.0, timeout_s=5.0)

    def backend(gm, example_inputs):
        store.gone = True
        raise ValueError("ranks planned different buckets")

    with pytest.raises(ValueError, match="ranks planned different buckets"):
        rank0.wrap_graph(backend)(_gm("add"), [torch.ones(2)])


def _graphs_on_threads(ranks, plans):
    """Rank r runs ``wrap_graph`` over ``plans[r]``: (op, seconds its compile takes) pairs.
    Returns when each rank left its last barrier. The graphs are traced here, before the threads
    start: FX's symbolic tracing keeps process-wide state (its patcher, the "FX is tracing" flag),
    and two threads tracing at once, which a busy machine makes likely, break it for the process."""
    left = {}
    graphs = {r: [(_gm(op), delay) for op, delay in plan] for r, plan in plans.items()}

    def run(r):
        for gm, delay in graphs[r]:
            ranks[r].wrap_graph(lambda gm, inputs, delay=delay: time.sleep(delay) or gm)(gm, [torch.ones(2)])
        left[r] = time.perf_counter()

    threads = [threading.Thread(target=run, args=(r,)) for r in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return left


def test_the_threaded_ranks_trace_no_graph_on_their_threads(monkeypatch):
    # Two threads inside torch.fx.symbolic_trace at once break FX's tracing state for the whole process
    # (every later torch.compile then fails), so the ranks on threads only compile graphs traced before.
    traced_on = []
    trace = torch.fx.symbolic_trace

    def recording(*args, **kwargs):
        traced_on.append(threading.current_thread())
        return trace(*args, **kwargs)

    monkeypatch.setattr(torch.fx, "symbolic_trace", recording)
    _graphs_on_threads(_pair(share=False), {0: [("add", 0.0), ("mul", 0.0)], 1: [("add", 0.0), ("mul", 0.0)]})
    assert len(traced_on) == 4 and set(traced_on) == {threading.main_thread()}, traced_on


def test_the_barrier_holds_every_rank_until_the_slowest_has_compiled():
    ranks = _pair(share=False)
    left = _graphs_on_threads(ranks, {0: [("add", 0.0)], 1: [("add", 1.5)]})
    assert abs(left[0] - left[1]) < 0.5  # rank 0 left only when rank 1 was done
    assert ranks[0].stats.wait_s >= 1.0


def test_graphs_only_some_ranks_compile_do_not_hold_the_barrier():
    # The model zoo's mixture of experts: shapes depend on the data, so each rank compiles a graph the
    # other never does, then both compile a common one. Nobody waits for a graph its peer will not start.
    ranks = _pair(share=False)
    for r in ranks:
        r.barrier.grace_s = 30.0
    t0 = time.perf_counter()
    left = _graphs_on_threads(ranks, {0: [("add", 0.0), ("mul", 0.5)], 1: [("mul", 0.0)]})
    assert max(left.values()) - t0 < 10  # not the 30 s grace: a peer at another graph's barrier is not waited for
    assert ranks[0].barrier.on and ranks[1].barrier.on


def test_a_graph_no_peer_compiles_is_left_after_the_grace_with_an_info_line(caplog):
    # An idle peer is busy elsewhere (nanoGPT evaluates on rank 0 only before training): no fault, no warning.
    rank0 = _pair(share=False)[0]
    rank0.barrier.grace_s = 0.3
    with caplog.at_level(logging.INFO, "compiler"):
        for _ in range(2):
            rank0.wrap_graph(lambda gm, inputs: gm)(_gm("add"), [torch.ones(2)])
    lines = re.findall(r"rank\(s\) \[1\] did not start graph \w{12}#[01] within 0s of this rank .* not waiting "
                       r"for them: the next collective does", caplog.text)
    assert len(lines) == 2, caplog.text
    assert not rank0.stats.warnings and all(r.levelno == logging.INFO for r in caplog.records), caplog.text
    assert rank0.barrier.on and 0.5 < rank0.stats.wait_s < 5


def test_a_graph_the_predicate_refuses_holds_no_peer():
    # barrier_if=produces_gradients: an evaluation graph under no_grad on one rank neither waits nor is waited for.
    from compiler import produces_gradients

    rank0 = _pair(share=False)[0]
    rank0.barrier.grace_s = 30.0
    t0 = time.perf_counter()
    with torch.no_grad():
        rank0.wrap_graph(lambda gm, inputs: gm, barrier_if=produces_gradients)(_gm("add"), [torch.ones(2, requires_grad=True)])
    assert time.perf_counter() - t0 < 5 and rank0.stats.wait_s < 1
    assert not rank0.store.check([f"{rank0.prefix}/state/0"])  # never marked as compiling a shared graph


def _job(*overrides):
    """The launcher's JobConfig for ``overrides``, composed as ``python -m launch.train`` composes it."""
    from launch.config.compose import compose_job

    return compose_job(list(overrides))


def test_the_share_settings_reach_compile_ddp_and_a_bad_timeout_is_refused():
    from compiler import SettingError
    from ddp_opt import DDPCompileConfig
    from launch.runtime.parallel import ddp_compile_config

    assert ddp_compile_config(_job()).share is True  # on by default
    made = ddp_compile_config(_job("compile.share=false", "compile.share_timeout_s=60"))
    assert (made.share, made.share_timeout_s) == (False, 60.0)
    with pytest.raises(SettingError, match=r"share_timeout_s=0\): expected a positive number of seconds") as e:
        DDPCompileConfig(backend="aot_eager", share_timeout_s=0)
    assert e.value.setting == "share_timeout_s"


def test_the_launcher_words_a_bad_share_timeout_in_its_own_terms():
    from launch.config.schema import ConfigError
    from launch.checks.validate import validate

    with pytest.raises(ConfigError, match=r"compile.share_timeout_s=-1.0 is not valid: .* a positive number of "
                                          r"seconds\. .* compile.share_timeout_s=3600"):
        validate(_job("compile.share_timeout_s=-1"))


def test_fsdp_refuses_a_bad_share_timeout():
    from fsdp_opt import FSDPCompileConfig

    with pytest.raises(ValueError, match=r"CompileConfig\(share_timeout_s=0\): expected a positive number of seconds"):
        FSDPCompileConfig(backend="aot_eager", share_timeout_s=0)


def test_a_publication_over_the_stores_value_limit_goes_in_parts(monkeypatch):
    big = artifact_payload("fbig", content=os.urandom((9 << 20) + 5))  # TCPStore's server refuses a value over 8 MiB
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (big, None))
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    ranks = _pair(store)
    ranks[0].wrap_compile(FakeBackend())(_gm("add"), [torch.ones(2)])
    ranks[1].wrap_compile(FakeBackend())(_gm("add"), [torch.ones(2)]).resolve()
    assert loaded == [big] and ranks[1].stats.loaded == 1 and store.check([_header_key(ranks[0]) + "/part2"])


def test_the_launcher_says_who_compiled_and_what_it_cost():
    from launch.runtime.compile_stats import describe

    ranks = [{"compiled": 1, "loaded": 1, "cpu_since_compile_s": 30.0}, {"compiled": 1, "loaded": 1,
                                                                        "cpu_since_compile_s": 20.5}]
    assert describe(SimpleNamespace(share=True), ranks) == (
        "compile: the ranks shared the compiles (compile.share=true); compiled/loaded per rank: 1/1, 1/1; "
        "CPU for it, all ranks: 50.5s")
    # No line when nothing was shared: sharing off, or on with nothing loaded (aot_eager publishes nothing).
    assert describe(SimpleNamespace(share=False), ranks) is None
    alone = [{"compiled": 4, "loaded": 0}, {"compiled": 4, "loaded": 0}]
    assert describe(SimpleNamespace(share=True), alone) is None
