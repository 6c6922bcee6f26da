"""Fixtures shared by the test modules, one definition each, in the order tests climb
(STYLE.md principle 9): compiler state, then one gloo rank in this process, then
real gloo ranks in processes of their own, then the main job under torchrun.

The hooks keep the fast tier fast (Note [Test tiers] in ``_tiers.py``): a test that
spawns processes or compiles with Inductor is marked ``slow`` or fails.

The plain helpers they wrap stay in ``_dist.py`` and ``_torchrun.py`` (the forked
ranks and ``_cache_job.py`` import them too). No fixture here is autouse: a module
that wants one for all its tests says so with ``pytestmark = pytest.mark.usefixtures(...)``.
"""

from __future__ import annotations

import pytest
import torch

import _dist
import _tiers


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(config, items):
    _tiers.mark_spawning_tests(items)
    _tiers.mark_alone_tests(items)
    _tiers.longest_first(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):  # fixtures' setup too: a module fixture may start a reference job
    with _tiers.guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _tiers.guard(item):
        return (yield)


@pytest.fixture
def clean_dynamo():
    """No compiled code left over from another test: the test starts and ends with an
    empty dynamo cache."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """One intra-op thread, as torchrun sets (OMP_NUM_THREADS=1): on a busy 2-core
    machine, two threads made each tiny step ~50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def busy_machine():
    """Busy neighbour processes (three per core), kept until the 1-minute load average is
    over the cores (about half a minute from a quiet machine), then stopped after the test."""
    import os
    import subprocess
    import sys
    import time

    cores = len(os.sched_getaffinity(0))
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * cores)]
    try:
        deadline = time.monotonic() + 180
        while os.getloadavg()[0] <= cores + 0.5:
            assert time.monotonic() < deadline, f"the load average stayed at {os.getloadavg()[0]:.1f}"
            time.sleep(1)
        yield cores
    finally:
        for p in spin:
            p.kill()
            p.wait()


@pytest.fixture
def no_process_group_left(one_thread, clean_dynamo):
    """For tests that call ``launch.train.run`` in this process: one thread, a clean dynamo,
    and no process group left behind by the run."""
    yield
    assert not torch.distributed.is_initialized(), "run() must tear its process group down"


@pytest.fixture
def gloo():
    """A gloo group of world size 1 in this process for one test (in-memory store)."""
    with _dist.single_rank_group():
        yield


@pytest.fixture(scope="module")
def gloo_module():
    """The same one-rank group, kept for all tests of a module."""
    with _dist.single_rank_group():
        yield


@pytest.fixture(scope="session")
def run_ranks():
    """``run_ranks(fn, *args, world_size=2, timeout=...)``: real gloo ranks in forked
    processes; returns each rank's result (see ``_dist.run_ranks``)."""
    return _dist.run_ranks


@pytest.fixture(scope="session")
def torchrun():
    """``torchrun(cwd, *overrides, fault=None, restarts=0, timeout=300, nproc=2)``: the main
    job under torchrun with 2 ranks (see ``_torchrun.torchrun``; its readers ``ok``,
    ``metrics`` and ``final_params`` are plain functions imported from there)."""
    import _torchrun  # imports launch.train: only for the tests that launch

    return _torchrun.torchrun


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, torchrun):
    """The folder of one uninterrupted 2-rank run of the main job (``_jobs.REFERENCE_RUN``),
    run once per test session, also where xdist runs the session in two workers (the first to
    ask runs it in their shared base folder, under a lock the other waits on):
    ``run/metrics.json`` and ``checkpoints/step_00000{2,4,6,8}``. The yardstick of the resume
    tests; copy what a test changes."""
    import fcntl
    import os
    import shutil

    from _jobs import REFERENCE_RUN
    from _torchrun import ok

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's base folder; each worker's is inside it
    cwd = base / "reference_run"
    with open(base / "reference_run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (cwd / "done").exists():  # not run yet, or it failed in the other worker
            shutil.rmtree(cwd, ignore_errors=True)
            cwd.mkdir()
            ok(torchrun(cwd, *REFERENCE_RUN, "hydra.run.dir=run"))
            (cwd / "done").touch()
    return cwd


@pytest.fixture
def launch_cli(tmp_path, capfd, monkeypatch):
    """``launch_cli(*overrides) -> CliResult(code, out, err)``: what ``python -m launch.train
    OVERRIDES`` prints and exits with, run in this process (``launch.config.shell.run_cli``) from
    ``tmp_path`` with its Hydra run directory there. One subprocess smoke test
    (``test_launch_run.py``) keeps the real ``python -m`` path honest."""
    import _torchrun

    monkeypatch.chdir(tmp_path)
    # the run directory first: a test's own hydra.run.dir wins, and flags (--config-path) may come last
    return lambda *overrides: _torchrun.cli_in_process(capfd, [f"hydra.run.dir={tmp_path / 'run'}", *overrides])
