"""Process-group helpers for the tests: a free port, a one-rank gloo group in the
test process, and a runner that spawns real gloo ranks and returns their results."""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from compiler._torch_internals import default_store
from launch.runtime.dist import destroy_process_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def single_rank_group(backend: str = "gloo"):
    """A real group of world size 1 in this process (gloo, or nccl on a GPU). Its store
    is in memory: no TCP rendezvous on a port another test may have just taken."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_process_group()  # not with the last reference in a DDP reducer: it can hang


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str,
               pg_timeout_s: float | None = None, environ: dict[str, str] | None = None) -> None:
    if environ is not None:  # the test's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(environ)
        tempfile.tempdir = None  # TMPDIR, read again
    timeout = {"timeout": datetime.timedelta(seconds=pg_timeout_s)} if pg_timeout_s is not None else {}
    try:
        _fail_init_once()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                **timeout)
    except dist.DistNetworkError:  # the group, not the test's function: run_ranks starts the ranks again
        with open(os.path.join(out_dir, f"rank{rank}.init-failed"), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
    try:
        result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001 - shipped to the parent with its traceback
        payload = ("error", traceback.format_exc())
    finally:
        _leave_together(rank, world_size)
        destroy_process_group()  # not with the last reference in a DDP reducer: it can hang
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(payload, f)
    # As the launcher ends (docs/reliability.md: "Why the job ends with os._exit"): the result is written, and the
    # interpreter's exit would run C++ destructors of compiled and distributed state. Once in a full
    # suite on torch 2.15 one of them aborted a rank ("terminate called without an active exception").
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


# Note [Ranks forked from a server that imported torch]
# Importing torch and dynamo takes 8 to 10 s on the 2-core CI host, and spawned ranks paid it on every
# run_ranks. The ranks are forked from multiprocessing's fork server instead, which imports them once per
# test session. A forked rank is otherwise as fresh as a spawned one: the server is a new interpreter that
# has run no test and initialised no process group and no CUDA (forking after ``import torch`` is what
# DataLoader workers do by default on Linux), and ``prepare`` gives each rank the test's sys.path and
# working directory as spawn does. The environment is the one thing the server would fix at its start, so
# each rank takes the test's environment from ``run_ranks``. The modules preloaded read no variable a test
# sets for its ranks at import (TORCHINDUCTOR_CACHE_DIR is read at each use). With CUDA the ranks are
# spawned, as before: a server that had asked CUDA for its devices could not fork ranks that use it.
# Measured: test_ddp_multirank.py and test_fsdp_multirank.py, 220 s spawned, 112 s forked.
# Rank 0 hosts the group's store (the tcp:// rendezvous on run_ranks' port). A rank 0 whose function needs no
# collective could finish and exit while its peer was still in init_process_group, reading that store: the peer's
# connection was reset ("Connection reset by peer" in ProcessGroupGloo). Measured, 2-rank starts in a loop whose
# function only reads its rank: 5 of 300 groups failed so, and one CI run failed when it struck twice in a row. So
# every rank writes that it is done into the store, and rank 0 waits for the others before it leaves
# (_leave_together): 0 of 300 after. Where a rank's init_process_group still fails on the network (a port taken
# between free_port and the store's bind, say), it writes rankN.init-failed and exits; run_ranks kills the others,
# which wait for it in init_process_group, and starts the ranks once more on another port. The test's function
# runs once in a group that formed; a second failure, or one on a store the test started, fails the test.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def _start_method() -> str:
    import torch

    if torch.cuda.is_available():
        return "spawn"
    from multiprocessing import forkserver

    if forkserver._forkserver._forkserver_pid is None:  # the first run_ranks of the session
        mp.set_forkserver_preload(_PRELOAD)
    return "forkserver"


def _leave_together(rank: int, world_size: int) -> None:
    """Rank 0 hosts the group's store (a ``tcp://`` rendezvous on run_ranks' port): it leaves only once every
    rank has said it is done with the store, or after a bound (a peer that died: the parent sees its exit code)
    (Note [Ranks forked from a server that imported torch])."""
    if not dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return  # the test's function ended the group, or the store is the test's own and outlives the ranks
    try:
        store = default_store()
        store.set(f"run_ranks/done/{rank}", b"1")
        if rank == 0:
            store.wait([f"run_ranks/done/{r}" for r in range(1, world_size)], datetime.timedelta(seconds=600))
    except Exception:  # noqa: BLE001 - a peer gone or the group broken by the test: nothing to wait for
        pass


def _fail_init_once() -> None:
    """For the test of the restart: the first group of a run_ranks fails as a reset connection did."""
    flag = os.environ.get("DISTCOMPILE_TEST_FAIL_INIT_ONCE")
    if flag and not os.path.exists(flag):
        open(flag, "w").close()
        raise dist.DistNetworkError("Connection reset by peer (DISTCOMPILE_TEST_FAIL_INIT_ONCE)")


class _GroupFailed(Exception):
    """A rank's init_process_group failed on the network, before the test's function ran."""


def _raise_if_group_failed(ctx: Any, out_dir: str, world_size: int) -> None:
    """Kill the ranks and raise _GroupFailed where one of them wrote ``rankN.init-failed``."""
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.init-failed")
        if os.path.exists(path):
            for p in ctx.processes:
                p.kill()
            with open(path) as f:
                raise _GroupFailed(f"rank {rank}:\n{f.read()}")


def run_ranks(fn: Callable, *args: Any, world_size: int = 2, timeout: float = 300.0,
              pg_timeout_s: float | None = None, port: int | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks in their own processes
    (Note [Ranks forked from a server that imported torch])
    (``pg_timeout_s``: the process group's collective timeout; default torch's; ``port``: the
    store's, for a store the test started, with ``TORCHELASTIC_USE_AGENT_STORE=True`` and MASTER_ADDR/MASTER_PORT naming it set).

    Returns each rank's return value; raises with a rank's traceback if one failed,
    or if the ranks did not finish within ``timeout`` seconds (a hang). Where a rank's
    init_process_group fails on the network (on a port run_ranks chose), the ranks are killed and
    started once more on another port (Note [Ranks forked from a server that imported torch])."""
    try:
        return _run_ranks_once(fn, args, world_size, timeout, pg_timeout_s, port)
    except _GroupFailed as failed:
        if port is not None:  # the test's own store holds the failed group's keys
            raise AssertionError(f"the ranks' process group failed to form:\n{failed}") from None
        try:
            return _run_ranks_once(fn, args, world_size, timeout, pg_timeout_s, None)
        except _GroupFailed as again:
            raise AssertionError(f"the ranks' process group failed to form twice:\n{again}") from None


def _run_ranks_once(fn: Callable, args: tuple, world_size: int, timeout: float, pg_timeout_s: float | None,
                    port: int | None) -> list[Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _rank_main, args=(world_size, port or free_port(), fn, args, out_dir, pg_timeout_s, dict(os.environ)),
            nprocs=world_size, join=False, start_method=_start_method(),
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):  # its peers wait in init_process_group for a rank that gave up
            _raise_if_group_failed(ctx, out_dir, world_size)
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish in {timeout:.0f}s")
        _raise_if_group_failed(ctx, out_dir, world_size)
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
