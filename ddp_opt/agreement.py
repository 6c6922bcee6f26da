"""Plan agreement across ranks: every rank must split its graph into the same
buckets, or their per-bucket all-reduces pair up wrongly and the job deadlocks.

Note [Plan agreement]

Background
    Each rank plans its buckets alone, from its own captured graph. Ranks that
    capture different graphs (rank-dependent Python branches, other caps, another
    torch version) would plan different buckets, and the first symptom would be
    a hang in backward with no message.

Algorithm
    Right after planning, each rank publishes a short summary of its plan (bytes
    and parameter names per bucket) in the process group's key-value store under
    a key made of the optimizer's creation index, the compile index and its rank,
    then reads every rank's summary. All ranks compare the same summaries, so a
    mismatch fails on every rank at once, with the first differing bucket named.

Notes
    - The exchange goes through the store, not a collective: if one rank compiles
      a graph the others do not (a recompile for a shape only it saw), waiting
      for the others times out, the check is skipped with a warning and training
      goes on, rather than the check itself hanging.
    - Keys are derived from creation and compile order, which SPMD programs keep
      identical across ranks.
"""

from __future__ import annotations

import itertools
import json
import logging
from datetime import timedelta

import torch.distributed as dist

from .plan import Bucket

log = logging.getLogger(__name__)

__all__ = ["PlanMismatchError", "check_plan_agreement", "next_plan_namespace", "plan_summary"]

_namespaces = itertools.count()


class PlanMismatchError(RuntimeError):
    """Ranks planned different buckets for the same graph."""


def next_plan_namespace() -> str:
    """A store namespace for one DDPOptimizer, equal across ranks in SPMD code."""
    return f"ddp_opt/plan/{next(_namespaces)}"


def plan_summary(buckets: list[Bucket]) -> list[list]:
    """What must agree across ranks: per bucket, its bytes and parameter names."""
    return [[b.size, list(b.params)] for b in buckets]


def check_plan_agreement(buckets: list[Bucket], key: str, timeout_s: float = 120.0) -> bool:
    """Publish this rank's plan under ``key`` and compare it with every rank's.

    Returns:
        True when all ranks agree; False when the check could not run (no process
        group, one rank, or a rank that did not publish within ``timeout_s``).

    Raises:
        PlanMismatchError: on every rank, when any two ranks' plans differ.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{rank}", json.dumps(plan_summary(buckets)))
    keys = [f"{key}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError) as e:
        log.warning(
            "Plan agreement check skipped for %s: not every rank published its bucket plan within %.0fs "
            "(a graph compiled on this rank only, such as a recompile for a shape the other ranks did not "
            "see?). Error: %s", key, timeout_s, e,
        )
        return False
    plans = [json.loads(store.get(k)) for k in keys]
    for r in range(1, world):
        if plans[r] != plans[0]:
            raise PlanMismatchError(_describe_mismatch(plans[0], plans[r], r))
    return True


def _describe_mismatch(plan0: list, plan_r: list, r: int) -> str:
    def show(plan: list, i: int) -> str:
        if i >= len(plan):
            return "no such bucket"
        size, params = plan[i]
        listed = ", ".join(params[:4]) + (", ..." if len(params) > 4 else "")
        return f"{size} bytes, {len(params)} parameter(s) [{listed}]"

    first = next(i for i in range(max(len(plan0), len(plan_r))) if i >= min(len(plan0), len(plan_r)) or plan0[i] != plan_r[i])
    return (
        f"Ranks split the graph into different DDP buckets: rank 0 planned {len(plan0)} bucket(s), rank {r} "
        f"planned {len(plan_r)}. First difference at bucket {first}: rank 0 has {show(plan0, first)}; "
        f"rank {r} has {show(plan_r, first)}. Mismatched buckets pair up the wrong all-reduces and deadlock "
        "in backward. Make every rank build the same model with the same DDP bucket caps and the same "
        "code path (no rank-dependent branches in forward). To skip this check, pass check_plans=False "
        "to compile_ddp."
    )
