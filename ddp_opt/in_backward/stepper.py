"""The user's optimizer stepped on one bucket of parameters at a time, inside backward
(``compile_ddp(..., optimizer=opt)``), and what such an optimizer must be.

Note [Optimizer in backward]

Background
    A DDP step is ``fwd + max(bwd, comm) + opt``: the optimizer runs after the last
    all-reduce, and every gradient lives from its backward to the end of that step.
    Each bucket's update needs only that bucket's reduced gradients, so it can run as
    soon as its all-reduce completes, while backward and the other all-reduces go on,
    and free those gradients at once. PyTorch's ``_apply_optimizer_in_backward`` does
    this eagerly, with an optimizer of its own per parameter.

Algorithm
    - The update is the user's optimizer: a view of it (:class:`BucketStep`) shares its
      ``state`` and its groups' hyper-parameters, read at each update (so LR schedulers
      act), and lists only the bucket's parameters; its class's own ``step`` runs on it.
      An element's update reads only its own gradient and state, so updating bucket by
      bucket gives the single step's result.
    - Before the update each parameter's ``.grad`` is set to its reduced gradient; after
      it, to None. The user's ``optimizer.step()`` and ``zero_grad()`` after backward
      then find no gradient of these parameters and change nothing; a parameter outside
      the DDP model keeps its gradient and is stepped there, as before. A wrapper that keeps
      the real optimizer as ``.optimizer`` (Accelerate's) is unwrapped: its ``step`` would
      step the real one over every parameter. One that steps through an enabled GradScaler
      (Accelerate's under fp16) is refused: the gradients are scaled until that step.
    - Updates run one at a time (a lock): collectives complete on the process group's
      own threads.

Notes
    - Refused (:func:`refusal`): an optimizer whose step needs every gradient at once
      (a ``closure``, as LBFGS's), or that communicates itself (ZeroRedundancyOptimizer).
      Global-norm clipping and a GradScaler need every gradient before any update; the
      launcher refuses them (``train.max_grad_norm``, fp16), and after backward the
      user's own ``clip_grad_norm_`` or ``scaler.unscale_`` finds no gradients.
    - A parameter is written only after its gradient is final, when backward no longer
      reads it; a tensor saved for backward that aliases a parameter through
      ``.detach()`` would be read after its update (autograd's version check says so).
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Iterable

import torch

log = logging.getLogger(__name__)

__all__ = ["BucketStep", "refusal", "unwrapped"]


def _wrappers(optimizer: object) -> list[object]:
    """``optimizer`` and, while an Optimizer keeps another as ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer``), each one it wraps, outermost first."""
    chain = [optimizer]
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer) and all(inner is not o for o in chain):
        chain.append(inner)
        inner = getattr(inner, "optimizer", None)
    return chain


def unwrapped(optimizer: object) -> object:
    """The optimizer that really steps: a wrapper that is itself an Optimizer and keeps the real one as
    ``.optimizer`` (Accelerate's ``AcceleratedOptimizer``) steps that one over all of its parameters,
    which a bucket's update must not do."""
    return _wrappers(optimizer)[-1]


def _grad_scaler(optimizer: object) -> object | None:
    """The enabled GradScaler a wrapper steps through (Accelerate's ``AcceleratedOptimizer.scaler`` under
    ``mixed_precision="fp16"``), or None."""
    scalers = (getattr(o, "scaler", None) for o in _wrappers(optimizer))
    return next((s for s in scalers if isinstance(s, torch.amp.GradScaler) and s.is_enabled()), None)


def refusal(optimizer: object) -> str | None:
    """Why ``optimizer`` cannot run inside backward, bucket by bucket, or None."""
    if _grad_scaler(optimizer) is not None:
        return (f"{type(optimizer).__name__} steps through a GradScaler (fp16 mixed precision, as Accelerate's "
                "mixed_precision='fp16'): the gradients stay scaled until its step unscales them, and it skips the "
                "step on an inf gradient, which no bucket's update inside backward can do; train in bf16 (no "
                "scaler), or drop optimizer=")
    optimizer = unwrapped(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return (f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer; pass the optimizer "
                "object that steps this model's parameters")
    name = type(optimizer).__name__
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # a torch built without distributed
        ZeroRedundancyOptimizer = ()  # type: ignore[assignment,misc]
    if ZeroRedundancyOptimizer and isinstance(optimizer, ZeroRedundancyOptimizer):
        return (f"{name} shards the optimizer state and communicates in its own step, which cannot run per "
                "bucket inside backward; use a plain optimizer, or drop optimizer=")
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        return (f"{name}.step needs a closure that re-evaluates the loss over every gradient at once, which "
                "cannot run per bucket inside backward; drop optimizer= and call optimizer.step(closure) after "
                "backward")
    return None


class BucketStep:
    """The user's ``optimizer``, stepped on a bucket of its parameters at a time
    (Note [Optimizer in backward]).

    Attributes:
        optimizer: the user's optimizer (its state and groups are the ones used).
        updates: bucket updates run so far; under ``strategy="traced"`` the parameter updates its
            backward graph ran (``traced_count``, Note [Traced update]).
        traced_count: under ``strategy="traced"``, the traced update's counter tensor; else None.
        release: under DDP's reducer, what gives its bucket buffers back between steps
            (:class:`ddp_opt.in_backward.release.BucketRelease`, Note [Bucket buffers between steps]);
            None under ``strategy="traced"`` or where it is refused (``release_refusal``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        why = refusal(optimizer)
        if why is not None:
            raise ValueError(f"compile_ddp(optimizer=...): {why}.")
        self.optimizer = unwrapped(optimizer)  # a wrapper's own step after backward then finds no gradients
        self._updates = 0
        self.traced_count: torch.Tensor | None = None
        self.release = None
        self._lock = threading.Lock()

    @property
    def updates(self) -> int:
        return int(self.traced_count) if self.traced_count is not None else self._updates

    def step(self, params: Iterable[torch.nn.Parameter], grads: Iterable[torch.Tensor]) -> None:
        """Update ``params`` from their reduced ``grads`` with the user's optimizer, then free the
        gradients (``.grad = None``). Parameters the optimizer does not hold are left alone."""
        params, grads = list(params), list(grads)
        with self._lock, torch.no_grad():
            for p, g in zip(params, grads):
                p.grad = g
            chosen = {id(p) for p in params}
            view = object.__new__(type(self.optimizer))
            view.__dict__.update(self.optimizer.__dict__)
            groups = [dict(group, params=[p for p in group["params"] if id(p) in chosen])
                      for group in self.optimizer.param_groups]
            view.param_groups = [group for group in groups if group["params"]]
            try:
                if view.param_groups:
                    type(self.optimizer).step(view)
            finally:
                for p in params:
                    p.grad = None
            self._updates += 1
