"""The traced strategy (``compile_ddp(..., strategy="traced")``): gradients all-reduced
inside one compiled backward graph, fused into buckets our plan chooses.

Note [Traced strategy]

Background
    The split strategy (Note [Bucket planning]) cuts the forward graph where DDP's
    buckets end; each cut is a graph break that loses fusion across it and adds a
    backward call. PyTorch's python reducer (``optimize_ddp="python_reducer"``)
    all-reduces each gradient from a post-accumulate-grad hook with functional
    collectives; compiled autograd traces the whole backward, hooks included, into one
    graph, and an Inductor pass fuses the all-reduces into buckets of one fixed size
    and moves each wait to its first use.

Algorithm
    - Convert: the DDP module switches to the python reducer
      (``_torch_internals.use_python_reducer``), as ``python_reducer`` does, and its
      C++ reducer, detached, is re-created over one placeholder element. Rule and
      reason: that reducer keeps a flat buffer per bucket, one more copy of every
      gradient, which nothing writes under the python reducer and which it hands only
      to a comm hook; PyTorch's ``python_reducer`` keeps it for the whole run.
    - Forward: compiled whole. With ``bucket_cap_mb="auto"`` the cost-model DP
      (Note [Cost-model bucket plan]) plans it with ``gamma = 0`` (a boundary costs no
      break here) over chunks of at least ``CostModel.min_bucket_bytes``, the first
      chunk a bucket alone. Otherwise the caps are DDP's, the first bucket at most
      ``FIRST_BUCKET_CAP`` unless DDP was given a per-bucket list. Rule and reason:
      many tiny buckets, or a large first one, lose the overlap in the compiled graph
      (measured: docs/ddp.md, docs/benchmarks/reading.md).
    - Backward: ``compiled.backward(loss)`` runs under compiled autograd with our pass
      (:class:`FuseByPlan`) in place of Inductor's fixed-size one: the all-reduces, in
      gradient-ready order, are grouped by ``group_by_caps`` (bucket k closes when its
      bytes reach cap k) into one concatenated all-reduce each; Inductor's
      ``schedule_comm_wait`` delays each wait to its first use.
    - One buffer per bucket (``reduce_in_place``): each gradient is divided into its
      slice of the concatenation, which is all-reduced in place. Rule and reason: the
      fusion divides the concatenation and all-reduces the quotient out of place, and
      Inductor lowers that as a copy, so the gradients, the concatenation and the copy
      were live at once (measured at batch 1: a step's own peak of 36.0 MiB, about three
      times its largest bucket, 11.6 MiB).
    - Write-back last (:func:`delay_write_back`): what reads an all-reduce's result and
      feeds no collective (the split of a fused bucket, the cast back from a narrower
      dtype, the copy into the gradient) moves down to just before its first user, never
      past an op that may write to what it reads (another bucket's in-place all-reduce
      writes only its own buffer). Rule and reason: Inductor's fusion pass can leave a
      bucket's write-back right after its all-reduce (where a gradient of the bucket had
      its own), so the wait, delayed only to its first use, stayed there and backward
      stopped until the bucket had crossed the link; which buckets did so depended on
      their exact boundaries, so a plan could lose its overlap by one small tensor.
    - Inductor's peak-memory reordering (``reorder_for_peak_memory``) is off for a
      backward that all-reduces: its topological sorts know nothing of overlap, and can
      pull each wait up to its all-reduce (where backward adds into existing ``.grad``)
      or issue every all-reduce after the last gradient. The price is memory: the
      buckets live to the end of backward, unless the optimizer's updates, placed two
      buckets behind (Note [Traced update]), free them. A ``no_sync`` backward keeps the pass.
    - Every rank traces the same backward and plans from rank 0's cost model, so the
      buckets agree.

Notes
    - Fusion is an Inductor pass: with ``aot_eager`` the gradients are all-reduced one
      per parameter, still inside the compiled graph.
    - What it cannot run falls back to the split strategy with a warning
      (``fallback_reason``): a torch without the pieces, a comm hook already
      registered, ``find_unused_parameters=True`` (unmatched all-reduces), DDP mixed
      precision. ``no_sync()`` works: compiled autograd compiles that backward apart.
    - FlexAttention inside an activation-checkpointed region is refused at the first forward, before
      any step (``refuse_untraceable``): the backward recomputes it, and dynamo fails to trace the
      recomputed op when compiled autograd traces that backward (torch 2.11 on an H200, 2.15 on CPU).
      It is found only in the captured graph, too late to fall back to the split strategy, which
      runs it (tests/gpu/test_gpu_flex_attention.py).
    - Debugging: ``compiled.traced.fused`` lists, per compiled backward, the fused
      buckets' byte sizes; a backward loaded from Inductor's FX graph cache records nothing.
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
from compiler.ranks import StepGate

from ..._torch_internals import registered_hook_name
from ._torch_internals import (checkpointed_flex_attention, comm_role, custom_graph_pass_base, fuse_ddp_allreduces,
                               has_all_reduce, memory_reorder_off, mutates, reduce_in_place, traced_backward,
                               traced_strategy_missing)
from .placement import readers_of_reductions, sink_updates
from ...planning.solver import Timeline
from ...planning.cost import CostModel
from ...planning.auto import describe, plan_auto
from ...planning.buckets import BucketCaps, group_by_caps, split_caps

log = logging.getLogger(__name__)

__all__ = ["FIRST_BUCKET_CAP", "IN_BACKWARD_BUCKETS", "TracedPlan", "FuseByPlan", "delay_write_back", "fallback_reason",
           "refuse_untraceable"]

FIRST_BUCKET_CAP = 1 << 20  # bytes: the largest first bucket under fixed caps (Note [Traced strategy])
IN_BACKWARD_BUCKETS = 8  # with the optimizer in backward, auto buckets hold at most 1/8 of a graph's gradients


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
    if getattr(ddp_model, "require_manual_backward_finalization", False):  # torch >= 2.15
        return ("require_manual_backward_finalization=True: the python reducer it runs has no manual finalization, "
                "and DDP's finalize_backward() raises under it")
    return None


def refuse_untraceable(gm: fx.GraphModule) -> None:
    """Raise, before the first step, when the captured forward ``gm`` holds what compiled autograd cannot
    trace in its backward: FlexAttention inside an activation-checkpointed region."""
    regions = checkpointed_flex_attention(gm)
    if regions:
        raise RuntimeError(
            f"compile_ddp(strategy='traced'): this model calls FlexAttention inside {len(regions)} "
            f"activation-checkpointed region(s) (checkpoint called at {', '.join(dict.fromkeys(regions))}), and the "
            "traced strategy cannot run that. "
            "Its backward runs under compiled autograd, which traces the backward again with dynamo; the "
            "backward recomputes each checkpointed FlexAttention, and dynamo fails on the op it recomputes "
            "(\"too many values to unpack (expected 7)\", seen on torch 2.11 and 2.15). Use strategy='split' "
            "(the default), which trains this model as eager DDP does, or call FlexAttention outside "
            "torch.utils.checkpoint.")


class FuseByPlan(custom_graph_pass_base()):
    """Inductor's DDP-fusion pass slot, grouping the traced all-reduces by a :class:`TracedPlan`.
    A ``CustomGraphPass``: its ``uuid`` (the caps) keeps Inductor's FX graph cache on."""

    def __init__(self, plan: TracedPlan) -> None:
        self.plan = plan

    def __call__(self, graph: fx.Graph) -> None:
        # With the optimizer in backward, the update reads each reduced gradient (Note [Traced update]).
        fuse_ddp_allreduces(graph, self.plan.group, any_readers=self.plan.updates_in_backward)
        log.debug("ddp_opt traced backward: %d fused bucket(s) reduced in place", reduce_in_place(graph))
        if self.plan.updates_in_backward:
            moved = sink_updates(graph)
        else:
            moved = delay_write_back(graph)
            log.debug("ddp_opt traced backward: %d node(s) reading all-reduced gradients moved to their first use",
                      moved)

    def uuid(self) -> Any:
        # "5": the pass's version (sink_updates by lag); bump it when the pass changes, Inductor's cache keys on it.
        return f"distcompile.FuseByPlan:5:{self.plan.caps!r}:{self.plan.updates_in_backward}"


