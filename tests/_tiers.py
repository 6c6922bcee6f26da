"""The test tiers, the guard that keeps them apart, and how the slow tier shares two workers
(Note [Test tiers]).

Note [Test tiers]
~~~~~~~~~~~~~~~~~
``pytest -m "not slow"`` is the fast tier: a test starts no process and compiles nothing
with Inductor, so the tier runs in two xdist workers (``-n 2``) in a few minutes on two
cores. Everything else is marked ``slow``: those tests start ranks and torchrun jobs, or
compile with Inductor. Two hooks keep the tiers so:

* at collection, a test that asks for a fixture that spawns processes
  (``SPAWNING_FIXTURES``) is marked ``slow`` by that alone;
* while an unmarked test (its fixtures' setup included) runs, starting a process
  (``subprocess``, ``multiprocessing``, ``os.fork``, ``os.system``, ``os.posix_spawn``)
  or compiling with Inductor (which starts the C++ compiler and its worker pool on a cold
  cache, and may not on a warm one: the guard does not depend on the cache) fails the
  test, naming what it started and how to fix it.

The guard records the first offence and fails the test after it ran, so a test that
catches the error still fails.

The slow tier runs in two steps. Most of its tests wait more than they compute (process
starts, rendezvous, barriers, timeouts: one process used about a third of two cores), so
``pytest -m "slow and not alone" -n 2 --dist loadfile --no-loadscope-reorder`` runs them in
two workers, and ``pytest -m alone`` then runs the rest one at a time. A test is ``alone``
where a second worker beside it would change what it checks: it loads the machine on
purpose (the ``busy_machine`` fixture, ``ALONE_FIXTURES``: marked at collection), it makes
network namespaces or a shaped link (one list of namespaces for the machine), or its
outcome depends on which of two wall-clock limits is reached first (a peer's silence
against the process group's timeout), which a loaded machine may reorder. ``alone``
implies ``slow``. In the two workers:

* each file's tests run in one worker (``--dist loadfile``), so a module fixture's job (the
  zoo's two ranks, the step gate's undisturbed run) runs once; ``reference_run``, the one session fixture that
  runs a job, runs once for both workers (a lock in their shared base folder);
* the collection puts the files of ``LONGEST_FIRST`` first, in that order (the longest
  files of the last measured run), and xdist hands the files out in collection order
  (``--no-loadscope-reorder``) to whichever worker is free: the long ones start first and
  the short ones fill in, so neither worker is left with a long tail. Refresh the list
  from ``--durations`` or a junit file when a file's time changes much.

(``--dist loadgroup`` would let a file's tests spread over both workers, but with pytest 9.2
and pytest-xdist 3.8 it ignores ``xdist_group`` marks: pytest-dev/pytest-xdist#1386.)

Tests in two workers must not share a port (``_dist.free_port``, ``torchrun --standalone``),
a fixed folder (``tmp_path``) or a timing; a new test that cannot keep to that is ``alone``.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
from typing import Iterator
from unittest import mock

import pytest

SPAWNING_FIXTURES = frozenset({"run_ranks", "torchrun"})
ALONE_FIXTURES = frozenset({"busy_machine"})
# The slow tier's longest files first: their sums of test times in its two workers, torch 2.15, 2026-11-28
# (zoo 204 s, step gate 162 s, ... 40 s); see the Note.
LONGEST_FIRST = (
    "test_ddp_zoo.py",
    "test_ddp_step_gate.py",
    "test_compile_cache_modes.py",
    "test_bench_optimizer_in_backward.py",
    "test_launch_reliability_runs.py",
    "test_in_backward_traced.py",
    "test_launch_optimizer_in_backward.py",
    "test_fsdp_traced_ranks.py",
    "test_compile_cache.py",
    "test_launch_torchrun.py",
    "test_launch_fsdp.py",
    "test_compile_share_ranks.py",
    "test_ddp_multirank.py",
    "test_launch_elastic.py",
    "test_ddp_traced.py",
    "test_bench_fsdp_compare.py",
    "test_framework_hf.py",
    "test_launch_ckpt_lock.py",
    "test_framework_lightning.py",
    "test_launch_reliability_ckpt.py",
    "test_ddp_checkpointed_attention.py",
    "test_bench_ddp_compare.py",
)


def mark_spawning_tests(items: list[pytest.Item]) -> None:
    """Mark ``slow`` every collected test that requests a spawning fixture."""
    for item in items:
        if SPAWNING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def mark_alone_tests(items: list[pytest.Item]) -> None:
    """Mark ``alone`` every test that requests an ``ALONE_FIXTURES`` fixture, and ``slow``
    every ``alone`` test."""
    for item in items:
        if ALONE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.alone)
        if item.get_closest_marker("alone") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: the files of ``LONGEST_FIRST`` first, in its order; the
    others after, as collected. Files are matched by name, whichever folder of tests/ holds
    them (no two share a name)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


class SpawnInFastTier(BaseException):
    """Raised where an unmarked test starts a process or an Inductor compile; a
    BaseException so that ``except Exception`` in the code under test lets it through."""


def _message(nodeid: str, what: str) -> str:
    return (
        f"{nodeid} started {what} but is not marked slow: the fast tier (pytest -m 'not slow') "
        "starts no process and compiles nothing with Inductor (Note [Test tiers] in tests/_tiers.py). Mark the "
        "test @pytest.mark.slow, or use the 'run_ranks'/'torchrun' fixture, or test the same "
        "logic in process (aot_eager instead of inductor)."
    )


def _refuser(nodeid: str, what: str, offences: list[str]):
    def refuse(*args, **kwargs):
        offences.append(what)
        raise SpawnInFastTier(_message(nodeid, what))

    return refuse


def _inductor_entry():
    # torch._inductor.compile_fx.compile_fx: the function torch.compile's Inductor wrapper
    # and dynamo's "inductor" backend import at call time (torch/__init__.py,
    # torch/_dynamo/backends/inductor.py), so patching the module attribute reaches both.
    import torch._inductor.compile_fx as compile_fx_module

    return compile_fx_module


@contextlib.contextmanager
def no_spawn(item: pytest.Item) -> Iterator[None]:
    """Fail ``item`` if it starts a process or compiles with Inductor (see the Note)."""
    offences: list[str] = []
    targets = [
        (subprocess.Popen, "_execute_child", "a subprocess"),
        (multiprocessing.process.BaseProcess, "start", "a multiprocessing process"),
        (os, "fork", "os.fork"),
        (os, "system", "os.system"),
        (os, "posix_spawn", "os.posix_spawn"),
        (os, "posix_spawnp", "os.posix_spawnp"),
        (_inductor_entry(), "compile_fx", "an Inductor compile"),
    ]
    with contextlib.ExitStack() as stack:
        for owner, name, what in targets:
            if hasattr(owner, name):
                stack.enter_context(mock.patch.object(owner, name, _refuser(item.nodeid, what, offences)))
        yield
    if offences:  # the code under test caught the refusal: fail all the same
        pytest.fail(_message(item.nodeid, offences[0]), pytrace=False)


def guard(item: pytest.Item) -> contextlib.AbstractContextManager:
    """:func:`no_spawn` for a test of the fast tier; nothing for one marked slow."""
    return contextlib.nullcontext() if item.get_closest_marker("slow") else no_spawn(item)
