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
    - Uses DDP internals (``_ddp_init_helper``, ``_bucket_config``) of torch 2.13,
      all in ``ddp_opt._torch_internals``; outside the tested torch versions
      realignment is turned off with a warning.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch.nn.parallel import DistributedDataParallel

from ._torch_internals import rebuild_reducer, reducer_finalized, registered_hook_name
from .plan import Bucket

log = logging.getLogger(__name__)

__all__ = ["registered_hook_name", "realign_reducer", "reducer_finalized"]


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
    rebuild_reducer(ddp_model, caps)
    for state, hook in hooks:
        ddp_model.register_comm_hook(state, hook)
    log.info("ddp_opt realigned DDP's buckets with the %d partitions (caps %s B)", len(caps), list(caps))
    return caps
