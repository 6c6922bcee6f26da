"""What every strategy reads and returns: :class:`Setup` (the DDP model, the settings, the
cost model, the step gate) and :class:`Built` (the backend dynamo calls and what the handle
keeps), and DDP's bucket caps (:func:`caps_from_ddp`). Each strategy's module builds a
``Built`` from a ``Setup`` (``build``); ``table.py`` lists them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from compiler.ranks import StepGate

from .._torch_internals import bucket_settings
from ..config import DDPCompileConfig
from ..planning.buckets import Bucket, BucketCaps
from ..planning.cost import CostModel

__all__ = ["Built", "Setup", "caps_from_ddp"]


@dataclass(frozen=True)
class Setup:
    """What every strategy reads.

    Attributes:
        ddp_model: the DDP module.
        config: the settings.
        named: the module whose parameter names the plan uses (the uncompiled model).
        cost_model: the cost model the splitter or traced plan plans with, or None.
        gate: the step gate of DDP's group, or None.
    """

    ddp_model: DistributedDataParallel
    config: DDPCompileConfig
    named: nn.Module
    cost_model: CostModel | None = None
    gate: StepGate | None = None


@dataclass(frozen=True)
class Built:
    """What a strategy hands ``compile_ddp`` and the handle.

    Attributes:
        backend: the backend dynamo calls (the finished chain once ``ddp_backend`` returns).
        splitter: ``"split"``'s splitter; else None.
        traced: ``"traced"``'s plan; else None.
        block_buckets: ``"regional"``'s buckets of whole blocks; else None.
        blocks: ``"regional"``'s (name, block) pairs, compiled one by one with ``backend``
            instead of the whole forward; else None.
    """

    backend: Callable
    # Typed by their modules, which import this one: split.DDPOptimizer, traced.plan.TracedPlan.
    splitter: Any = None
    traced: Any = None
    block_buckets: list[Bucket] | None = None
    blocks: list[tuple[str, nn.Module]] | None = None


def caps_from_ddp(ddp_model: DistributedDataParallel) -> BucketCaps:
    """The caps DDP's reducer uses when it rebuilds its buckets after step 1.

    DDP's first bucket is capped at 1 MiB only when the user left
    ``bucket_cap_mb`` unset; with ``bucket_cap_mb=X`` every bucket, the first
    included, is capped at X MiB. ``bucket_cap_mb_list`` gives one cap per bucket.
    """
    found = bucket_settings(ddp_model)
    return BucketCaps(found.bucket_bytes_cap, found.first_bucket_cap, found.per_bucket_caps)
