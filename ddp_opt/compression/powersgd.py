"""Low-rank gradient compression (``compile_ddp(compression="powersgd:4")``): PowerSGD
through DDP's reducer, kept across realignment.

Note [PowerSGD compression]

Background
    PowerSGD (Vogels et al., 2019) sends each gradient matrix ``M`` (n x m) as rank-r
    factors ``P = M Q`` and ``Q = M^T P``, each all-reduced, so ``(n + m) r`` numbers
    cross instead of ``n m``; error feedback adds what the last approximation left out to
    the next gradient. PyTorch ships it as DDP's ``powerSGD_hook`` with a
    ``PowerSGDState`` holding memories per bucket index; the first ``start`` steps reduce
    uncompressed.

Algorithm
    - Reducer strategies (split, whole, regional): :func:`powersgd_hook` with PyTorch's
      state, registered by ``compile_ddp`` and again when realignment re-creates the
      reducer. On the CPU it runs PyTorch's hook's arithmetic with the products in their
      fast form (Note [PowerSGD of a bucket]); CUDA buckets take PyTorch's hook as it is.
    - PyTorch's hook issues a bucket's P and Q all-reduces from callbacks on whichever
      thread completes the earlier ones, while DDP's thread issues the next bucket's:
      with two buckets or more the ranks can issue collectives in different orders,
      which on gloo aborts or hangs the first compressed step (docs/compression.md).
      So each CPU bucket's whole hook runs on one worker thread per state, in DDP's
      launch order; the last bucket waits for it, since DDP issues collectives of its
      own right after. :func:`sequenced_powersgd_hook` runs PyTorch's own hook that way
      (the benchmarks' eager peer, the tests' reference).
    - Memories mean something for one bucket layout only: :func:`forget_buckets` drops
      them when realignment changes the layout, restarting error feedback rather than
      adding one bucket's error to another's gradients.
    - Traced: memories per parameter, traced into the backward (Note [Traced PowerSGD]).
    - ``bucket_cap_mb="auto"``: :func:`link_probe` sends a bucket as PowerSGD does, so the
      fitted latency is a bucket's fixed cost and the plan makes few buckets.
    - Under a reducer strategy the hook's power iteration also runs on the rank's cores
      while backward still runs, so each bucket sent delays the rest of backward:
      :func:`measure_hook_compute` times it alone (no collective) over the probe's sizes,
      and the plan counts it against every later bucket (Note [Cost-model bucket plan]).
      On the CPU it shares backward's own cores, where more buckets measured slower than
      one (Note [Cost-model bucket plan]): there ``"auto"`` makes one bucket.
      The traced strategy compresses each gradient inside backward as it is produced, the
      same work however the buckets fall, so it plans without it.

Numerics
    PowerSGD is biased per step; error feedback makes the sum over steps unbiased. The
    seed and the bucket order decide the first Q, the same on every rank.
"""

from __future__ import annotations

import logging
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from ..planning.cost import DEFAULT_PROBE_SIZES, best_seconds, broadcast_floats, fit_link
from ..planning.solver import HookCompute
from .bucket_powersgd import compress_bucket
from .factors import power_iteration, project, project_back

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_START", "PowerSGD", "SequencedState", "forget_buckets", "link_probe", "measure_hook_compute",
           "parse_compression", "powersgd_hook", "sequenced_powersgd_hook"]

# Steps reduced uncompressed before PowerSGD starts: past the bucket rebuilds and realignment (at most 3 steps),
# and short of most warm-ups (PyTorch's advice: at least the warm-up, about 10% of training).
DEFAULT_START = 10
_SPEC = re.compile(r"powersgd:(\d+)(?::(\d+))?")


@dataclass(frozen=True)
class PowerSGD:
    """``compression="powersgd:RANK[:START]"``: rank-``rank`` PowerSGD from step ``start``."""

    rank: int
    start: int = DEFAULT_START

    def __str__(self) -> str:
        return f"powersgd:{self.rank}:{self.start}"

    def state(self, group: dist.ProcessGroup) -> SequencedState:
        """A fresh state for DDP's group: error feedback and warm start on, seed 0."""
        return SequencedState(group, matrix_approximation_rank=self.rank, start_powerSGD_iter=self.start,
                              use_error_feedback=True, warm_start=True, random_seed=0)


class SequencedState(PowerSGDState):
    """PyTorch's ``PowerSGDState`` with the one worker thread :func:`powersgd_hook` (and
    :func:`sequenced_powersgd_hook`) run on, started at the first bucket on the CPU."""

    def __init__(self, process_group: dist.ProcessGroup, **settings: Any) -> None:
        super().__init__(process_group, **settings)
        self.worker: ThreadPoolExecutor | None = None


# No annotations: DDP's register_comm_hook compares a hook's annotations with real types.
def powersgd_hook(state, bucket):
    """The hook ``compile_ddp(compression=...)`` registers under DDP's reducer: each CPU bucket
    through :func:`~ddp_opt.compression.bucket_powersgd.compress_bucket` (PyTorch's arithmetic,
    the fast products) on the state's worker thread in DDP's launch order; a CUDA bucket,
    PyTorch's ``powerSGD_hook`` as it is (Note [PowerSGD compression])."""
    if bucket.buffer().device.type != "cpu":
        return powerSGD_hook(state, bucket)
    return _on_worker(state, bucket, lambda: compress_bucket(state, bucket))


