"""Low-rank gradient compression (``compile_ddp(compression="powersgd:4")``): PowerSGD
through DDP's reducer, kept across realignment.

Note [PowerSGD compression]

Background
    PowerSGD (Vogels et al., 2019) sends each gradient matrix ``M`` (n x m) as two rank-r
    factors: ``P = M Q`` all-reduced and orthogonalised, ``Q = M^T P`` all-reduced, and
    ``M ~ P Q^T``, so ``(n + m) r`` numbers cross the link instead of ``n m``. Error feedback
    adds what the last step's approximation left out to the next gradient; the warm start
    begins the next step's power iteration from the last ``Q``. PyTorch ships it as DDP's
    ``powerSGD_hook`` with a ``PowerSGDState`` holding, per bucket index, the error and the
    P and Q memories; vectors and matrices too small to gain (``min_compression_rate``)
    are all-reduced as they are. The first ``start`` steps reduce uncompressed.

Algorithm
    - Reducer strategies (split, whole, regional): PyTorch's ``powerSGD_hook`` and its
      state, registered by ``compile_ddp`` and again when the reducer is re-created to
      realign the buckets (Note [Bucket realignment]), as the bf16 hook is.
    - PyTorch's hook issues a bucket's P and Q all-reduces from the callbacks of its earlier
      ones, on whichever thread completes them, while DDP's thread issues the next bucket's
      first all-reduce: with two buckets or more, the ranks can issue their collectives in
      different orders. On gloo this aborts the job ("Received data size doesn't match
      expected size") or hangs it, in the first compressed step: seen with eager DDP and
      PyTorch's hook on torch 2.13 and 2.15, 3 buckets. :func:`sequenced_powersgd_hook` runs each bucket's whole
      hook on one worker thread per state, bucket after bucket in DDP's launch order, so
      every rank issues the same collectives in the same order; backward goes on meanwhile.
      The last bucket's hook waits for the worker: right after it DDP issues collectives of
      its own (with ``find_unused_parameters``, the used-parameter map). Buckets on CUDA take
      PyTorch's hook as it is (not observed here: no GPU).
    - The state's memories are keyed by bucket index and mean something for one bucket
      layout only. When realignment re-creates the reducer, and again when the realigned
      buckets appear, :func:`forget_buckets` drops them: a layout change after compression
      began restarts the error feedback and the warm start instead of adding one bucket's
      error to another's gradients. With ``start`` past the steps that change the layout
      (DDP rebuilds after step 1; realignment after step 1 and its rebuild after step 2, one
      step later with ``static_graph``), there is nothing to drop.
    - Traced: the python reducer calls a hook per gradient; PowerSGD there keeps its memories
      per parameter and is traced into the compiled backward (Note [Traced PowerSGD]).
    - ``bucket_cap_mb="auto"``: the cost model's link probe (:func:`link_probe`) sends a
      bucket as PowerSGD does: one near-square matrix of the probe's bytes, its P and Q
      all-reduced one after the other with the matmuls and the orthogonalisation between,
      and the uncompressed remainder's all-reduce. The fit's latency is then a bucket's fixed
      cost (three round trips and the compute between), and its bandwidth nearly free: the
      plan makes few buckets, where a plan for fp32 bytes would make many.

Numerics
    PowerSGD is biased: each step's gradient is a rank-r approximation; error feedback
    makes the sum over steps unbiased. The seed (``random_seed=0``) and the order of the
    buckets decide the first Q, the same on every rank.
"""

from __future__ import annotations

import logging
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_START", "PowerSGD", "SequencedState", "forget_buckets", "link_probe", "parse_compression",
           "sequenced_powersgd_hook"]

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
    """PyTorch's ``PowerSGDState`` with the one worker thread :func:`sequenced_powersgd_hook` runs
    on, started at the first bucket on the CPU."""

    def __init__(self, process_group: dist.ProcessGroup, **settings: Any) -> None:
        super().__init__(process_group, **settings)
        self.worker: ThreadPoolExecutor | None = None


# No annotations: DDP's register_comm_hook compares a hook's annotations with real types.
def sequenced_powersgd_hook(state, bucket):
    """PyTorch's ``powerSGD_hook``, each CPU bucket's run whole on the state's worker thread in
    DDP's launch order (Note [PowerSGD compression]); a CUDA bucket, PyTorch's hook as it is.
    The last bucket's hook returns only when every bucket's is done: DDP's reducer issues
    collectives of its own right after it (the used-parameter map of find_unused_parameters)."""
    if bucket.buffer().device.type != "cpu":
        return powerSGD_hook(state, bucket)
    if state.worker is None:
        state.worker = ThreadPoolExecutor(1, thread_name_prefix="powersgd")
    done = torch.futures.Future()

    def run() -> None:
        try:
            done.set_result(powerSGD_hook(state, bucket).wait())
        except BaseException as e:  # DDP raises it where it waits for the bucket
            done.set_exception(e)

    job = state.worker.submit(run)
    if bucket.is_last():
        job.result()  # the worker runs in order: every earlier bucket's hook is done too
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
        p = matrix @ torch.ones(m, rank, dtype=tensor.dtype, device=tensor.device)
        dist.all_reduce(p, group=group)
        q = matrix.t() @ torch.linalg.qr(p).Q
        dist.all_reduce(q, group=group)

    return probe
