"""Process-group setup and teardown, rank-0 printing and a reliable exit.

One helper pair, :func:`setup_distributed` / :func:`teardown_distributed`
(or the :func:`process_group` context manager holding both), serves every way the
job is started:

- ``torchrun`` (one machine or many): ``env://`` rendezvous from the variables
  torchrun sets;
- ``python -m launch.train``: a one-rank group on an in-memory store, so that the
  code path (DDP, barriers, DCP) is the same as with many ranks;
- Slurm through Hydra's submitit launcher: ``SLURM_*`` variables are exported as
  torch's, with ``submitit``'s own helper.

CUDA + NCCL when GPUs are visible, CPU + gloo otherwise.

Note [Reliable exit]
    Compiled runs on gloo have been seen to hang at interpreter exit, inside the
    process group's destructor (and the compile workers' atexit hooks). So the
    job tears down explicitly (barrier on success, then ``destroy_process_group``
    in a ``finally``) and :func:`exit_now` ends the process with ``os._exit``
    once stdout, stderr and logging are flushed: after teardown nothing is left
    that an interpreter shutdown could usefully do.

Note [Exit on error]
    When one rank raises (say it cannot write ``train.checkpoint_dir``) while its
    peer waits in a collective, the dropped traceback releases the last reference
    to the DDP module; the reducer's destructor then waits for the process group's
    mutex while holding the GIL, and a gloo thread waits for the GIL: a deadlock no
    timeout of ours reaches. So on the entry point's path
    (``launch.train.run(..., exit_on_error=True)``) an error is printed, the streams
    flushed and the process ended with :func:`exit_now` right in the ``except``,
    while the traceback still holds the model: no destructor of DDP, the reducer or
    the process group runs. The peers see the socket close and leave the same way,
    and torchrun stops those still alive. A stop every rank agreed on (preemption, a
    non-finite loss) leaves the same way with its own exit code. ``run()`` called
    from Python (tests, notebooks) raises.

Note [Process-group teardown]
    The reducer's Python binding holds the GIL while it destroys what it owns. If it
    held the process group's last reference after ``destroy_process_group``, the
    group would die with it, joining gloo threads that may still need the GIL to
    release the last collective's tensors: a hang. The process group's own Python
    object releases the GIL while it is destroyed (pytorch/pytorch#154976). So
    :func:`destroy_process_group` keeps that object after destroying the group,
    until the next :func:`setup_distributed` (or the process ends), and the reducer
    never holds the last reference (measured: docs/reliability.md).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from ..config.schema import ParallelConfig
from .agent import die_with_agent
from .worker_error import write_error_file

log = logging.getLogger(__name__)

__all__ = [
    "DistEnv",
    "world_size_from_env",
    "restarted_by_torchrun",
    "setup_distributed",
    "choose_backend",
    "local_world_size",
    "teardown_distributed",
    "destroy_process_group",
    "process_group",
    "print0",
    "configure_logging",
    "exit_now",
]

# Loggers whose INFO lines rank 0 shows: compile progress and the bucket plan.
PROGRESS_LOGGERS = ("compiler", "ddp_opt", "fsdp_opt", "launch")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _export_slurm_env() -> None:
    """Under srun without torchrun (Hydra's submitit launcher), export RANK & co."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    try:
        from submitit.helpers import TorchDistributedEnvironment
    except ImportError:
        return
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def world_size_from_env() -> int:
    """How many ranks this job has, read before any process group exists."""
    _export_slurm_env()
    return int(os.environ.get("WORLD_SIZE", "1"))


def restarted_by_torchrun() -> bool:
    """torchrun sets TORCHELASTIC_RESTART_COUNT; > 0 means a worker failed and the job restarted."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def local_world_size() -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)


def choose_backend(requested: str, local_rank: int, local_world: int, gpus: int) -> tuple[str, torch.device]:
    """The process-group backend and this rank's device.

    ``auto``: no GPU, gloo on the CPU; a GPU per rank of this node, NCCL with rank
    ``i`` on GPU ``i``; fewer GPUs than ranks, gloo with the ranks sharing the GPUs
    round-robin (NCCL refuses two ranks on one device; gloo all-reduces CUDA
    tensors, slower), said once by local rank 0. ``nccl``: GPU ``local_rank``
    (``launch.checks.rules`` refused it up front when GPUs are too few). ``gloo``: the CPU.
    """
    if requested == "auto" and gpus > 0:
        if local_world <= gpus:
            return "nccl", torch.device("cuda", local_rank)
        if local_rank == 0:
            log.warning("%d ranks on this node share %d GPU(s): NCCL refuses two ranks on one device, so the job "
                        "uses gloo on the GPUs (slower collectives). Launch --nproc-per-node %d for NCCL.",
                        local_world, gpus, gpus)
        return "gloo", torch.device("cuda", local_rank % gpus)
    if requested == "nccl":
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def setup_distributed(cfg: ParallelConfig, timeout_s: float) -> DistEnv:
    """Start the process group; every collective then times out after ``timeout_s``. Under
    torchrun, this worker also ends when its agent dies (Note [Workers die with their agent])."""
    die_with_agent()
    _RETIRED.clear()  # the last group's object, kept by destroy_process_group (Note [Process-group teardown])
    _export_slurm_env()
    rank, world = _rank_from_env(), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend, device = choose_backend(cfg.dist_backend, local_rank, local_world_size(), torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ:
        store = _store_for_this_attempt(world, timeout)
        dist.init_process_group(backend, timeout=timeout, rank=rank, world_size=world, store=store)
    else:  # plain `python -m launch.train`: one rank, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    log.debug("process group up: rank %d/%d on %s (%s)", rank, world, device, backend)
    return DistEnv(rank, world, local_rank, backend, device)


def _store_for_this_attempt(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The rendezvous store, with a key prefix of its own for each torchrun restart.

    By default torchrun's workers share the agent's TCPStore, which outlives a
    restart; the process group's keys carry no attempt in their name, so after
    ``--max-restarts`` kicks in a rank can read the address a dead rank of the
    previous attempt published and fail to connect, or hang (pytorch/pytorch#135712).
    On one machine, where every worker sees the same TORCHELASTIC_RESTART_COUNT,
    prefixing the keys with it keeps attempts apart. On several machines restart
    counts can differ between nodes; there, export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    before torchrun (a fresh store per attempt) and this returns None (env://).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if int(os.environ.get("LOCAL_WORLD_SIZE", "-1")) != world_size:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"distcompile/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def teardown_distributed(ok: bool = True) -> None:
    """Tear the process group down. On success, wait for every rank first, so that
    no rank leaves while another still talks to it; after a failure, do not wait
    (the peer may be gone)."""
    if not dist.is_initialized():
        return
    try:
        if ok:
            dist.barrier()
    finally:
        destroy_process_group()


_RETIRED: list = []  # the last destroyed default group's object (Note [Process-group teardown])


def destroy_process_group() -> None:
    """``dist.destroy_process_group()``, keeping the default group's Python object alive
    until the next :func:`setup_distributed` or a later call here, so that no DDP reducer
    holds its last reference (Note [Process-group teardown])."""
    group = dist.group.WORLD
    dist.destroy_process_group()
    _RETIRED[:] = [group]


@contextmanager
def process_group(cfg: ParallelConfig, timeout_s: float) -> Iterator[DistEnv]:
    env = setup_distributed(cfg, timeout_s)
    ok = False
    try:
        yield env
        ok = True
    finally:
        teardown_distributed(ok)


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only, flushed at once (torchrun interleaves ranks' output)."""
    rank = dist.get_rank() if dist.is_initialized() else _rank_from_env()
    if rank == 0:
        print(*args, **kwargs, flush=True)


def configure_logging(rank: int) -> None:
    """Rank 0 shows INFO from the toolkit (compile progress, bucket plan); other
    ranks only warnings. torch's own loggers keep their defaults (quiet)."""
    level = logging.INFO if rank == 0 else logging.WARNING
    for name in PROGRESS_LOGGERS:
        logging.getLogger(name).setLevel(level)
    root = logging.getLogger()
    if not root.handlers:  # run() called outside Hydra (tests, notebooks)
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(handler)


def exit_now(code: int) -> None:
    """Flush everything and end the process; see Note [Reliable exit]. A torchrun worker ending
    with a non-zero code first leaves its last lines in its error file (Note [A failed rank's last
    line] in ``launch.runtime.worker_error``)."""
    write_error_file(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