def sequenced_powersgd_hook(state, bucket):
    """PyTorch's ``powerSGD_hook``, each CPU bucket's run whole on the state's worker thread in
    DDP's launch order (Note [PowerSGD compression]); a CUDA bucket, PyTorch's hook as it is.
    The benchmarks' eager peer and the tests' reference: PyTorch's own arithmetic, ordered."""
    if bucket.buffer().device.type != "cpu":
        return powerSGD_hook(state, bucket)
    return _on_worker(state, bucket, lambda: powerSGD_hook(state, bucket).wait())


def _on_worker(state, bucket, run: Callable[[], torch.Tensor]) -> torch.futures.Future:
    """``run()`` (the bucket's whole hook) on the state's one worker thread, as a future. The last
    bucket's call returns only when every bucket's is done: DDP's reducer issues collectives of
    its own right after it (the used-parameter map of find_unused_parameters)."""
    if state.worker is None:
        state.worker = ThreadPoolExecutor(1, thread_name_prefix="powersgd")
    done = torch.futures.Future()

    def job() -> None:
        try:
            done.set_result(run())
        except BaseException as e:  # DDP raises it where it waits for the bucket
            done.set_exception(e)

    submitted = state.worker.submit(job)
    if bucket.is_last():
        submitted.result()  # the worker runs in order: every earlier bucket's hook is done too
    return done


def parse_compression(value: Any) -> PowerSGD | None:
    """``value`` (None, ``"none"``, ``"powersgd:R"``, ``"powersgd:R:S"`` or a :class:`PowerSGD`)
    as a :class:`PowerSGD`, or None for no compression; ValueError otherwise."""
    if value is None or isinstance(value, PowerSGD):
        spec = value
    elif isinstance(value, str) and value.strip().lower() == "none":
        spec = None
    else:
        match = _SPEC.fullmatch(value.strip().lower()) if isinstance(value, str) else None
        if match is None:
            raise ValueError(f"{value!r} names no compression: expected 'powersgd:RANK' or 'powersgd:RANK:START' "
                             "(e.g. 'powersgd:4', rank 4 from step 10).")
        spec = PowerSGD(int(match[1]), int(match[2]) if match[2] else DEFAULT_START)
    if spec is not None and spec.rank < 1:
        raise ValueError(f"{spec}: the rank is the number of columns of P and Q, at least 1. Pass e.g. "
                         "'powersgd:4'.")
    if spec is not None and spec.start < 2:
        raise ValueError(f"{spec}: the start must be at least 2: the error feedback and the warm start keep "
                         "memories per bucket, and DDP rebuilds its buckets after step 1. Pass e.g. "
                         f"'powersgd:{spec.rank}:10'.")
    return spec


def forget_buckets(state: Any) -> None:
    """Drop a PowerSGD state's per-bucket memories (the bucket layout changed); another state: nothing."""
    if not isinstance(state, PowerSGDState):
        return
    if state.error_dict or state.p_memory_dict:
        log.info("PowerSGD: DDP's buckets changed after compression began; the error feedback and the warm "
                 "start restart from zero (start PowerSGD later to keep them: compression='powersgd:R:START')")
    state.error_dict.clear()
    state.p_memory_dict.clear()
    state.q_memory_dict.clear()


def link_probe(spec: PowerSGD, group: dist.ProcessGroup) -> Callable[[torch.Tensor], None]:
    """The cost model's link probe under PowerSGD (Note [PowerSGD compression]): ``tensor``'s
    bytes sent as one bucket of one near-square gradient matrix, synchronously."""

    def probe(tensor: torch.Tensor) -> None:
        n = max(1, math.isqrt(tensor.numel()))
        m = max(1, tensor.numel() // n)
        matrix = tensor[: n * m].view(n, m)
        rank = min(n, m, spec.rank)
        dist.all_reduce(tensor[:1], group=group)  # the tensors PowerSGD leaves uncompressed
        p = project(matrix, torch.ones(m, rank, dtype=tensor.dtype, device=tensor.device))
        dist.all_reduce(p, group=group)
        q = project_back(matrix, torch.linalg.qr(p).Q)
        dist.all_reduce(q, group=group)

    return probe


def measure_hook_compute(spec: PowerSGD, device: torch.device | str = "cpu", *,
                         group: dist.ProcessGroup | None = None, sizes: Sequence[int] = DEFAULT_PROBE_SIZES,
                         reps: int = 3) -> HookCompute:
    """The power iteration's compute per bucket of n gradient bytes, fitted as ``fixed + n *
    per_byte`` over ``sizes`` (best of ``reps``, one near-square matrix per bucket, as
    :func:`link_probe`); rank 0's fit on every rank (Note [PowerSGD compression])."""
    device = torch.device(device)
    xs, ys = [], []
    for size in sizes:
        numel = max(1, size // 4)
        n = max(1, math.isqrt(numel))
        m = max(1, numel // n)
        matrix = torch.randn(n, m, device=device)
        error = torch.zeros_like(matrix)
        q = torch.randn(m, min(n, m, spec.rank), device=device)
        xs.append(size)
        ys.append(best_seconds(lambda: power_iteration(matrix, error, q), device, reps))
    fit = fit_link(xs, ys)
    fixed_s, per_byte = broadcast_floats([fit.alpha_s, 1.0 / fit.bandwidth], group)
    log.info("ddp_opt measured PowerSGD's power iteration: %.3f ms + %.3f ms/MiB per bucket (rank 0's fit of %s)",
             fixed_s * 1e3, per_byte * 2**20 * 1e3,
             ", ".join(f"{x // 1024} KiB {y * 1e3:.2f} ms" for x, y in zip(xs, ys)))
    return HookCompute(fixed_s, per_byte, shares_cores=device.type == "cpu")
