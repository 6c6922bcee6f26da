"""DDPOptimizer: a dynamo backend that splits a captured graph at gradient-bucket
boundaries and compiles each piece lazily (see Note [Bucket planning] and
Note [Lazy partition compile]).

A drop-in for ``torch._dynamo.backends.distributed.DDPOptimizer``: same
constructor, ``compile_fn`` usable as a dynamo backend, ``buckets`` kept after a
compile. What it does differently:

- caps follow DDP's real rebuilt buckets: a first-bucket cap and per-bucket caps
  (``bucket_caps``) are honoured, and a parameter used twice is counted once;
- parameters ignored by DDP are recognised on dynamo's lifted placeholders
  (PyTorch's splitter looks at the fake copy, where the marker is lost);
- a failing partition runs eagerly with a warning naming it, or raises
  (``fallback="raise"``), and every partition's outcome is kept in ``records``;
- a model with graph breaks is planned as a whole (Note [Plans across graphs]);
- a graph that runs no backward (an evaluation under ``no_grad``, often on rank 0
  only) is compiled whole: it has no gradients to bucket, so it is neither planned
  nor checked against the other ranks, and DDP's buckets never follow it.

Note [Plans across graphs]

Background
    A graph break inside the model (a ``print``, a data-dependent branch, a
    library's ``warning_once`` in a loss computed by the model) gives dynamo
    several graphs per forward, and each reaches the backend alone. DDP's
    reducer, however, buckets the gradients of the whole model. A splitter that
    keeps only the last graph's plan (PyTorch's overwrites ``buckets`` per graph)
    reports the loss graph's one empty bucket for a model that computes its own
    loss, and realignment then sees nothing to align.

Algorithm
    Each graph's plan is kept under the graph's slot: the frame dynamo compiled
    it from (a graph break resumes in a new frame; a recompile of the same graph
    keeps its frame, and its new plan replaces the old). ``buckets`` is the union
    of the plans of graphs with parameters, graphs in the order they first ran:
    forward order, so its reverse is the order in which the gradients become
    ready (the last graph's backward runs first). Realignment gives DDP that
    union's sizes as its caps, so runtime buckets equal the partitions of every
    graph.

Notes
    - Parameters used outside every graph (in eager code between two graphs)
      are in no partition; DDP buckets them where their gradients arrive, and
      ``compile_ddp`` warns when the realigned buckets do not match the
      partitions (see ``ddp_opt.api``).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.nn.parallel import DistributedDataParallel

from compiler import (FALLBACKS, BackendFn, PartitionRecord, compile_partitions,
                      produces_gradients, split_graph)
from compiler.graph import DYNAMO_CONTROL_FLOW
from compiler.ranks import StepGate

from .._torch_internals import default_first_bucket_bytes, graph_slot, trace_artifact
from ..config import DDPCompileConfig
from ..advice import API_SPELLING, DIRECT_SPELLING, Spelling
from ..alignment.agreement import PLAN_TIMEOUT_S, next_plan_namespace, peers_plans_if_ready, publish_plan, verify_plans
from ..planning.solver import Timeline
from ..planning.cost import CostModel
from ..planning.auto import describe, plan_auto, predict_plan
from ..planning.buckets import Bucket, BucketCaps, format_buckets, partition_map, plan_buckets, plan_details
from .base import Built, Setup, caps_from_ddp

log = logging.getLogger(__name__)
graph_log = logging.getLogger(__name__ + ".graphs")  # graph dumps, off unless asked for

__all__ = ["DDPOptimizer", "SPLIT_REASON", "build", "split_reason", "splitter_for"]



def split_reason(spelling: Spelling) -> str:
    """The graph-break reason of each split, in the spelling of the entry point;
    it starts as PyTorch's splitter's does, which tools look for."""
    return (
        "DDPOptimizer intentional graph-break (ddp_opt): split at a DDP gradient-bucket boundary so that the "
        "bucket's all-reduce can start while backward goes on (see Note [Bucket planning]). To compile "
        f"without splitting, {spelling.no_split}."
    )


SPLIT_REASON = split_reason(API_SPELLING)  # as compile_ddp writes it


def _default_first_bucket_cap(bucket_bytes_cap: int) -> int:
    # PyTorch's DDPOptimizer default, kept for drop-in compatibility; compile_ddp
    # passes DDP's real first-bucket cap instead.
    if torch.distributed.is_available():
        return min(default_first_bucket_bytes(), bucket_bytes_cap)
    return bucket_bytes_cap


class DDPOptimizer:
    """Split dynamo graphs at DDP bucket boundaries; compile each partition.

    Args:
        bucket_bytes_cap: bucket cap in bytes, DDP's ``bucket_cap_mb * 2**20``.
        backend_compile_fn: the dynamo backend each partition is compiled with.
        first_bucket_cap: cap of the first bucket in gradient-ready order;
            defaults to PyTorch's 1 MiB (capped at ``bucket_bytes_cap``).
        bucket_caps: per-bucket caps in bytes in gradient-ready order (DDP's
            ``bucket_cap_mb_list``); overrides the two caps above.
        fallback: ``"warn"`` (a failing partition runs eagerly) or ``"raise"``.
        check_plans: compare the plan with every rank's before the compiled graph runs and
            fail on all ranks if they differ (see Note [Plan agreement]).
        plan_timeout_s: how long to wait for the other ranks' plans.
        cost_model: when given, each graph's caps come from the cost-model DP
            (Note [Cost-model bucket plan]) and the caps above are unused; with
            ``auto_plan=False`` the caps above plan and the model only predicts.
        process_group: the group whose ranks must plan alike (DDP's
            ``process_group``); None is the default group.
        peers_elsewhere: True once every peer passed the step without the graph being
            compiled (``StepGate.others_waiting``): the plan check stops waiting for them.
        param_names: ``id(parameter) -> name`` for plans, logs and the plan check; by
            default a parameter is named from dynamo's source, which after a graph
            break starts at the resumed frame's local (``3.weight`` for
            ``layers[3].weight`` reached through a local ``layers``).
        spelling: how the graph-break reason of each split says to compile
            without splitting: ``compile_ddp`` passes its entry point's; the
            default advises the plain backend, for a DDPOptimizer used directly.

    Attributes:
        buckets: the partitions of every graph that holds parameters, in forward
            order (graphs in the order they first ran, each graph's buckets in its
            forward order); a model with graph breaks gives several graphs, and a
            graph compiled again (a recompile) replaces its earlier plan. A graph
            without parameters (a loss computed after a graph break) is not DDP's
            business and is left out; when no graph holds parameters this is the
            last plan. See Note [Plans across graphs].
        last_plan: the plan of the graph compiled last.
        plans: every plan made, one per compile, in compile order.
        records: the partition outcomes of every graph's latest compile, in the
            order of ``buckets``' graphs.
        compiles: graphs compiled to the end (a compile that dynamo restarted
            or that raised is not counted), graphs without backward included.
        inference_records: one record per graph compiled whole because it runs no
            backward (captured under ``no_grad``, or no input needs a gradient).
        prediction: with a cost model, the last plan's predicted timeline, else None.
    """

    def __init__(
        self,
        bucket_bytes_cap: int,
        backend_compile_fn: BackendFn,
        first_bucket_cap: int | None = None,
        *,
        bucket_caps: list[int] | tuple[int, ...] | None = None,
        fallback: str = "warn",
        check_plans: bool = True,
        plan_timeout_s: float = PLAN_TIMEOUT_S,
        cost_model: CostModel | None = None,
        auto_plan: bool = True,
        param_names: dict[int, str] | None = None,
        process_group: Any = None,
        spelling: Spelling = DIRECT_SPELLING,
        peers_elsewhere: Callable[[], bool] | None = None,
    ) -> None:
        if fallback not in FALLBACKS:
            raise ValueError(
                f"fallback={fallback!r} is not one of {FALLBACKS}: 'warn' runs a partition that fails to "
                "compile eagerly, 'raise' stops on the error."
            )
        if first_bucket_cap is None and not bucket_caps and isinstance(bucket_bytes_cap, int) and bucket_bytes_cap > 0:
            first_bucket_cap = _default_first_bucket_cap(bucket_bytes_cap)
        self.caps = BucketCaps(bucket_bytes_cap, first_bucket_cap, tuple(bucket_caps or ()))
        self.bucket_bytes_cap = bucket_bytes_cap
        self.first_bucket_cap = self.caps.cap_for(0)
        self.backend_compile_fn = backend_compile_fn
        self.fallback = fallback
        self.last_plan: list[Bucket] = []
        self.plans: list[list[Bucket]] = []
        self._exchanges = 1  # plan exchanges so far plus one: the next one's key (Note [Plan agreement])
        # graph slot -> (plan, partition records) of its latest compile; insertion order = first-run order.
        self._graphs: dict[Any, tuple[list[Bucket], list[PartitionRecord]]] = {}
        self.compiles = 0
        self.inference_records: list[PartitionRecord] = []
        self.check_plans = check_plans
        self.plan_timeout_s = plan_timeout_s
        self._plan_namespace = next_plan_namespace()
        self.cost_model = cost_model
        self.auto_plan = auto_plan and cost_model is not None
        self.prediction: Timeline | None = None
        self.param_names = dict(param_names or {})
        self.process_group = process_group
        self.peers_elsewhere = peers_elsewhere
        self.spelling = spelling

    @property
    def buckets(self) -> list[Bucket]:
        with_params = [plan for plan, _ in self._graphs.values() if any(b.size for b in plan)]
        if not with_params:
            return self.last_plan
        return [b for plan in with_params for b in plan]

    @property
    def planned_graphs(self) -> int:
        """Captured graphs planned so far that hold parameters."""
        return sum(1 for plan, _ in self._graphs.values() if any(b.size for b in plan))

    @property
    def records(self) -> list[PartitionRecord]:
        return [r for _, records in self._graphs.values() for r in records]

    def _forget_replaced(self, slot: Any, buckets: list[Bucket]) -> None:
        """Drop the plan of another slot over the same parameters: that graph compiled again in a new
        frame (after ``torch.compiler.reset()``), so its old plan and partitions are gone."""
        params = frozenset(i for b in buckets for i in b.param_ids)
        if params:
            for other in [k for k, (plan, _) in self._graphs.items()
                          if k != slot and frozenset(i for b in plan for i in b.param_ids) == params]:
                del self._graphs[other]

    def compile_fn(self, gm: fx.GraphModule, example_inputs: list[Any], **compiler_configs: Any) -> Callable:
        """Dynamo backend entry: plan, split, compile each partition, return the stitched graph."""
        backend = self.backend_compile_fn
        if compiler_configs:
            backend = functools.partial(backend, **compiler_configs)
        t0 = time.perf_counter()

        # 0. No backward, no buckets: compiled whole, unplanned, unchecked (a rank-0-only evaluation
        #    must not plan buckets the other ranks never see, nor wait for their plans).
        if not produces_gradients(example_inputs):
            record = PartitionRecord(index=len(self.inference_records), name="no_grad_graph")
            self.inference_records.append(record)
            compiled = self._compile_whole(gm, example_inputs, backend, record)
            self.compiles += 1
            log.info("ddp_opt compiled a graph without backward whole in %.1fs (no gradients: nothing to bucket)",
                     time.perf_counter() - t0)
            return compiled

        # 1. Plan: which node goes to which bucket (pure; see Note [Bucket planning]),
        #    with caps chosen by the cost model when there is one.
        caps = self.caps
        if self.auto_plan:
            caps, buckets, self.prediction = plan_auto(gm, self.cost_model)
        else:
            buckets = plan_buckets(gm, caps)
            if self.cost_model is not None:
                self.prediction = predict_plan(gm, buckets, self.cost_model)
        for b in buckets:
            b.params = [self.param_names.get(i, name) for name, i in zip(b.params, b.param_ids)]
        self.last_plan = buckets
        self.plans.append(buckets)
        slot = graph_slot()
        self._forget_replaced(slot, buckets)
        self._graphs[slot] = (buckets, [])
        self._log_plan(caps)
        # For tlparse: the plan in PyTorch's structured trace (TORCH_TRACE=dir).
        trace_artifact(
            "ddp_opt_bucket_plan", "json",
            lambda: json.dumps([{"bucket": i, **d} for i, d in enumerate(plan_details(buckets))]),
        )
        # Every rank's plan must be the same; published now, compared once compiled
        # (before any collective can run; see Note [Plan agreement]).
        plan_key = f"{self._plan_namespace}/{self._exchanges}"
        self._exchanges += 1
        published = self.check_plans and publish_plan(buckets, plan_key, self.process_group)
        if published:
            peers_plans_if_ready(plan_key, self.process_group, self.plan_timeout_s)

        # 2. One bucket: nothing to split; compile the graph whole (still fault tolerant).
        if len(buckets) == 1:
            record = PartitionRecord(index=0, name="whole_graph")
            self._graphs[slot] = (buckets, [record])
            compiled = self._compile_whole(gm, example_inputs, backend, record)
            if published:
                self._verify(plan_key)
            self.compiles += 1
            return compiled

        # 3. Split at the bucket boundaries.
        owner = partition_map(buckets)
        split = split_graph(gm, lambda node: owner[node])
        graph_log.debug("ddp_opt split graph:\n%s", split.gm.print_readable(print_output=False))
        trace_artifact("ddp_opt_split_graph", "string", lambda: split.gm.print_readable(print_output=False))

        # 4. Compile each partition on its first (fake) call, in order.
        records = compile_partitions(
            split, backend, example_inputs, fallback=self.fallback, compile_reason=split_reason(self.spelling)
        )
        self._graphs[slot] = (buckets, records)
        if published:
            self._verify(plan_key)
        self.compiles += 1
        eager = [r.name for r in records if r.status == "eager"]
        log.info(
            "ddp_opt compiled %d partitions in %.1fs%s; AOTAutograd backends compile each partition's "
            "backward at the first backward pass, which can take as long again",
            len(records), time.perf_counter() - t0,
            f" ({len(eager)} running eagerly: {', '.join(eager)})" if eager else "",
        )
        return split.gm

    def _verify(self, plan_key: str) -> None:
        """Compare the ranks' plans; a plan the peers never make (their step passed without
        this graph) is withdrawn and not counted, so the next exchange pairs with theirs."""
        if verify_plans(plan_key, self.plan_timeout_s, self.process_group, self.peers_elsewhere) is None:
            self._exchanges -= 1

    def _compile_whole(self, gm, example_inputs, backend, record: PartitionRecord) -> Callable:
        t0 = time.perf_counter()
        try:
            fn = backend(gm, example_inputs)
            record.status = "compiled"
        except DYNAMO_CONTROL_FLOW:
            raise
        except Exception as e:  # noqa: BLE001
            if self.fallback == "raise":
                raise
            record.status, record.error, fn = "eager", f"{type(e).__name__}: {e}", gm.forward
            log.warning(
                "Compiling the graph failed; it will run eagerly. Error: %s. "
                "Pass fallback='raise' to stop on this error instead.", record.error,
            )
        record.compile_s = time.perf_counter() - t0
        return fn

    def _log_plan(self, caps: BucketCaps) -> None:
        buckets = self.last_plan
        total = sum(b.size for b in buckets)
        log.info(
            "ddp_opt planned %d bucket(s) over %.2f MiB of gradients (first cap %d B, cap %d B%s)",
            len(buckets), total / 2**20, caps.cap_for(0), caps.bucket_bytes_cap,
            f", per-bucket caps {list(caps.per_bucket_caps)}" if caps.per_bucket_caps else "",
        )
        if self.prediction is not None and self.cost_model is not None:
            rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
            log.log(logging.INFO if rank0 else logging.DEBUG, "ddp_opt %s (gradient-ready order):\n%s",
                    "cost-model plan" if self.auto_plan else "predicted timeline of the plan",
                    describe(self.prediction, buckets))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("ddp_opt bucket assignment:\n%s", format_buckets(buckets))


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


def build(setup: Setup, backend: Callable) -> Built:
    """The forward split at the bucket boundaries; DDP's reducer all-reduces each bucket."""
    splitter = splitter_for(setup.ddp_model, setup.config, backend, setup.named, setup.cost_model, setup.gate)
    return Built(splitter.compile_fn, splitter=splitter)
