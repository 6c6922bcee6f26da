"""The traced strategy's part of the ``CompiledDDP`` handle (:class:`TracedBackward`: the
context the backward runs in), its form of ``reduce_dtype=`` and ``compression=`` on DDP's
python reducer (:func:`traced_hook`), and what it refuses of ``optimizer=`` before DDP is
converted (:func:`check_update`)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from compiler import SettingError

from ...compression.hooks import OwnHook, ReduceState
from ...config import DDPCompileConfig
from ...in_backward.stepper import BucketStep, unwrapped
from . import powersgd
from ._torch_internals import add_python_reducer_hook, functional_all_reduce
from .plan import TracedPlan
from .update import attach_traced, traced_refusal

__all__ = ["TracedBackward", "check_update", "gradient_hook", "traced_hook"]


class TracedBackward:
    """Under ``strategy="traced"``: the context the backward runs in, and the warning when a
    forward's backward ran without it (Note [Traced strategy]).

    With ``reduce_dtype`` or ``compression``, ``own_hook`` is put on the python reducer here;
    ``hook`` is its state when it has one (``TracedPowerSGD``). With ``stepper`` (``optimizer=``),
    the update is traced into the backward (``update``: ``ddp_opt.strategies.traced.update.TracedUpdate``)."""

    def __init__(self, plan: TracedPlan, ddp_model: DistributedDataParallel, own_hook: OwnHook | None = None,
                 stepper: BucketStep | None = None) -> None:
        self.plan, self.ddp_model = plan, ddp_model
        self.hook = traced_hook(own_hook, ddp_model, plan) if own_hook is not None else None
        # With optimizer=, the update traced after the reducer's hooks (Note [Traced update]).
        self.update = attach_traced(ddp_model, plan, stepper) if stepper is not None else None
        self._pending = False  # a forward ran; its backward has not entered context()
        self._warned = False

    def context(self) -> contextlib.AbstractContextManager:
        """What ``loss.backward()`` must run in: compiled autograd with the planned fusion."""
        self._pending = False
        if self.hook is not None:  # PowerSGD's steps count these backwards (Note [Traced PowerSGD])
            return self.hook.backward(self.plan.backward(), self.ddp_model.require_backward_grad_sync)
        return self.plan.backward()

    def before_forward(self) -> None:
        if self._pending and not self._warned:
            self._warned = True
            warnings.warn(
                "compile_ddp(strategy='traced'): a forward ran again without compiled.backward(loss) since the "
                "last one. If that forward's backward ran as plain loss.backward(), its gradients were all-reduced "
                "one parameter at a time, eagerly, without overlap: correct, but slow (with compression, not counted "
                "toward its start, and in another bucket order than a compiled backward's). Call "
                "compiled.backward(loss) (or run it in compiled.backward_context()) instead of loss.backward(), or "
                "compile with strategy='split'.",
                stacklevel=3,
            )
        self._pending = torch.is_grad_enabled()
        if self.hook is not None:
            self.hook.check_complete()  # after a plain loss.backward(), which context() did not see


def traced_hook(own: OwnHook, ddp_model: DistributedDataParallel, plan: TracedPlan) -> Any:
    """``reduce_dtype=`` or ``compression=`` put on DDP's python reducer, traced into the backward:
    the PowerSGD state (its steps are counted at each synchronised forward), or None for the
    narrowed all-reduce (Note [Reduced-precision all-reduce], Note [Traced PowerSGD])."""
    if own.name == "compression":
        return powersgd.attach(own.spec, ddp_model, plan)
    add_python_reducer_hook(ddp_model, own.state, gradient_hook)
    return None


def gradient_hook(state: ReduceState, grad_and_param: tuple[torch.Tensor, torch.nn.Parameter]) -> None:
    """The python reducer's hook per gradient (the traced strategy): the gradient all-reduced
    in ``state.dtype`` with a functional collective, averaged, and copied back in place (the
    pattern the DDP fusion pass buckets: div -> all_reduce -> wait -> copy_)."""
    grad, _ = grad_and_param
    wire = grad.to(state.dtype) / state.world_size
    grad.copy_(functional_all_reduce(wire, state.group))


def check_update(ddp_model: DistributedDataParallel, config: DDPCompileConfig) -> None:
    """Refuse, before DDP is converted to its python reducer, what the traced update cannot run."""
    why = traced_refusal(unwrapped(config.optimizer), list(ddp_model.parameters()))
    if why is None and config.compression is not None:
        why = (f"compression={str(config.compression)!r} writes each gradient after its hook returned, so an "
               "update right after it would read it unreduced")
    if why is not None:
        raise SettingError("optimizer", f"compile_ddp(strategy='traced', optimizer=...): {why}. Compile with "
                                        "strategy='split', which steps any optimizer inside backward, or drop "
                                        "optimizer= and call optimizer.step() after backward.")
