"""Where a benchmark rank runs (see Note [Benchmark device]): ``--device`` resolved,
this rank's GPU and process-group backend, clocks that wait for the GPU, and the
peak memory of a step.

Note [Benchmark device]
-----------------------
Background: the interleaved benchmarks (``ddp_compare``, ``fsdp_compare``) run the
same schedule on the CPU (gloo) or on CUDA. On CUDA, kernels run asynchronously:
a clock read right after a step times how fast the CPU queued the work, not the
work; and each process needs a GPU of its own for NCCL.

Algorithm:

1. ``resolve_device``: ``auto`` is ``cuda`` when ``torch.cuda.is_available()``,
   else ``cpu``; ``cuda`` without CUDA is refused before anything is launched.
2. ``place_rank`` (inside torchrun): on CUDA, rank ``LOCAL_RANK`` uses
   ``cuda:(LOCAL_RANK % device_count)``. ``choose_backend``: NCCL when every local
   rank has a GPU of its own (``LOCAL_WORLD_SIZE <= device_count``); otherwise
   gloo, the ranks sharing GPUs (NCCL refuses two ranks on one device). On the
   CPU: gloo. The two nodes of ``--net shaped`` are namespaces of one machine and
   see the same GPUs, which torchrun's local ranks do not know: the launcher sets
   ``MACHINE_RANKS_ENV`` (the ranks of both nodes) and ``NODE_OFFSET_ENV`` (this
   node's first rank among them) for each node (``machine_env``), and the index and
   the backend count the machine's ranks instead (else both nodes pick ``cuda:0``
   and NCCL, which refuses a duplicate GPU).
3. ``clock``: ``time.perf_counter()`` after ``torch.cuda.synchronize()`` on CUDA,
   so the time between two reads is the GPU's time for the work queued between.
4. ``reset_peak`` / ``peak_bytes``: ``torch.cuda.reset_peak_memory_stats`` and
   ``max_memory_allocated`` around one step; None on the CPU, which has no
   allocator counter per step.

Notes: the model is built on the CPU from the seed and then moved, and batches
come from a CPU generator and are then moved, so a CUDA run starts from the same
weights and sees the same batches as a CPU run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

__all__ = ["DEVICES", "resolve_device", "choose_backend", "Placement", "machine_env", "place_rank", "device_label",
           "clock", "reset_peak", "peak_bytes"]

DEVICES = ("auto", "cpu", "cuda")
MACHINE_RANKS_ENV = "DISTCOMPILE_BENCH_MACHINE_RANKS"  # the ranks of every node on this machine (--net shaped)
NODE_OFFSET_ENV = "DISTCOMPILE_BENCH_NODE_OFFSET"  # this node's first rank among them


def resolve_device(requested: str) -> str:
    """``cpu`` or ``cuda`` for ``--device auto|cpu|cuda``.

    Raises:
        ValueError: ``cuda`` was asked for and this machine has no usable CUDA device.
    """
    if requested not in DEVICES:
        raise ValueError(f"--device {requested!r} is not one of {', '.join(DEVICES)}; pass --device auto (the "
                         "default: cuda when available, else cpu).")
    if requested == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if requested == "auto":
        return "cpu"
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    raise ValueError(
        f"--device cuda was given, but torch.cuda.is_available() is False here (torch {torch.__version__}, {build}; "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): the benchmark cannot put its "
        "model on a GPU. Pass --device cpu (or leave --device at auto) to measure on the CPU over gloo, or run on a "
        "machine with a CUDA GPU and a CUDA build of torch."
    )


def choose_backend(local_ranks: int, devices: int, shared_by_nodes: bool = False) -> tuple[str, str]:
    """(process-group backend, why) for ``local_ranks`` ranks on ``devices`` GPUs of one
    machine; ``shared_by_nodes``: those ranks are the simulated nodes' of ``--net shaped``."""
    where = "this machine's simulated nodes" if shared_by_nodes else "this node"
    if local_ranks <= devices:
        return "nccl", f"each of the {local_ranks} rank(s) on {where} has a GPU of its own ({devices} visible)"
    fix = (f"A machine with {local_ranks} GPUs runs them over NCCL" if shared_by_nodes
           else f"Pass --nproc {devices} for NCCL")
    return "gloo", (f"{local_ranks} ranks share {devices} GPU(s) (rank r on cuda:r % {devices}) and NCCL refuses two "
                    "ranks on one device, so the collectives go over gloo (through host memory: compare modes within "
                    f"this run, not with an NCCL run). {fix}")


@dataclass(frozen=True)
class Placement:
    """This rank's device and the backend of the process group, with the reason for it."""

    device: torch.device
    backend: str
    why: str


def place_rank(device: str) -> Placement:
    """This torchrun rank's placement for a resolved ``device`` (``cpu`` or ``cuda``); on CUDA
    the rank's GPU is made the current device, before any process group or mesh exists."""
    if device == "cpu":
        return Placement(torch.device("cpu"), "gloo", "the ranks run on the CPU, where gloo carries the collectives")
    count = torch.cuda.device_count()
    shared = MACHINE_RANKS_ENV in os.environ
    ranks = int(os.environ.get(MACHINE_RANKS_ENV) or os.environ.get("LOCAL_WORLD_SIZE", "1"))
    index = (int(os.environ.get(NODE_OFFSET_ENV, "0")) + int(os.environ.get("LOCAL_RANK", "0"))) % count
    torch.cuda.set_device(index)
    backend, why = choose_backend(ranks, count, shared_by_nodes=shared)
    return Placement(torch.device("cuda", index), backend, why)


def machine_env(node: int, ranks_per_node: int, nodes: int = 2) -> dict[str, str]:
    """What ``place_rank`` reads in node ``node`` of ``nodes`` simulated on one machine."""
    return {MACHINE_RANKS_ENV: str(ranks_per_node * nodes), NODE_OFFSET_ENV: str(ranks_per_node * node)}


def device_label(device: torch.device) -> str:
    """``cuda: NVIDIA H200`` or ``cpu``: the row's ``device``."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return device.type


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def reset_peak(device: torch.device) -> None:
    """Start a new peak-memory window on ``device`` (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    """The most bytes allocated on ``device`` since ``reset_peak``; None on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None
