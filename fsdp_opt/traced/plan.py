"""The traced FSDP plan: which blocks share a unit, which units stay gathered between
forward and backward, how gradients are reduced; made from the measured link and, with a
memory budget, the measured forward of each block (Note [Traced FSDP plan]).

Note [Traced FSDP plan]

Background
    Each unit costs three collectives a step (all-gather in forward, again in backward
    unless kept, reduce-scatter), each paying the link's latency; a bigger unit pays it
    fewer times but its first all-gather and last reduce-scatter overlap nothing, and it
    holds more gathered bytes. A unit kept gathered from forward to backward saves one
    all-gather and holds its bytes in between. FSDP2 holds at most two gathered block
    units and its root at a time.

Algorithm
    - Measured once per job at ``apply`` (rank 0's numbers, broadcast): the link, as
      ``t = alpha + bytes / rate`` fitted separately for ``all_gather_into_tensor``,
      ``reduce_scatter_tensor`` and ``all_to_all_single`` with a sum over a sweep of sizes
      on the mesh's group. The faster of the two reductions at a unit's size reduces every
      unit (Note [Unit gather]).
    - Within FSDP2's footprint (no ``memory_budget_mb``) that is the whole plan: one unit
      per block, the root kept, each block gathered again in backward. A bigger unit, or
      one kept from forward to backward, holds more gathered bytes than FSDP2 does.
    - With a budget: at the first call each block's forward is timed on an eager forward
      of the real batch, one block gathered at a time (backward counted as twice
      forward); candidates are ``g`` consecutive blocks per unit (``g = 1 .. blocks``, the
      last unit taking what is left) and ``k = 0 .. units`` of the last units kept
      gathered. Each candidate's step is simulated on one serial link and one compute
      stream: in forward, unit ``i``'s all-gather is issued when unit ``i - prefetch``
      starts and awaited when unit ``i`` starts; in backward, a resharded unit's
      all-gather is issued when the unit ``prefetch`` before it (in backward order)
      starts, and each unit's reduction when its backward ends; the link serves
      collectives in issue order. The gathered bytes alive at once are simulated alongside
      (the units in flight or in use, the kept units from their forward to their backward,
      the root); the fastest candidate within the budget wins, ties going to the smaller
      footprint.
    - Where each collective is issued and awaited in the graphs is the schedule's (Note
      [Traced FSDP schedule]), which holds prefetching to the graph's own memory.

Notes
    - With a link too fast to measure (slope <= 0), latency decides: one block per unit.
    - ``shard_unit_mb`` as a number fixes the grouping as ``plan_shard_units`` does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Sequence

from tabulate import tabulate

from compiler.ranks import LinkEstimate

from .schedule import Placement

log = logging.getLogger(__name__)

__all__ = ["CollectiveLink", "TracedUnit", "TracedPlan", "simulate", "choose_units", "format_plan"]

MiB = 1 << 20


@dataclass(frozen=True)
class CollectiveLink:
    """The measured link: one fit per collective (bytes are the gathered, full size).

    Attributes:
        all_gather, reduce_scatter: ``all_gather_into_tensor`` and ``reduce_scatter_tensor``.
        all_to_all: ``all_to_all_single`` of the full buffer (the reduction the plan may pick
            instead of a reduce-scatter, Note [Unit gather]); None: not measured.
    """

    all_gather: LinkEstimate
    reduce_scatter: LinkEstimate
    all_to_all: LinkEstimate | None = None

    def reduction(self, nbytes: int) -> tuple[str, LinkEstimate]:
        """The faster way to reduce ``nbytes`` of gradients, and its fit."""
        if self.all_to_all is not None and self.all_to_all.transfer_s(nbytes) < self.reduce_scatter.transfer_s(nbytes):
            return "all_to_all", self.all_to_all
        return "reduce_scatter", self.reduce_scatter


@dataclass(frozen=True)
class TracedUnit:
    """Blocks gathered together.

    Attributes:
        index: position in forward order (the root is unit 0).
        blocks: qualified names of its blocks; empty for the root.
        nbytes: gathered bytes (full parameters in the compute dtype).
        fwd_s, bwd_s: measured forward seconds, backward estimated as twice forward.
        resharded: whether backward gathers it again (False: kept from forward).
    """

    index: int
    blocks: tuple[str, ...]
    nbytes: int
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    resharded: bool = True

    @property
    def name(self) -> str:
        if not self.blocks:
            return "(root)"
        return self.blocks[0] if len(self.blocks) == 1 else f"{self.blocks[0]} .. {self.blocks[-1]}"


@dataclass
class TracedPlan:
    """What traced FSDP does; ``units`` may be replanned at the first call (``auto``).

    Attributes:
        units: the units in forward order (the root first).
        prefetch: all-gathers issued this many units ahead.
        reduce_inflight: reductions issued before the oldest is awaited (Note [Traced FSDP schedule]).
        how: how the units were chosen ("auto", "one unit per block", "shard_unit_mb=...").
        link: the measured link (None when not measured).
        reduce_via: how gradients are reduced, ``"reduce_scatter"`` or ``"all_to_all"`` (Note [Unit
            gather]): the faster on the measured link, else gloo's all-to-all and NCCL's reduce-scatter.
        budget_bytes: the most gathered bytes alive at once the plan allows.
        keep_units: whether the plan may keep units gathered from forward to backward (with a
            memory budget given: a kept unit is alive across the end of forward, where memory
            peaks, so within FSDP2's footprint none is kept).
        predicted_s, peak_bytes: the simulated step (compute and collectives only) and
            gathered-bytes peak of the chosen units.
        placements: per graph kind, each collective's issue and wait position, filled in
            as the graphs compile.
    """

    units: list[TracedUnit]
    prefetch: int
    how: str
    reduce_inflight: int = 1
    link: CollectiveLink | None = None
    reduce_via: str = "reduce_scatter"
    budget_bytes: int | None = None
    keep_units: bool = False
    predicted_s: float | None = None
    peak_bytes: int | None = None
    placements: dict[str, list[Placement]] = field(default_factory=dict)

    def table(self) -> str:
        return format_plan(self)


def _groups(n: int, g: int) -> list[list[int]]:
    return [list(range(i, min(i + g, n))) for i in range(0, n, g)]


def simulate(units: Sequence[TracedUnit], link: CollectiveLink, prefetch: int) -> tuple[float, int]:
    """Simulated seconds of forward and backward and the peak gathered bytes (Note
    [Traced FSDP plan]); ``units[0]`` is the root, gathered first and kept to the end."""
    link_free = 0.0

    def transfer(issue: float, nbytes: int, fit: LinkEstimate) -> float:
        nonlocal link_free
        start = max(issue, link_free)
        link_free = start + fit.transfer_s(nbytes)
        return link_free

    n = len(units)
    ag_done: dict[int, float] = {}

    def gather(i: int, now: float) -> None:
        if i < n and i not in ag_done:
            ag_done[i] = transfer(now, units[i].nbytes, link.all_gather)

    def alive(in_use: Sequence[int], kept_before: int) -> int:
        """The root, the kept units below ``kept_before`` and the units in use or in flight."""
        kept = sum(units[j].nbytes for j in range(1, kept_before) if not units[j].resharded)
        return units[0].nbytes + kept + sum(units[j].nbytes for j in set(in_use) if j != 0)

    t, peak = 0.0, 0
    for i in range(min(prefetch + 1, n)):
        gather(i, 0.0)
    for i in range(n):
        gather(i + prefetch, t)
        t = max(t, ag_done[i]) + units[i].fwd_s
        peak = max(peak, alive(range(i, min(n, i + prefetch + 1)), i))
    # backward: the blocks in reverse, then the root's own backward (the embeddings) last
    order = list(range(n - 1, 0, -1)) + [0]
    regather: dict[int, float] = {}
    rs_done = 0.0

    def regather_at(k: int, now: float) -> None:
        if k < len(order) and units[order[k]].resharded and order[k] not in regather:
            regather[order[k]] = transfer(now, units[order[k]].nbytes, link.all_gather)

    for k in range(min(prefetch, len(order))):
        regather_at(k, t)
    for k, u in enumerate(order):
        regather_at(k + prefetch, t)
        t = max(t, regather.get(u, 0.0)) + units[u].bwd_s
        ahead = [order[j] for j in range(k, min(len(order), k + prefetch + 1)) if units[order[j]].resharded]
        peak = max(peak, alive([u] + ahead, u))
        rs_done = transfer(t, units[u].nbytes, link.reduction(units[u].nbytes)[1])
    return max(t, rs_done), peak


def choose_units(root: TracedUnit, blocks: Sequence[TracedUnit], link: CollectiveLink, *, prefetch: int,
                 budget_bytes: int, group_size: int | None = None, keep: bool = True
                 ) -> tuple[list[TracedUnit], float, int]:
    """The fastest grouping and kept set within the budget (Note [Traced FSDP plan]).

    Args:
        root: the root unit (parameters outside the blocks), kept gathered.
        blocks: one unit per block, in forward order, with measured seconds.
        link: the measured link.
        prefetch: units gathered ahead.
        budget_bytes: the most gathered bytes alive at once.
        group_size: blocks per unit when fixed; None tries every size.
        keep: whether units may stay gathered from forward to backward.

    Returns:
        The units (root first), their simulated seconds and gathered-bytes peak.
    """
    sizes = [group_size] if group_size else range(1, len(blocks) + 1)
    best = None
    for g in sizes:
        grouped = [_merge(i + 1, [blocks[j] for j in idx]) for i, idx in enumerate(_groups(len(blocks), g))]
        for kept in range(len(grouped) + 1 if keep else 1):
            units = [replace(root, index=0, resharded=False)] + [
                replace(u, resharded=i < len(grouped) - kept) for i, u in enumerate(grouped)]
            seconds, peak = simulate(units, link, prefetch)
            if peak > budget_bytes and not (g == 1 and kept == 0):
                continue
            key = (round(seconds, 6), peak)
            if best is None or key < best[0]:
                best = (key, units, seconds, peak)
    assert best is not None
    return best[1], best[2], best[3]


def _merge(index: int, members: Sequence[TracedUnit]) -> TracedUnit:
    return TracedUnit(index, tuple(b for m in members for b in m.blocks), sum(m.nbytes for m in members),
                      sum(m.fwd_s for m in members), sum(m.bwd_s for m in members))


def format_plan(plan: TracedPlan) -> str:
    """The units (one row each), then each graph's collectives: where issued, where awaited."""
    rows = [(u.index, u.name, len(u.blocks), u.nbytes, f"{u.nbytes / MiB:.3f}",
             "yes" if u.resharded else "kept", f"{u.fwd_s * 1e3:.2f}" if u.fwd_s else "-") for u in plan.units]
    out = [f"traced FSDP plan ({plan.how}; prefetch {plan.prefetch}; gradients by {plan.reduce_via.replace('_', '-')}"
           + (f"; predicted {plan.predicted_s * 1e3:.1f} ms of forward and backward" if plan.predicted_s else "")
           + (f"; gathered peak {plan.peak_bytes / MiB:.2f} of {plan.budget_bytes / MiB:.2f} MiB budget"
              if plan.peak_bytes and plan.budget_bytes else "") + "):",
           tabulate(rows, headers=("unit", "blocks", "n", "bytes", "MiB", "regather in bwd", "fwd ms"),
                    tablefmt="simple")]
    if plan.link is not None:
        fits = [("all-gather", plan.link.all_gather), ("reduce-scatter", plan.link.reduce_scatter),
                ("all-to-all", plan.link.all_to_all)]
        out.append("link: " + ", ".join(f"{name} {f.alpha_s * 1e3:.3f} ms + {f.bandwidth / 1e6:.4g} MB/s"
                                        for name, f in fits if f is not None) + f" ({plan.link.all_gather.source})")
    for kind, placements in plan.placements.items():
        rows = [(p.kind, "-" if p.unit is None else p.unit, p.numel, p.issued_before, p.awaited_before)
                for p in placements]
        out.append(f"{kind} graph collectives:")
        out.append(tabulate(rows, headers=("collective", "unit", "elements", "issued before", "awaited before"),
                            tablefmt="simple"))
    return "\n".join(out)
