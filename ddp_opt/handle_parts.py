"""The parts ``CompiledDDP`` delegates to, one job each, each usable alone: the
comm-hook registry (:class:`CommHooks`), bucket realignment (:class:`Realigner`), the
compile cache's automatic save (:class:`CacheAutoSave`) and the step gate's forward hook
(:class:`GateHook`). The traced strategy's own part is in its folder
(``ddp_opt.strategies.traced.backward.TracedBackward``).

``CompiledDDP`` runs their ``before_forward`` / ``after_forward`` from hooks on the DDP
model; each part keeps only its own state.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from compiler import CompileCache
from compiler.cache import save_on_local_rank0
from compiler.ranks import StepGate

from ._torch_internals import has_rebuilt_buckets, python_comm_hooks, reducer_finalized
from .alignment.agreement import agree_on_caps, next_plan_namespace
from .alignment.measure import Alignment
from .compression.hooks import OwnHook
from .planning.buckets import Bucket, realign_caps
from .alignment.realign import check_realignment, realign_reducer
from .in_backward.release import BucketRelease, release_refusal
from .in_backward.reducer import allreduce_hook, leave_grads, then_step
from .in_backward.stepper import BucketStep

log = logging.getLogger(__name__)

__all__ = ["CacheAutoSave", "CommHooks", "GateHook", "Realigner"]


def synchronised(ddp_model: DistributedDataParallel) -> bool:
    """Whether the running forward is one that a synchronised backward follows."""
    return torch.is_grad_enabled() and ddp_model.require_backward_grad_sync


class CommHooks:
    """The comm hooks registered through the handle, registered on DDP now and kept to be
    registered again on the reducer realignment re-creates (Note [Bucket realignment]).

    With ``reduce_dtype`` or ``compression`` under the reducer strategies, ``own_hook`` is
    registered here first; under ``strategy="traced"`` no bucket hook can be registered.
    With ``stepper`` (``optimizer=``), the hook (``own_hook``'s or DDP's own reduction) is
    followed by each bucket's update (Note [Update after the reduction]), and the bucket buffers
    are given back between steps (Note [Bucket buffers between steps])."""

    def __init__(self, ddp_model: DistributedDataParallel, own_hook: OwnHook | None = None,
                 traced: bool = False, stepper: BucketStep | None = None) -> None:
        self.ddp_model, self.own_hook, self.traced, self.stepper = ddp_model, own_hook, traced, stepper
        self.hooks: list[tuple[Any, Callable]] = []
        if traced:
            return
        if stepper is not None:
            state, hook = ((own_hook.state, own_hook.bucket) if own_hook is not None
                           else (ddp_model.process_group, allreduce_hook))
            stepper.release = BucketRelease(ddp_model) if release_refusal(ddp_model) is None else None
            self._add(state, then_step(hook, stepper))
            leave_grads(ddp_model)
        elif own_hook is not None:
            self._add(own_hook.state, own_hook.bucket)

    def register(self, state: Any, hook: Callable) -> None:
        """``DistributedDataParallel.register_comm_hook``, kept across realignment."""
        if self.own_hook is not None:
            name = self.own_hook.name
            raise ValueError(
                f"register_comm_hook({getattr(hook, '__qualname__', hook)!r}): this model was compiled with "
                f"{self.own_hook.setting}, which all-reduces the gradients through a comm hook of its own, "
                f"and DDP calls one hook. Compile with {name}=None to reduce through your hook, or drop the "
                f"hook and keep {name}.")
        if self.stepper is not None:
            raise ValueError(
                f"register_comm_hook({getattr(hook, '__qualname__', hook)!r}): this model was compiled with "
                "optimizer=..., whose update follows each bucket's reduction through a comm hook of its own, and "
                "DDP calls one hook. Drop optimizer= to reduce through your hook (and call optimizer.step() after "
                "backward), or drop the hook; reduce_dtype= and compression= work with optimizer=.")
        if self.traced:
            raise RuntimeError(
                "register_comm_hook: this model was compiled with strategy='traced', whose gradients are "
                "all-reduced inside the compiled backward graph by the python reducer, which calls a hook per "
                "gradient with (grad, param): a DDP bucket hook cannot take that. Compile with strategy='split' "
                "(the default) to use a comm hook, or, to compress, pass reduce_dtype=torch.bfloat16."
            )
        self._add(state, hook)

    def _add(self, state: Any, hook: Callable) -> None:
        self.hooks.append((state, hook))
        self.ddp_model.register_comm_hook(state, hook)

    def reducer_changed(self) -> None:
        """Realignment re-created DDP's reducer: it must leave the updated gradients freed too."""
        if self.stepper is not None and not self.traced:
            leave_grads(self.ddp_model)

    def current(self) -> list[tuple[Any, Callable]]:
        """The hooks to register on a new reducer: those on DDP itself where they can be read
        (also those registered on DDP directly), else those registered here."""
        found = python_comm_hooks(self.ddp_model)
        return self.hooks if found is None else found


