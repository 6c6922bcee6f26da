"""CompiledDDP: what the training loop calls in place of the DDP model that
``compile_ddp`` compiled, and what it keeps: the plan, bucket realignment, the
compile cache and, under ``strategy="traced"``, the backward context.

Note [Looking like DDP]

Background
    Frameworks find the model inside a DDP wrapper by ``isinstance(model,
    DistributedDataParallel)`` and then ``model.module``: Accelerate's
    ``unwrap_model`` (``extract_model_from_parallel``) and ``trigger_sync_in_backward``,
    the HF Trainer's save path. ``model = compile_ddp(accelerator.prepare(model))``
    hands them a CompiledDDP, which they did not recognise: ``unwrap_model`` returned
    it whole, and its ``state_dict`` keys kept DDP's ``module.`` prefix.

Algorithm
    ``CompiledDDP.__class__`` returns the DDP model's class. ``isinstance`` consults
    ``__class__`` when ``type()`` does not match (as ``unittest.mock``'s ``spec`` relies
    on), so ``isinstance(compiled, DistributedDataParallel)`` (and ``nn.Module``) holds,
    and every attribute such code reads next (``module``, ``no_sync``,
    ``require_backward_grad_sync``, ``reducer``, ``state_dict``) is DDP's own, forwarded.

Notes
    - ``type(compiled)`` is still CompiledDDP, and ``isinstance(compiled, CompiledDDP)``
      still holds; nothing about the DDP model changes.
    - ``compile_ddp(compiled)`` now passes the DDP type check and stops at the
      "already compiled" error, which names the fix.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import replace
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from compiler import CompileCache
from compiler.cache import save_on_local_rank0
from compiler.share import CompileShare
from compiler.step_gate import StepGate

from ._torch_internals import has_rebuilt_buckets, python_comm_hooks, reducer_finalized
from .alignment import Alignment
from .autoplan import Timeline
from .calibrate import Calibration, calibrate, calibrated_model
from .compression import OwnHook
from .agreement import agree_on_caps, next_plan_namespace
from .optimizer import DDPOptimizer
from .plan import Bucket, realign_caps
from .realign import check_realignment, realign_reducer
from .traced import TracedPlan

log = logging.getLogger(__name__)

__all__ = ["CompiledDDP"]


class CompiledDDP:
    """What the training loop calls in place of the DDP model.

    Calling it calls the DDP model, whose wrapped module ``compile_ddp`` compiled
    in place; what this object adds (realignment, the cache's save, the traced
    strategy's checks) runs from hooks on the DDP model, so calling the DDP model
    itself is the same. Every other attribute (``parameters``, ``no_sync``, ``state_dict``,
    ``module``, ...) is the DDP model's, and checkpoints keep DDP's keys; setting
    one of DDP's attributes sets it on the DDP model (nanoGPT's
    ``model.require_backward_grad_sync = last_micro_step``).

    Attributes:
        ddp_model: the wrapped DDP module.
        ddp_optimizer: the splitter, or None under the strategies that do not split.
        align_buckets: re-create DDP's reducer once, after the first step, so that
            its buckets equal the partitions (Note [Bucket realignment]).
        aligned_caps: the caps given to the reducer, once realigned.
        realignment: the alignment of the realigned buckets, measured (and warned
            about when below 1.0) in the forward where DDP rebuilt them.
        block_buckets: with regional compile, the buckets of whole blocks
            (Note [Regional compile]); None otherwise.
        compile_cache: the :class:`compiler.cache.CompileCache` with
            ``cache_dir``, else None; saved by :meth:`save_compile_cache`.
        share: the :class:`compiler.share.CompileShare` of DDP's group (its
            ``stats`` say what this rank compiled, loaded and waited for), or
            None on one rank.
        gate: the :class:`compiler.step_gate.StepGate` of DDP's group (Note [Step
            gate]), or None (one rank, or ``step_gate=False``).
        traced: under ``strategy="traced"``, its plan (Note [Traced strategy]); else None.
        own_hook: with ``reduce_dtype`` or ``compression``, the comm hook registered here and kept
            across realignment (Note [Reduced-precision all-reduce], Note [PowerSGD compression]);
            else None.
        traced_hook: under ``strategy="traced"`` with ``compression``, the traced hooks' state
            (``ddp_opt.traced_powersgd.TracedPowerSGD``: memories, step count); else None.
        strategy: the strategy in use (``ddp_opt.config.STRATEGIES``; ``"split"`` also
            when ``"traced"`` was asked for and fell back, with a warning).
    """

    def __init__(self, ddp_model: DistributedDataParallel, ddp_optimizer: DDPOptimizer | None,
                 align_buckets: bool = False, *, block_buckets: list[Bucket] | None = None,
                 compile_cache: CompileCache | None = None, share: CompileShare | None = None,
                 traced: TracedPlan | None = None, gate: StepGate | None = None,
                 own_hook: OwnHook | None = None) -> None:
        self.ddp_model = ddp_model
        # Under the reducer, the ranks meet after each forward that a synchronised backward follows;
        # under the traced strategy inside the backward, once it compiled (Note [Step gate]).
        self.gate = gate
        self._gate_skip = 0  # synchronised forwards still to pass ungated (compile_for_ddp: see gate_from_next)
        self._in_first_call = False
        self.traced = traced
        self._backward_pending = False  # a traced forward ran; its backward has not entered backward_context()
        self._warned_plain_backward = False
        self.share = share
        self.ddp_optimizer = ddp_optimizer
        self.block_buckets = block_buckets
        self.compile_cache = compile_cache
        self._calls = 0
        self.auto_save_cache = True
        self._save_attempted = False
        planned = ddp_optimizer is not None or block_buckets is not None
        self.align_buckets = align_buckets and planned
        self.aligned_caps: tuple[int, ...] | None = None
        self.realignment: Alignment | None = None  # measured once the realigned buckets exist
        # One partition keeps DDP's own buckets, except under the cost-model plan, whose one bucket is a choice.
        self._min_realign_buckets = 1 if ddp_optimizer is not None and ddp_optimizer.auto_plan else 2
        self._comm_hooks: list[tuple[Any, Callable]] = []
        self._realign_key = next_plan_namespace("realign")
        self._realign_decided = False
        # Either handle works: DDP's own forward runs these, so ddp_model(x) and compiled(x) are the same call.
        self._hooks = (ddp_model.register_forward_pre_hook(lambda module, args: self.before_forward()),
                       ddp_model.register_forward_hook(lambda module, args, out: self.after_forward()))
        self.own_hook = own_hook
        self.traced_hook = None  # the traced hooks' state, told of each backward in backward_context
        if own_hook is not None and traced is not None:
            self.traced_hook = own_hook.traced(ddp_model, traced)
        elif own_hook is not None:
            self._comm_hooks.append((own_hook.state, own_hook.bucket))
            ddp_model.register_comm_hook(own_hook.state, own_hook.bucket)
        self._ready = True  # from here on, setting one of DDP's public attributes sets it on DDP

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """``DistributedDataParallel.register_comm_hook``, kept across realignment."""
        if self.own_hook is not None:
            name = self.own_hook.name
            raise ValueError(
                f"register_comm_hook({getattr(hook, '__qualname__', hook)!r}): this model was compiled with "
                f"{self.own_hook.setting}, which all-reduces the gradients through a comm hook of its own, "
                f"and DDP calls one hook. Compile with {name}=None to reduce through your hook, or drop the "
                f"hook and keep {name}.")
        if self.traced is not None:
            raise RuntimeError(
                "register_comm_hook: this model was compiled with strategy='traced', whose gradients are "
                "all-reduced inside the compiled backward graph by the python reducer, which calls a hook per "
                "gradient with (grad, param): a DDP bucket hook cannot take that. Compile with strategy='split' "
                "(the default) to use a comm hook, or, to compress, pass reduce_dtype=torch.bfloat16."
            )
        self._comm_hooks.append((state, hook))
        self.ddp_model.register_comm_hook(state, hook)

    def _maybe_realign(self) -> None:
        """At the start of the first forward with gradients after the plan exists (the second
        one: the first compiles it), every rank at once: realign, with caps agreed by all ranks
        (Note [Plan agreement]), or not at all. Graphs without backward plan nothing, so an
        evaluation on rank 0 only never moves this point on that rank alone."""
        if not (self.align_buckets and not self._realign_decided and torch.is_grad_enabled()
                and reducer_finalized(self.ddp_model)):
            return
        buckets = [b for b in self.buckets if b.size > 0]
        if not buckets:
            return  # not compiled yet: the first forward
        self._realign_decided = True
        agreed, why = agree_on_caps(realign_caps(buckets), self._realign_key, self.ddp_model.process_group)
        if not agreed:
            warnings.warn(f"compile_ddp: DDP's buckets were not realigned with the partitions on any rank: {why}. "
                          "Training is correct; the gradients' all-reduces overlap backward less. Pass "
                          "align_buckets=False to skip realignment.", stacklevel=3)
        elif len(buckets) >= self._min_realign_buckets:
            hooks = python_comm_hooks(self.ddp_model)  # also those registered on DDP itself
            self.aligned_caps = realign_reducer(self.ddp_model, buckets, self._comm_hooks if hooks is None else hooks)
            self._buckets_changed()

    def _check_realigned(self) -> None:
        # DDP rebuilds its buckets at the start of a forward: measured right after it.
        if self.aligned_caps is not None and self.realignment is None and has_rebuilt_buckets(self.ddp_model):
            self.realignment = check_realignment(self.ddp_model, [b for b in self.buckets if b.size > 0])
            self._buckets_changed()

    def _buckets_changed(self) -> None:
        if self.own_hook is not None:
            self.own_hook.buckets_changed()

    @property
    def strategy(self) -> str:
        if self.traced is not None:
            return "traced"
        if self.block_buckets is not None:
            return "regional"
        return "split" if self.ddp_optimizer is not None else "whole"

    @property
    def buckets(self) -> list[Bucket]:
        if self.block_buckets is not None:
            return self.block_buckets
        return self.ddp_optimizer.buckets if self.ddp_optimizer is not None else []

    def save_compile_cache(self) -> str | None:
        """Save the compile artifacts and kernels to ``cache_dir`` (Note [Compile cache]).

        Call it after the first full step (forward and backward: AOTAutograd
        compiles the backward at the first backward), and again after new graphs
        compiled (a new shape); it is called automatically once, at the start of
        the second call, unless ``auto_save_cache`` is set False. Only local rank 0
        writes, and only what the entry does not hold yet (after a load: the
        graphs that missed). Returns the entry's path when one was written.
        """
        self._save_attempted = True
        path = save_on_local_rank0(self.compile_cache)
        return str(path) if path is not None else None

    @property
    def prediction(self) -> Timeline | None:
        """With ``bucket_cap_mb="auto"``: the last plan's predicted backward + comm timeline."""
        if self.traced is not None:
            return self.traced.prediction
        return self.ddp_optimizer.prediction if self.ddp_optimizer is not None else None

    def calibrate(self, measured_backward_s: float, measured_exposed_s: float | None = None) -> Calibration:
        """The prediction calibrated to a backward measured after warm-up, and the plan the
        calibrated model would choose (Note [Calibration from a measured backward]); the
        running plan is left as it is: ``compile_ddp(link=result.cost_model)`` plans
        ``result.best`` in the next run.

        Args:
            measured_backward_s: seconds of backward without communication, after warm-up
                (forward + backward minus forward of a ``no_sync`` step), the same on every rank.
            measured_exposed_s: optional, the exposed communication measured for this plan
                (a synchronised forward + backward minus the ``no_sync`` one): fits the CPU
                contention of the collective with backward.
        """
        planner = self.traced if self.traced is not None else self.ddp_optimizer
        if self.prediction is None:
            raise RuntimeError(
                "calibrate: this model has no cost-model prediction to calibrate. Only a plan the cost model "
                "made (bucket_cap_mb='auto'; under strategy='split' also fixed caps with link=...) has one, and "
                "only once its first forward compiled. Compile with bucket_cap_mb='auto' and call calibrate "
                "after a warm-up step.")
        if planner.planned_graphs > 1:
            raise RuntimeError(
                f"calibrate: the model was captured as {planner.planned_graphs} graphs with parameters (graph "
                "breaks), and the prediction covers only the last one, so a backward measured over the whole "
                "model cannot calibrate it. Remove the graph breaks (torch._dynamo.explain lists them) to "
                "calibrate.")
        result = calibrate(self.prediction, measured_backward_s, measured_exposed_s)
        result = replace(result, cost_model=calibrated_model(planner.cost_model, result))
        log.info("ddp_opt calibration: backward x%.2f (measured %.1f ms), contention %.2f ms/MiB; the plan's exposed "
                 "comm predicted %.1f ms; the calibrated model %s", result.scale, measured_backward_s * 1e3,
                 result.current.contention_s_per_byte * 2**20 * 1e3, result.current.exposed_s * 1e3,
                 f"would re-plan to {len(result.best.buckets)} bucket(s), {result.gain_s * 1e3:.1f} ms sooner"
                 if result.changes_plan else "keeps the plan")
        return result

    def backward_context(self) -> contextlib.AbstractContextManager:
        """What ``loss.backward()`` must run in: under ``strategy="traced"`` compiled autograd
        with the planned all-reduce fusion (Note [Traced strategy]); nothing under ``"split"``."""
        if self.traced is None:
            return contextlib.nullcontext()
        self._backward_pending = False
        if self.traced_hook is not None:  # PowerSGD's steps count these backwards (Note [Traced PowerSGD])
            return self.traced_hook.backward(self.traced.backward(), self.ddp_model.require_backward_grad_sync)
        return self.traced.backward()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)`` in :meth:`backward_context`: call this in place of
        ``loss.backward()``; it works for every strategy."""
        with self.backward_context():
            loss.backward(**kwargs)

    def _check_backward_path(self) -> None:
        if self.traced is None:
            return
        if self._backward_pending and not self._warned_plain_backward:
            self._warned_plain_backward = True
            warnings.warn(
                "compile_ddp(strategy='traced'): a forward ran again without compiled.backward(loss) since the "
                "last one. If that forward's backward ran as plain loss.backward(), its gradients were all-reduced "
                "one parameter at a time, eagerly, without overlap: correct, but slow (with compression, not counted "
                "toward its start, and in another bucket order than a compiled backward's). Call "
                "compiled.backward(loss) (or run it in compiled.backward_context()) instead of loss.backward(), or "
                "compile with strategy='split'.",
                stacklevel=3,
            )
        self._backward_pending = torch.is_grad_enabled()

    def before_forward(self) -> None:
        """What runs before each call of the DDP model (a forward pre-hook on it, so also
        when the loop calls the DDP model itself): the cache's save, realignment."""
        if self.auto_save_cache and self.compile_cache is not None and not self._save_attempted:
            self._calls += 1  # counted only while a save is pending
            if self._calls >= 2 and torch.is_grad_enabled():
                self.save_compile_cache()
        self._in_first_call = False
        self._maybe_realign()
        self._check_backward_path()
        if self.traced_hook is not None:
            self.traced_hook.check_complete()  # after a plain loss.backward(), which compiled.backward did not see

    def after_forward(self) -> None:
        """What runs after each call of the DDP model (a forward hook on it): the realigned
        buckets' measure; the step gate before a synchronised backward (Note [Step gate])."""
        self._check_realigned()
        if self.gate is None or self.traced is not None or not self._synchronised():
            return
        if self._in_first_call:  # the call this object was made in, counted by gate_from_next
            self._in_first_call = False
        elif self._gate_skip:
            self._gate_skip -= 1
        else:
            self.gate.meet()

    def _synchronised(self) -> bool:
        """Whether the running forward is one that a synchronised backward follows."""
        return torch.is_grad_enabled() and self.ddp_model.require_backward_grad_sync

    def gate_from_next(self) -> None:
        """Called when this object is made inside a forward of the DDP model (``compile_for_ddp``
        attaches in the first compiled call). That call's forward hook may or may not run (a
        module without hooks when the call began skips them), and ranks may attach in different
        calls (an evaluation on rank 0 only comes first): so every rank leaves its first
        synchronised forward ungated, the attach call or a later one, and all ranks meet from
        their second on."""
        self._in_first_call = True
        self._gate_skip = 0 if self._synchronised() else 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp_model(*args, **kwargs)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """DDP's class, for ``isinstance`` (Note [Looking like DDP]); ``type()`` still says CompiledDDP."""
        return type(self.__dict__["ddp_model"])

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set in __init__.
        return getattr(self.__dict__["ddp_model"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # DDP's own attributes (require_backward_grad_sync, require_forward_param_sync, ...) are set on
        # DDP, where its forward and reducer read them; everything else is this object's.
        if (self.__dict__.get("_ready") and not name.startswith("_") and name not in self.__dict__
                and not hasattr(type(self), name) and hasattr(self.ddp_model, name)):
            setattr(self.ddp_model, name, value)
        else:
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"CompiledDDP({self.ddp_model!r})"
