"""The two test tiers and the guard that keeps them apart (Note [Test tiers]).

Note [Test tiers]
~~~~~~~~~~~~~~~~~
``pytest -m "not slow"`` is the fast tier: a test starts no process and compiles nothing
with Inductor, so the tier runs in two xdist workers (``-n 2``) in a few minutes on two
cores. Everything else is marked ``slow`` and runs in one process: those tests start ranks
and torchrun jobs that use both cores, and some wait out timeouts. Two hooks keep the tiers so:

* at collection, a test that asks for a fixture that spawns processes
  (``SPAWNING_FIXTURES``) is marked ``slow`` by that alone;
* while an unmarked test (its fixtures' setup included) runs, starting a process
  (``subprocess``, ``multiprocessing``, ``os.fork``, ``os.system``, ``os.posix_spawn``)
  or compiling with Inductor (which starts the C++ compiler and its worker pool on a cold
  cache, and may not on a warm one: the guard does not depend on the cache) fails the
  test, naming what it started and how to fix it.

The guard records the first offence and fails the test after it ran, so a test that
catches the error still fails.
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


def mark_spawning_tests(items: list[pytest.Item]) -> None:
    """Mark ``slow`` every collected test that requests a spawning fixture."""
    for item in items:
        if SPAWNING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


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
