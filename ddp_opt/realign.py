"""Enforced alignment: give DDP's reducer the partitions as its bucket caps.

Note [Bucket realignment]

Background
    DDP rebuilds its buckets once, after its first iteration, filling them in the
    order gradients became ready against its caps. Under a split, compiled graph
    that order differs from the reverse graph order the plan counted in, so
    runtime buckets straddle partitions (see ``ddp_opt.alignment``).

Algorithm
    After the first step (the plan exists, the reducer has finished its
    reduction), re-create DDP's reducer the way DDP itself does when it is
    unpickled, with per-bucket rebuild caps equal to the planned partition sizes
    in gradient-ready order. Under the compiled graph each partition's gradients
    become ready together, after the previous partition's, so a bucket whose cap
    is exactly its partition's size closes exactly at the partition's end: the
    rebuilt buckets *are* the partitions, from the next rebuild on.

Notes
    - Comm hooks live on the reducer: hooks registered through
      ``CompiledDDP.register_comm_hook`` are registered again; a hook registered on
      the DDP module before ``compile_ddp`` cannot be recovered, so that case is
      refused up front (``align_buckets=False`` keeps DDP's own buckets).
    - ``DDP(static_graph=True)`` is left alone: its reducer did not take the new
      caps in a test (alignment stayed 0), so ``compile_ddp`` skips it there.
    - Uses DDP internals (``_ddp_init_helper``, ``_bucket_config``) of torch 2.13.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from torch.nn.parallel import DistributedDataParallel

from .plan import Bucket

log = logging.getLogger(__name__)

__all__ = ["registered_hook_name", "realign_reducer", "reducer_finalized"]


def registered_hook_name(ddp_model: DistributedDataParallel) -> str | None:
    """The name of a comm hook registered on ``ddp_model``'s reducer, if any."""
    return ddp_model._get_ddp_logging_data().get("comm_hook") or None


def reducer_finalized(ddp_model: DistributedDataParallel) -> bool:
    """True when the last backward's reduction is complete (safe to swap reducers)."""
    try:
        ddp_model.reducer._check_reducer_finalized()
    except RuntimeError:
        return False
    return True


def realign_reducer(ddp_model: DistributedDataParallel, buckets: list[Bucket],
                    hooks: list[tuple[Any, Callable]]) -> tuple[int, ...]:
    """Re-create DDP's reducer with rebuild caps equal to the partitions' sizes.

    Args:
        ddp_model: the DDP module; its reducer is replaced.
        buckets: the plan, in forward order.
        hooks: ``(state, hook)`` comm hooks to register on the new reducer.

    Returns:
        The caps given to the reducer, in gradient-ready order.
    """
    caps = tuple(b.size for b in reversed(buckets) if b.size > 0)
    ddp_model._bucket_config = dataclasses.replace(ddp_model._bucket_config, per_bucket_bytes_caps=caps)
    ddp_model.reducer._remove_autograd_hooks()
    params, expect_sparse = ddp_model._build_params_for_reducer()
    names = ddp_model._build_debug_param_to_name_mapping(params)
    ddp_model._ddp_init_helper(params, expect_sparse, names, ddp_model.static_graph)
    ddp_model._has_rebuilt_buckets = False
    for state, hook in hooks:
        ddp_model.register_comm_hook(state, hook)
    log.info("ddp_opt realigned DDP's buckets with the %d partitions (caps %s B)", len(caps), list(caps))
    return caps