def _writes_for(spot: fx.Node, node: fx.Node) -> bool:
    """Whether ``spot`` may write to memory ``node`` reads: any op that may mutate, except a collective reducing
    another bucket in place (``reduce_in_place``), which writes only that bucket's buffer."""
    if comm_role(spot) == "collective" and spot.args and isinstance(spot.args[0], fx.Node):
        return mutates(spot) and spot.args[0] in node.all_input_nodes
    return mutates(spot)


def delay_write_back(graph: fx.Graph) -> int:
    """Move every node that reads an all-reduce's result (through its wait) and feeds no
    collective down to just before its first user, never past an op that may write to what it reads
    (Note [Traced strategy]). The graph stays in topological order. Returns how many nodes moved."""
    nodes = list(graph.nodes)
    feeds_comm, after_wait = readers_of_reductions(nodes)
    movable = [node for node in nodes if node in after_wait and node not in feeds_comm
               and node.op == "call_function" and not mutates(node)]
    moved = 0
    for node in reversed(movable):  # users first: each goes below where its first user now is
        spot = node.next
        while spot.op != "output" and spot not in node.users and not _writes_for(spot, node):
            spot = spot.next
        if spot is not node.next:
            spot.prepend(node)
            moved += 1
    return moved


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
        self.updates_in_backward = False  # set by strategies.traced.update.attach_traced

    def forward_backend(self, backend_fn: Callable) -> Callable:
        """The forward's backend: refuse what the traced backward cannot run (:func:`refuse_untraceable`);
        with ``auto``, plan from the graph; then compile it whole."""

        def check_plan_compile(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable:
            refuse_untraceable(gm)
            if self.auto:
                self._plan(gm)
            return backend_fn(gm, example_inputs, **kwargs)

        return check_plan_compile

    def _plan(self, gm: fx.GraphModule) -> None:
        caps, buckets, timeline = plan_auto(gm, self.cost_model)
        params = frozenset(p for b in buckets for p in b.params)
        if not params:
            return  # a graph without parameters (a loss after a graph break) has no gradients to plan
        # A recompile of a graph replaces its plan; graphs run later hold earlier-ready gradients.
        planned, cut = caps.per_bucket_caps, ""
        if self.updates_in_backward:  # Note [Traced update]: a bucket's gradients live until its update
            most = max(sum(b.size for b in buckets) // IN_BACKWARD_BUCKETS, self.cost_model.min_bucket_bytes)
            planned, cut = split_caps(planned, most), f"; with the optimizer in backward, cut to caps of {most} bytes"
        self._graph_caps[params] = planned
        ordered = [c for graph_caps in reversed(self._graph_caps.values()) for c in graph_caps]
        self.caps = BucketCaps(ordered[0], per_bucket_caps=tuple(ordered))
        self.prediction = timeline
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
            log.info("ddp_opt traced plan: %d bucket(s) fused in the backward graph%s\n%s", len(buckets), cut,
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
