"""How ``compile_ddp`` builds the traced strategy: the plan (:class:`TracedPlan`) on DDP's caps,
DDP converted to its python reducer, the forward compiled whole (Note [Traced strategy])."""

from __future__ import annotations

from typing import Callable

import torch

from ..base import Built, Setup, caps_from_ddp
from ._torch_internals import use_python_reducer
from .plan import TracedPlan

__all__ = ["build"]


def build(setup: Setup, backend: Callable) -> Built:
    """The forward whole, the all-reduces traced into the compiled backward (Note [Traced strategy])."""
    config = setup.config
    # The backward graph compiles with the plain backend: no shared-compile claim for a graph that
    # only compiled autograd's trace names.
    plan = TracedPlan(caps_from_ddp(setup.ddp_model), config.resolve_backend(), setup.cost_model,
                      auto=config.bucket_cap_mb == "auto", gate=setup.gate,
                      wire_scale=_wire_scale(setup.ddp_model.module, config.reduce_dtype))
    use_python_reducer(setup.ddp_model)
    return Built(plan.forward_backend(backend), traced=plan)


def _wire_scale(module: torch.nn.Module, reduce_dtype: torch.dtype | None) -> float:
    """Gradient bytes per byte on the wire (the gradients' dtype is the first parameter's)."""
    param = next(module.parameters(), None)
    if reduce_dtype is None or param is None:
        return 1.0
    return param.element_size() / reduce_dtype.itemsize
