"""The cost-model plan of a captured graph (Note [Cost-model bucket plan] in
``ddp_opt.planning.solver``): the graph's units and their costs (``ddp_opt.planning.cost``) in, the
DP's caps, the buckets ``plan_buckets`` makes with them and their predicted timeline out.
"""

from __future__ import annotations

import logging
from typing import Sequence

from torch import fx

from .solver import (NO_HOOK_COMPUTE, HookCompute, LinkEstimate, Timeline, UnitCost, format_timeline, simulate,
                     solve_robust)
from .cost import CostModel, node_backward_costs
from .buckets import Bucket, BucketCaps, group_by_caps, plan_buckets

log = logging.getLogger(__name__)

__all__ = ["unit_costs", "chunk_units", "solve_table", "plan_auto", "predict_plan", "describe"]


def unit_costs(units: list[Bucket], costs: dict[fx.Node, float]) -> list[UnitCost]:
    """Per-unit (backward seconds, bytes), in gradient-ready order, from forward-order buckets."""
    return [UnitCost(sum(costs.get(n, 0.0) for n in b.nodes), b.size) for b in reversed(units)]


def chunk_units(table: Sequence[UnitCost], min_bytes: int) -> list[int]:
    """Units per chunk (gradient-ready order): consecutive units joined until a chunk holds
    ``min_bytes``; the last chunk takes what is left."""
    return group_by_caps([u.nbytes for u in table], BucketCaps(min_bytes))


def _merge(table: Sequence[UnitCost], lengths: Sequence[int]) -> list[UnitCost]:
    out, start = [], 0
    for n in lengths:
        chunk = table[start:start + n]
        out.append(UnitCost(sum(u.backward_s for u in chunk), sum(u.nbytes for u in chunk)))
        start += n
    return out


def solve_table(table: Sequence[UnitCost], link: LinkEstimate, gamma_s: float, min_bucket_bytes: int = 0,
                contention: float = 0.0, hook: HookCompute = NO_HOOK_COMPUTE) -> Timeline:
    """``solve_robust`` on a unit table (gradient-ready order), over chunks of at least
    ``min_bucket_bytes`` with the first chunk alone when that is > 0 (``plan_auto``);
    the timeline is over ``table``'s units either way, ``extra["min_bucket_bytes"]`` set. A hook
    that computes on backward's own cores (``hook.shares_cores``) gets one bucket,
    ``extra["one_bucket"]`` set (Note [Cost-model bucket plan])."""
    if hook.shares_cores:
        timeline = simulate(table, [len(table)], link, gamma_s, contention, hook)
        timeline.extra["one_bucket"] = True
    elif min_bucket_bytes > 0:
        chunks = chunk_units(table, min_bucket_bytes)
        best = solve_robust(_merge(table, chunks), link, gamma_s, first=1, contention=contention, hook=hook)
        counts, start = [], 0
        for n in best.counts:
            counts.append(sum(chunks[start:start + n]))
            start += n
        timeline = simulate(table, counts, link, gamma_s, contention, hook)
        timeline.extra.update(best.extra)
    else:
        timeline = solve_robust(table, link, gamma_s, contention=contention, hook=hook)
    timeline.extra["min_bucket_bytes"] = min_bucket_bytes
    return timeline


def plan_auto(gm: fx.GraphModule, model: CostModel) -> tuple[BucketCaps, list[Bucket], Timeline]:
    """Choose per-bucket caps for ``gm`` by the DP (Note [Cost-model bucket plan]).

    With ``model.min_bucket_bytes > 0`` the DP merges chunks of at least that many bytes
    (``chunk_units``) instead of units, and the first chunk is a bucket alone: no bucket
    but the last is smaller, and the first is no larger than it must be.

    Returns:
        The caps, the buckets ``plan_buckets(gm, caps)`` makes with them (the DP's
        buckets) and the predicted timeline of those buckets.
    """
    units = plan_buckets(gm, BucketCaps(1))  # the finest legal split, forward order
    table = unit_costs(units, node_backward_costs(gm, model.rates))
    best = solve_table(table, model.link, model.gamma_s, model.min_bucket_bytes, model.contention_s_per_byte,
                       model.hook)
    caps = BucketCaps(best.caps[0], per_bucket_caps=best.caps)
    # The prediction is for the plan plan_buckets really makes with these caps.
    planned = plan_buckets(gm, caps)
    timeline = _predict(units, table, planned, model)
    if timeline is None:
        log.warning("ddp_opt auto plan: the planner did not reproduce the DP's boundaries; the prediction is "
                    "for the DP's plan, the split follows plan_buckets with caps %s", list(caps.per_bucket_caps))
        return caps, planned, best
    timeline.extra.update(best.extra)
    return caps, planned, timeline


def predict_plan(gm: fx.GraphModule, buckets: list[Bucket], model: CostModel) -> Timeline | None:
    """The predicted timeline of a plan made otherwise (fixed caps), or None when its
    buckets do not end on unit boundaries (Note [Cost-model bucket plan])."""
    units = plan_buckets(gm, BucketCaps(1))
    return _predict(units, unit_costs(units, node_backward_costs(gm, model.rates)), buckets, model)


def _predict(units: list[Bucket], table: list[UnitCost], buckets: list[Bucket], model: CostModel) -> Timeline | None:
    counts = _unit_counts(units, buckets)
    return None if counts is None else simulate(table, counts, model.link, model.gamma_s, model.contention_s_per_byte,
                                                model.hook)


def _unit_counts(units: list[Bucket], planned: list[Bucket]) -> list[int] | None:
    """Units per planned bucket (gradient-ready order), or None when a bucket does not end on a unit boundary."""
    unit_end = {}
    for k, u in enumerate(reversed(units)):
        for n in u.nodes:
            unit_end[n] = k
    counts, prev = [], -1
    for b in reversed(planned):
        last = max(unit_end[n] for n in b.nodes)
        first = min(unit_end[n] for n in b.nodes)
        if first != prev + 1:
            return None
        counts.append(last - prev)
        prev = last
    return counts if prev == len(units) - 1 else None


def describe(timeline: Timeline, buckets: list[Bucket]) -> str:
    """The plan table with predicted times (buckets given in forward order)."""
    names = [(b.params[0] if b.params else "(no parameters)") for b in reversed(buckets)]
    if len(names) != len(timeline.buckets):
        names = None
    return format_timeline(timeline, names)
