"""CompiledDDP: what the training loop calls in place of the DDP model that
``compile_ddp`` compiled, and what it keeps: the plan, bucket realignment, the
compile cache and, under ``strategy="traced"``, the backward context.

Note [Looking like DDP]

Background
    Frameworks find the model inside a DDP wrapper by ``isinstance(model,
    DistributedDataParallel)`` and then ``model.module``: Accelerate's
    ``unwrap_model`` (``extract_model_from_parallel``) and ``trigger_sync_in_backward``,
    the HF Trainer's save path. ``model = compile_prepared(accelerator.prepare(model))``
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
from compiler.ranks import CompileShare, StepGate

from .alignment.measure import Alignment
from .planning.solver import Timeline
from .planning.calibrate import Calibration, calibrate, calibrated_model
from .compression.hooks import OwnHook
from .control import ControlFacts, ControlLine
from .handle_parts import CacheAutoSave, CommHooks, GateHook, Realigner
from .strategies.traced.backward import TracedBackward
from .strategies.split import DDPOptimizer
from .planning.buckets import Bucket
from .strategies.traced.plan import TracedPlan
from .in_backward.stepper import BucketStep

log = logging.getLogger(__name__)

__all__ = ["CompiledDDP"]


class CompiledDDP:
    """What the training loop calls in place of the DDP model.

    Calling it calls the DDP model, whose wrapped module ``compile_ddp`` compiled
    in place; what this object adds (realignment, the cache's save, the step gate,
    the traced strategy's checks) runs from hooks on the DDP model, so calling the
    DDP model itself is the same. Each of those is a part of its own
    (``ddp_opt.handle_parts``); this object forwards attributes and delegates. Every other attribute (``parameters``, ``no_sync``, ``state_dict``,
    ``module``, ...) is the DDP model's, and checkpoints keep DDP's keys; setting
    one of DDP's attributes sets it on the DDP model (nanoGPT's
    ``model.require_backward_grad_sync = last_micro_step``).

    Attributes:
        ddp_model: the wrapped DDP module.
        splitter: the splitter, or None under the strategies that do not split.
        align_buckets: re-create DDP's reducer once, after the first step, so that
            its buckets equal the partitions (Note [Bucket realignment]).
        aligned_caps: the caps given to the reducer, once realigned.
        realignment: the alignment of the realigned buckets, measured (and warned
            about when below 1.0) in the forward where DDP rebuilt them.
        block_buckets: with regional compile, the buckets of whole blocks
            (Note [Regional compile]); None otherwise.
        compile_cache: the :class:`compiler.cache.store.CompileCache` with
            ``cache_dir``, else None; saved by :meth:`save_compile_cache`.
        share: the :class:`compiler.ranks.share.CompileShare` of DDP's group (its
            ``stats`` say what this rank compiled, loaded and waited for), or
            None on one rank.
        gate: the :class:`compiler.ranks.step_gate.StepGate` of DDP's group (Note [Step
            gate]), or None (one rank, or ``step_gate=False``).
        traced: under ``strategy="traced"``, its plan (Note [Traced strategy]); else None.
        own_hook: with ``reduce_dtype`` or ``compression``, the comm hook registered here and kept
            across realignment (Note [Reduced-precision all-reduce], Note [PowerSGD compression]);
            else None.
        traced_hook: under ``strategy="traced"`` with ``compression``, the traced hooks' state
            (``ddp_opt.strategies.traced.powersgd.TracedPowerSGD``: memories, step count); else None.
        in_backward: with ``optimizer=``, the :class:`ddp_opt.in_backward.BucketStep` that updates each
            bucket inside backward (``updates`` counts them; Note [Optimizer in backward]); else None.
        strategy: the strategy in use (``ddp_opt.config.STRATEGIES``; ``"split"`` also
            when ``"traced"`` was asked for and fell back, with a warning).
        control: the line that says once that ddp_opt is in control, a
            :class:`ddp_opt.control.ControlLine` (Note [In control, once]): ``control.line``
            once said; a framework route calls ``control.in_framework``.
    """

    def __init__(self, ddp_model: DistributedDataParallel, splitter: DDPOptimizer | None,
                 align_buckets: bool = False, *, strategy: str, block_buckets: list[Bucket] | None = None,
                 compile_cache: CompileCache | None = None, share: CompileShare | None = None,
                 traced: TracedPlan | None = None, gate: StepGate | None = None,
                 own_hook: OwnHook | None = None, in_backward: BucketStep | None = None,
                 control: ControlFacts | None = None) -> None:
        self.ddp_model = ddp_model
        self.strategy = strategy
        self.splitter = splitter
        self.block_buckets = block_buckets
        self.compile_cache = compile_cache
        self.share = share
        self.gate = gate
        self.traced = traced
        self.own_hook = own_hook
        self.in_backward = in_backward
        self._comm_hooks = CommHooks(ddp_model, own_hook, traced=traced is not None, stepper=in_backward)
        planned = splitter is not None or block_buckets is not None
        # One partition keeps DDP's own buckets, except under the cost-model plan, whose one bucket is a choice.
        auto = splitter is not None and splitter.auto_plan
        self._realigner = Realigner(ddp_model, lambda: self.buckets, enabled=align_buckets and planned,
                                    min_buckets=1 if auto else 2, comm_hooks=self._comm_hooks,
                                    on_change=own_hook.buckets_changed if own_hook is not None else None)
        self._cache_save = CacheAutoSave(compile_cache)
        # Under the reducer, the ranks meet after each forward that a synchronised backward follows;
        # under the traced strategy inside the backward, once it compiled (Note [Step gate]).
        self._gate_hook = GateHook(gate, ddp_model) if gate is not None and traced is None else None
        self._traced_backward = (TracedBackward(traced, ddp_model, own_hook, in_backward) if traced is not None
                                 else None)
        self.control = ControlLine(ddp_model, control or ControlFacts(), strategy=strategy,
                                   buckets=lambda: self.buckets, realigner=self._realigner, traced=traced,
                                   auto=auto or (traced is not None and traced.auto))
        # Either handle works: DDP's own forward runs these, so ddp_model(x) and compiled(x) are the same call.
        self._hooks = (ddp_model.register_forward_pre_hook(lambda module, args: self.before_forward()),
                       ddp_model.register_forward_hook(lambda module, args, out: self.after_forward()))
        self._ready = True  # from here on, setting one of DDP's public attributes sets it on DDP

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """``DistributedDataParallel.register_comm_hook``, kept across realignment."""
        self._comm_hooks.register(state, hook)

    @property
    def align_buckets(self) -> bool:
        return self._realigner.enabled

    @property
    def aligned_caps(self) -> tuple[int, ...] | None:
        return self._realigner.aligned_caps

    @property
    def realignment(self) -> Alignment | None:
        return self._realigner.realignment

    @property
    def traced_hook(self) -> Any:
        return self._traced_backward.hook if self._traced_backward is not None else None

    @property
    def auto_save_cache(self) -> bool:
        return self._cache_save.enabled

    @auto_save_cache.setter
    def auto_save_cache(self, value: bool) -> None:
        self._cache_save.enabled = value

    @property
    def buckets(self) -> list[Bucket]:
        if self.block_buckets is not None:
            return self.block_buckets
        return self.splitter.buckets if self.splitter is not None else []

    def save_compile_cache(self) -> str | None:
        """Save the compile artifacts and kernels to ``cache_dir`` (Note [Compile cache]).

        Call it after the first full step (forward and backward: AOTAutograd
        compiles the backward at the first backward), and again after new graphs
        compiled (a new shape); it is called automatically once, at the start of
        the second call, unless ``auto_save_cache`` is set False. Only local rank 0
        writes, and only what the entry does not hold yet (after a load: the
        graphs that missed). Returns the entry's path when one was written.
        """
        return self._cache_save.save()

    @property
    def prediction(self) -> Timeline | None:
        """With ``bucket_cap_mb="auto"``: the last plan's predicted backward + comm timeline."""
        if self.traced is not None:
            return self.traced.prediction
        return self.splitter.prediction if self.splitter is not None else None

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
        planner = self.traced if self.traced is not None else self.splitter
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

    @property
    def ddp_optimizer(self) -> DDPOptimizer | None:
        """The old name of :attr:`splitter`, which read like ``optimizer=`` (the optimizer in backward)."""
        warnings.warn("CompiledDDP.ddp_optimizer is now CompiledDDP.splitter (the graph splitter under "
                      "strategy='split', else None); the old name goes in a later release.", FutureWarning, stacklevel=2)
        return self.splitter

    def backward_context(self) -> contextlib.AbstractContextManager:
        """What ``loss.backward()`` must run in: under ``strategy="traced"`` compiled autograd
        with the planned all-reduce fusion (Note [Traced strategy]); nothing under ``"split"``."""
        if self._traced_backward is None:
            return contextlib.nullcontext()
        return self._traced_backward.context()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)`` in :meth:`backward_context`: call this in place of
        ``loss.backward()``; it works for every strategy."""
        with self.backward_context():
            loss.backward(**kwargs)

    def before_forward(self) -> None:
        """What runs before each call of the DDP model (a forward pre-hook on it, so also
        when the loop calls the DDP model itself): the cache's save, realignment."""
        self._cache_save.before_forward()
        if self._gate_hook is not None:
            self._gate_hook.before_forward()
        self._realigner.before_forward()
        if self._traced_backward is not None:
            self._traced_backward.before_forward()

    def after_forward(self) -> None:
        """What runs after each call of the DDP model (a forward hook on it): the realigned
        buckets' measure; the line that says ddp_opt is in control; the step gate before a
        synchronised backward (Note [Step gate])."""
        self._realigner.after_forward()
        self.control.after_forward()
        if self._gate_hook is not None:
            self._gate_hook.after_forward()

    def gate_from_next(self) -> None:
        """Called when this object is made inside a forward of the DDP model (``compile_for_ddp``
        attaches in the first compiled call): every rank leaves its first synchronised forward
        ungated and all ranks meet from their second on (``GateHook.from_next``)."""
        if self._gate_hook is not None:
            self._gate_hook.from_next()

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
