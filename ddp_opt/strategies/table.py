"""The compile strategies of ``compile_ddp`` and ``compile_for_ddp`` in one table,
``STRATEGIES``, keyed by the strategy's name (``ddp_opt.config.STRATEGIES``), and
``ddp_backend``, which builds the dynamo backend of a DDP model through
``compiler.graph.backend_chain.build_backend`` with the chosen strategy as its transform.

Each strategy is a function ``(setup, backend) -> Built``: given the backend each
piece is compiled with (already shared, Note [Backend wrapping order]), it returns
the backend dynamo calls and what the handle (``CompiledDDP``) keeps of it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from compiler import produces_gradients
from compiler.graph import build_backend
from compiler.ranks import CompileShare, StepGate

from .._torch_internals import bucket_settings, use_python_reducer
from ..config import DDPCompileConfig
from ..planning.cost import CostModel
from .split import DDPOptimizer
from ..planning.buckets import Bucket, BucketCaps
from .regional import find_ddp_blocks, plan_block_buckets
from .traced import TracedPlan

log = logging.getLogger(__name__)

__all__ = ["STRATEGIES", "Built", "Setup", "caps_from_ddp", "ddp_backend", "splitter_for"]


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
    splitter: DDPOptimizer | None = None
    traced: TracedPlan | None = None
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


def splitter_for(ddp_model: DistributedDataParallel, config: DDPCompileConfig, backend_fn: Callable,
                 named: nn.Module, cost_model: CostModel | None = None, gate: StepGate | None = None
                 ) -> DDPOptimizer:
    """The splitter of ``ddp_model``: DDP's caps, group and fallback, parameters named as in ``named``;
    with the step gate, the plan check stops waiting for peers that passed the step (Note [Step gate])."""
    caps = caps_from_ddp(ddp_model)
    return DDPOptimizer(
        caps.bucket_bytes_cap, backend_fn, caps.first_bucket_cap,
        bucket_caps=caps.per_bucket_caps, fallback=config.fallback, check_plans=config.check_plans,
        cost_model=cost_model, auto_plan=config.bucket_cap_mb == "auto", spelling=config.spelling,
        param_names={id(p): n for n, p in named.named_parameters()}, process_group=ddp_model.process_group,
        peers_elsewhere=gate.others_waiting if gate is not None else None,
    )


def _split(setup: Setup, backend: Callable) -> Built:
    """The forward split at the bucket boundaries; DDP's reducer all-reduces each bucket."""
    splitter = splitter_for(setup.ddp_model, setup.config, backend, setup.named, setup.cost_model, setup.gate)
    return Built(splitter.compile_fn, splitter=splitter)


def _whole(setup: Setup, backend: Callable) -> Built:
    """Each captured graph compiled whole."""
    return Built(backend)


def _regional(setup: Setup, backend: Callable) -> Built:
    """Each repeated block compiled once, DDP's buckets made of whole blocks (Note [Regional compile])."""
    inner = setup.ddp_model.module
    found = find_ddp_blocks(inner, setup.config.blocks)
    return Built(backend, blocks=found,
                 block_buckets=plan_block_buckets(inner, found, caps_from_ddp(setup.ddp_model)))


def _traced(setup: Setup, backend: Callable) -> Built:
    """The forward whole, the all-reduces traced into the compiled backward (Note [Traced strategy])."""
    config = setup.config
    # The backward graph compiles with the plain backend: no shared-compile claim for a graph that
    # only compiled autograd's trace names.
    plan = TracedPlan(caps_from_ddp(setup.ddp_model), config.resolve_backend(), setup.cost_model,
                      auto=config.bucket_cap_mb == "auto", gate=setup.gate,
                      wire_scale=_wire_scale(setup.ddp_model.module, config.reduce_dtype))
    use_python_reducer(setup.ddp_model)
    return Built(plan.forward_backend(backend), traced=plan)


STRATEGIES: dict[str, Callable[[Setup, Callable], Built]] = {
    "split": _split, "whole": _whole, "regional": _regional, "traced": _traced}


def ddp_backend(setup: Setup, strategy: str, share: CompileShare | None, backward_with_forward: bool) -> Built:
    """The dynamo backend of ``setup.ddp_model`` under ``strategy`` (a key of ``STRATEGIES``),
    built by ``compiler.graph.backend_chain.build_backend`` (Note [Backend wrapping order]); the
    barrier holds for the graphs that produce gradients, whose all-reduces follow them."""
    built: list[Built] = []

    def transform(backend: Callable) -> Callable:
        built.append(STRATEGIES[strategy](setup, backend))
        return built[0].backend

    backend = build_backend(setup.config.resolve_backend(), share=share, backward_with_forward=backward_with_forward,
                            transform=transform, wrap_backend=setup.config.wrap_backend,
                            barrier_if=produces_gradients)
    return dataclasses.replace(built[0], backend=backend)


def _wire_scale(module: torch.nn.Module, reduce_dtype: torch.dtype | None) -> float:
    """Gradient bytes per byte on the wire (the gradients' dtype is the first parameter's)."""
    param = next(module.parameters(), None)
    if reduce_dtype is None or param is None:
        return 1.0
    return param.element_size() / reduce_dtype.itemsize
