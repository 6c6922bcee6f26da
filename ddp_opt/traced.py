"""The traced strategy (``compile_ddp(..., strategy="traced")``): gradients all-reduced
inside one compiled backward graph, fused into buckets our plan chooses.

Note [Traced strategy]

Background
    The split strategy (Note [Bucket planning]) cuts the forward graph where DDP's
    buckets end, so that DDP's C++ reducer can all-reduce a bucket while the
    backward of the next partition runs. Each cut is a graph break: fusion across
    it is lost, and each partition's backward is a separate call. PyTorch's
    python reducer (``optimize_ddp="python_reducer"``) takes the other road: DDP
    registers a post-accumulate-grad hook per parameter that all-reduces its
    gradient with functional collectives, compiled autograd traces the whole
    backward, hooks included, into one graph, and an Inductor pass fuses the
    per-gradient all-reduces into buckets of one fixed size (1 MiB first, then
    the cap) and moves each wait to its first use.

Algorithm
    - Convert: the built DDP module switches to the python reducer
      (``_torch_internals.use_python_reducer``): the C++ reducer's hooks are
      removed and the per-parameter all-reduce hooks registered, as
      ``DistributedDataParallel.__init__`` does under ``python_reducer``.
    - Forward: the wrapped module's forward is compiled whole (no split). With
      ``bucket_cap_mb="auto"`` its graph is planned first by the cost-model DP
      (Note [Cost-model bucket plan]) with ``gamma = 0``, since a bucket boundary
      here costs no graph break, over chunks of at least 1 MiB
      (``CostModel.min_bucket_bytes``) with the first chunk a bucket alone; the plan's per-bucket byte sizes become
      the caps. A plan with smaller buckets lost the overlap in the compiled graph: with a
      link fitted at zero latency the DP over single units chose 27 buckets, down
      to 2 KiB, and the step took 260.4 ms against 185.1 ms with 1 MiB buckets
      (2 nodes, 800 Mbit, 4x256 GPT, one interleaved sweep).
      Without it, the caps are DDP's (first bucket, then ``bucket_cap_mb``), the
      first bucket capped at 1 MiB (``FIRST_BUCKET_CAP``) unless DDP was given a
      per-bucket list: in the compiled graph a large first bucket lost the overlap
      (2 nodes, 800 Mbit, 4x256 GPT: 282.8 ms per step with a 4 MiB first bucket,
      216.5 ms with 1 MiB then 4 MiB, where DDP's reducer keeps it with 4 MiB).
    - Backward: ``compiled.backward(loss)`` runs ``loss.backward()`` under
      compiled autograd with Inductor's DDP fusion on and our pass
      (:class:`FuseByPlan`) in place of its fixed-size one: the all-reduce blocks,
      in graph (gradient-ready) order, are grouped greedily by ``group_by_caps``
      (bucket k closes when its bytes reach cap k) and each group becomes one
      concatenated all-reduce; Inductor's ``schedule_comm_wait`` then delays each
      wait to its first use, so the collectives run against the rest of backward.
    - Inductor's peak-memory reordering (``reorder_for_peak_memory``, the
      scheduler's last pass) is off for a backward that all-reduces. It picks the
      order of lowest estimated peak among graph order and three topological sorts,
      and the sorts know nothing of overlap. Two ways it lost the overlap (GPT
      4x256, 12.6 MiB of gradients, generated code read):
      - where backward adds to existing gradients (a compiled optimizer's
        ``zero_grad(set_to_none=False)``, the synchronised step of gradient
        accumulation), each bucket's copy-back into ``.grad`` frees the bucket, so
        a sort moved the copy-back, and with it the wait, up to the bucket's
        all-reduce (estimated peak 6.4 MB against 16.8 MB in graph order);
      - where gradients are made anew, graph order and the best sort estimate
        within 1 to 4% of each other, and the bucket boundaries decide: with
        the traced auto plan of a sweep that lost its overlap (12 buckets of
        about 1 MiB, then 0.56 MiB) a depth-first sort won (16.57 against
        16.84 MB) and issued every all-reduce after the last gradient; with
        caps of 1.5 and 2 MiB a sort pulled the waits up again; with 0.5, 1, 3
        and 4 MiB graph order won.
      PyTorch's python reducer still runs that pass. The cost is memory: where
      gradients are made anew at most the 1 to 4% above; where they are added to,
      the buckets live until the end of backward, up to the gradients' size again
      (the 10.4 MB above). A ``no_sync`` backward has no all-reduce and keeps the
      pass (16.5 MB against 6.4 MB there).
    - Every rank traces the same backward and plans from the same graph and the
      same cost model (rank 0's measurement, broadcast), so the buckets agree.

Notes
    - Fusion is an Inductor pass: with another backend (``aot_eager``) the
      gradients are all-reduced one per parameter, still inside the compiled graph.
    - What it cannot run falls back to the split strategy with a warning (see
      ``fallback_reason``): a torch without the pieces, a comm hook already
      registered, ``find_unused_parameters=True`` (a parameter without gradient
      on one rank would leave the ranks' all-reduces unmatched), DDP mixed precision.
    - ``no_sync()`` works: the hooks skip the all-reduce while DDP's
      ``require_backward_grad_sync`` is False; compiled autograd compiles that
      backward as a graph of its own.

Debugging
    - ``compiled.traced.fused`` lists, per compiled backward, the fused buckets'
      byte sizes in gradient-ready order; INFO logs them, and the auto plan's table.
      A backward loaded from Inductor's FX graph cache (keyed with the pass's
      ``uuid``, the caps) is fused as when compiled and records nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import fx
from torch.nn.parallel import DistributedDataParallel

from compiler import BackendFn
from compiler.step_gate import StepGate

from ._torch_internals import (custom_graph_pass_base, fuse_ddp_allreduces, has_all_reduce, memory_reorder_off,
                               registered_hook_name, traced_backward, traced_strategy_missing)
from .autoplan import Timeline
from .cost import CostModel
from .graph_plan import describe, plan_auto
from .plan import BucketCaps, group_by_caps

log = logging.getLogger(__name__)

__all__ = ["FIRST_BUCKET_CAP", "TracedPlan", "FuseByPlan", "fallback_reason"]

FIRST_BUCKET_CAP = 1 << 20  # bytes: the largest first bucket under fixed caps (Note [Traced strategy])


def fallback_reason(ddp_model: DistributedDataParallel) -> str | None:
    """Why ``strategy="traced"`` cannot run on ``ddp_model`` (it then splits), or None."""
    missing = traced_strategy_missing()
    if missing is not None:
        return f"this torch lacks what it needs: {missing}"
    hook = registered_hook_name(ddp_model)
    if hook is not None:
        return (f"the comm hook {hook!r} is registered on this DDP module, and the python reducer calls a hook per "
                "gradient with (grad, param), which a bucket hook cannot take (reduce_dtype= compresses without one)")
    if ddp_model.find_unused_parameters:
        return ("find_unused_parameters=True: a parameter without a gradient on one rank would leave the ranks' "
                "traced all-reduces unmatched")
    if getattr(ddp_model, "mixed_precision", None) is not None:
        return "DDP's mixed_precision is not applied by the python reducer"
    return None


class FuseByPlan(custom_graph_pass_base()):
    """Inductor's DDP-fusion pass slot, grouping the traced all-reduces by a :class:`TracedPlan`.
    A ``CustomGraphPass``: its ``uuid`` (the caps) keeps Inductor's FX graph cache on."""

    def __init__(self, plan: TracedPlan) -> None:
        self.plan = plan

    def __call__(self, graph: fx.Graph) -> None:
        fuse_ddp_allreduces(graph, self.plan.group)

    def uuid(self) -> Any:
        return f"distcompile.FuseByPlan:{self.plan.caps!r}"