class Realigner:
    """Realigns DDP's buckets with the plan's partitions once, and measures the result
    (Note [Bucket realignment], Note [Plan agreement]).

    Args:
        ddp_model: the DDP module.
        buckets: returns the plan's buckets (empty until the first forward compiled).
        enabled: whether to realign at all.
        min_buckets: realign only with at least this many non-empty buckets.
        comm_hooks: the hooks to register again on the new reducer.
        on_change: called when DDP's bucket layout changed (an own hook's per-bucket state).
    """

    def __init__(self, ddp_model: DistributedDataParallel, buckets: Callable[[], list[Bucket]], *, enabled: bool,
                 min_buckets: int = 2, comm_hooks: CommHooks | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        self.ddp_model, self.buckets, self.enabled, self.min_buckets = ddp_model, buckets, enabled, min_buckets
        self.comm_hooks = comm_hooks if comm_hooks is not None else CommHooks(ddp_model)
        self.on_change = on_change
        self.aligned_caps: tuple[int, ...] | None = None
        self.realignment: Alignment | None = None  # measured once the realigned buckets exist
        self.decided = False
        self.agreed: bool | None = None  # whether the ranks agreed on the caps, once decided
        self._key = next_plan_namespace("realign")

    def before_forward(self) -> None:
        """At the start of the first forward with gradients after the plan exists (the second
        one: the first compiles it), every rank at once: realign, with caps agreed by all ranks
        (Note [Plan agreement]), or not at all. Graphs without backward plan nothing, so an
        evaluation on rank 0 only never moves this point on that rank alone."""
        if not (self.enabled and not self.decided and torch.is_grad_enabled()
                and reducer_finalized(self.ddp_model)):
            return
        buckets = [b for b in self.buckets() if b.size > 0]
        if not buckets:
            return  # not compiled yet: the first forward
        self.decided = True
        agreed, why = agree_on_caps(realign_caps(buckets), self._key, self.ddp_model.process_group)
        self.agreed = agreed
        if not agreed:
            warnings.warn(f"compile_ddp: DDP's buckets were not realigned with the partitions on any rank: {why}. "
                          "Training is correct; the gradients' all-reduces overlap backward less. Pass "
                          "align_buckets=False to skip realignment.", stacklevel=3)
        elif len(buckets) >= self.min_buckets:
            self.aligned_caps = realign_reducer(self.ddp_model, buckets, self.comm_hooks.current())
            self.comm_hooks.reducer_changed()
            self._changed()

    def after_forward(self) -> None:
        """DDP rebuilds its buckets at the start of a forward: measured right after it."""
        if self.aligned_caps is not None and self.realignment is None and has_rebuilt_buckets(self.ddp_model):
            self.realignment = check_realignment(self.ddp_model, [b for b in self.buckets() if b.size > 0])
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


class CacheAutoSave:
    """Saves the compile cache once, at the start of the second call with gradients
    (after the first full step), unless ``enabled`` is set False first (Note [Compile cache])."""

    def __init__(self, cache: CompileCache | None) -> None:
        self.cache = cache
        self.enabled = True
        self.attempted = False
        self._calls = 0

    def save(self) -> str | None:
        """Local rank 0 writes what the entry does not hold yet; the entry's path when written."""
        self.attempted = True
        path = save_on_local_rank0(self.cache)
        return str(path) if path is not None else None

    def before_forward(self) -> None:
        if self.enabled and self.cache is not None and not self.attempted:
            self._calls += 1  # counted only while a save is pending
            if self._calls >= 2 and torch.is_grad_enabled():
                self.save()


class GateHook:
    """The step gate met after each synchronised forward, before its backward's first
    collective (Note [Step gate]); the reducer strategies only."""

    def __init__(self, gate: StepGate, ddp_model: DistributedDataParallel) -> None:
        self.gate, self.ddp_model = gate, ddp_model
        self._skip = 0  # synchronised forwards still to pass ungated (compile_for_ddp: see from_next)
        self._in_first_call = False

    def before_forward(self) -> None:
        self._in_first_call = False

    def after_forward(self) -> None:
        if not synchronised(self.ddp_model):
            return
        if self._in_first_call:  # the call this hook was made in, counted by from_next
            self._in_first_call = False
        elif self._skip:
            self._skip -= 1
        else:
            self.gate.meet()

    def from_next(self) -> None:
        """Called when the hook is made inside a forward of the DDP model (``compile_for_ddp``
        attaches in the first compiled call). That call's forward hook may or may not run (a
        module without hooks when the call began skips them), and ranks may attach in different
        calls (an evaluation on rank 0 only comes first): so every rank leaves its first
        synchronised forward ungated, the attach call or a later one, and all ranks meet from
        their second on."""
        self._in_first_call = True
        self._skip = 0 if synchronised(self.ddp_model) else 1

