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
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

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
               pg_timeout_s: float | None = None) -> None:
    timeout = {"timeout": datetime.timedelta(seconds=pg_timeout_s)} if pg_timeout_s is not None else {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            **timeout)
    try:
        result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001 - shipped to the parent with its traceback
        payload = ("error", traceback.format_exc())
    finally:
        destroy_process_group()  # not with the last reference in a DDP reducer: it can hang
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(payload, f)
    # As the launcher ends (docs/reliability.md: "Why the job ends with os._exit"): the result is written, and the
    # interpreter's exit would run C++ destructors of compiled and distributed state. Once in a full
    # suite on torch 2.15 one of them aborted a rank ("terminate called without an active exception").
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable, *args: Any, world_size: int = 2, timeout: float = 300.0,
              pg_timeout_s: float | None = None, port: int | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks
    (``pg_timeout_s``: the process group's collective timeout; default torch's; ``port``: the
    store's, for a store the test started, with ``TORCHELASTIC_USE_AGENT_STORE=True`` and MASTER_ADDR/MASTER_PORT naming it set).

    Returns each rank's return value; raises with a rank's traceback if one failed,
    or if the ranks did not finish within ``timeout`` seconds (a hang)."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _rank_main, args=(world_size, port or free_port(), fn, args, out_dir, pg_timeout_s),
            nprocs=world_size, join=False, start_method="spawn",
        )
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish in {timeout:.0f}s")
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