class TracedPlan:
    """The traced strategy's bucket plan and the contexts it runs in.

    Args:
        caps: the caps to fuse by (DDP's; the first bucket at most ``FIRST_BUCKET_CAP`` unless
            they are a per-bucket list), replaced by the cost-model plan when ``auto``.
        backend_fn: the backend the backward graph is compiled with.
        cost_model: with ``auto``, what the plan is chosen by.
        auto: plan from the forward graph (``bucket_cap_mb="auto"``).
        wire_scale: gradient bytes per byte all-reduced: 2.0 for fp32 gradients reduced in bf16
            (Note [Reduced-precision all-reduce]); the caps count gradient bytes, as DDP's do.

    Attributes:
        caps: the caps in use (gradient-ready order).
        prediction: with ``auto``, the predicted timeline of the plan.
        fused: per compiled backward, the byte sizes of the fused all-reduces (gradient-ready order;
            in the reduce dtype with ``reduce_dtype``).
    """

    def __init__(self, caps: BucketCaps, backend_fn: BackendFn, cost_model: CostModel | None = None,
                 auto: bool = False, gate: StepGate | None = None, wire_scale: float = 1.0) -> None:
        self.caps = caps if caps.per_bucket_caps else BucketCaps(
            caps.bucket_bytes_cap, min(caps.cap_for(0), FIRST_BUCKET_CAP))
        self.backend_fn = backend_fn
        self.cost_model = replace(cost_model, gamma_s=0.0) if cost_model is not None else None
        self.auto = auto and cost_model is not None
        self.prediction: Timeline | None = None
        self.fused: list[list[int]] = []
        self._graph_caps: dict[frozenset, tuple[int, ...]] = {}  # params of a forward graph -> its planned caps
        self.gate = gate
        self.wire_scale = wire_scale

    def forward_backend(self, backend_fn: Callable) -> Callable:
        """The forward's backend: with ``auto``, plan from the graph first, then compile it whole."""
        if not self.auto:
            return backend_fn

        def plan_then_compile(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable:
            self._plan(gm)
            return backend_fn(gm, example_inputs, **kwargs)

        return plan_then_compile

    def _plan(self, gm: fx.GraphModule) -> None:
        caps, buckets, timeline = plan_auto(gm, self.cost_model)
        params = frozenset(p for b in buckets for p in b.params)
        if not params:
            return  # a graph without parameters (a loss after a graph break) has no gradients to plan
        # A recompile of a graph replaces its plan; graphs run later hold earlier-ready gradients.
        self._graph_caps[params] = caps.per_bucket_caps
        ordered = [c for graph_caps in reversed(self._graph_caps.values()) for c in graph_caps]
        self.caps = BucketCaps(ordered[0], per_bucket_caps=tuple(ordered))
        self.prediction = timeline
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
            log.info("ddp_opt traced plan: %d bucket(s) fused in the backward graph\n%s", len(buckets),
                     describe(timeline, buckets))

    @property
    def planned_graphs(self) -> int:
        """Captured graphs planned so far that hold parameters."""
        return len(self._graph_caps)

    def group(self, sizes: list[int]) -> list[int]:
        """Called by :class:`FuseByPlan`: bucket lengths for the traced gradients of ``sizes`` bytes."""
        lengths = group_by_caps([round(size * self.wire_scale) for size in sizes], self.caps)
        if not lengths:
            return lengths  # a graph without the reducer's all-reduces (a forward, a no_sync backward)
        start, fused = 0, []
        for n in lengths:
            fused.append(sum(sizes[start:start + n]))
            start += n
        self.fused.append(fused)
        log.info("ddp_opt traced backward: %d all-reduce(s) of %s bytes", len(fused), fused)
        return lengths

    def compile_backward(self, gm: fx.GraphModule) -> Callable:
        """compiled autograd's compiler: the whole backward graph, our fusion pass in Inductor."""
        # A plain function, not the bound method: Lightning wraps torch.compile at import and deep-copies
        # the keywords of each call on a module, and this plan holds the step gate's store, which cannot be copied.
        return torch.compile(gm, backend=lambda g, inputs, **kw: self._backward_backend(g, inputs, **kw),
                             fullgraph=True)

    def _backward_backend(self, gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable:
        if not has_all_reduce(gm):  # a no_sync backward: Inductor's memory order, nothing to overlap
            return self.backend_fn(gm, example_inputs, **kwargs)
        with memory_reorder_off():  # the waits stay where schedule_comm_wait put them (Note [Traced strategy])
            compiled = self.backend_fn(gm, example_inputs, **kwargs)
        return compiled if self.gate is None else gated(compiled, self.gate)

    def backward(self) -> contextlib.AbstractContextManager:
        """The context ``loss.backward()`` runs in under this strategy."""
        return traced_backward(self.compile_backward, [FuseByPlan(self), "schedule_comm_wait"])


def gated(compiled: Callable, gate: StepGate) -> Callable:
    """``compiled`` (a backward graph holding all-reduces) meeting the step gate before each
    run: after compiled autograd compiled it, on this rank or not, before its first
    all-reduce (Note [Step gate]). Called as ``compiled`` is (its attributes, such as a
    boxed calling convention, are kept)."""

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        gate.meet()
        return compiled(*args, **kwargs)

    return run
