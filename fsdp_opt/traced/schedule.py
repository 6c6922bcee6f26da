"""Where each collective of a traced FSDP graph is issued and awaited: a plan made from
the graph (``plan_schedule``), then a pass that reorders the graph to it
(``apply_schedule``); and the joint-graph pass that makes backward all-gather again
what forward freed (``tag_regathers``). See Note [Traced FSDP schedule].

Note [Traced FSDP schedule]

Background
    Dynamo traces each unit's all-gather where ``fsdp_opt.traced`` issues it, at the
    start of forward, each followed at once by its wait; AOTAutograd puts every
    reduce-scatter where autograd would run the unit's backward function, after all of
    backward's compute. Run as traced, no collective would overlap anything.

Algorithm
    Per graph (forward, backward, inference), from the collectives' nodes:

    1. Each collective is a start node (``all_gather_into_tensor``; for gradients
       ``reduce_scatter_tensor``, or ``all_to_all_single`` with a sum, Note [Unit gather])
       and its ``wait_tensor``. Its *inputs* are the nodes
       that feed only it (pads, casts, the concatenation); its *outputs* are the wait
       and the views of the waited tensor.
    2. All-gathers, ordered by the first node that uses their outputs (the unit's first
       use): all-gather ``k`` is issued just before the first use of unit
       ``k - prefetch`` (graph start for the first ``prefetch``), so it crosses the link
       while unit ``k - prefetch`` computes; its wait goes just before its first use.
       Memory bounds it: with every gather issued at its first use (just in time), the
       graph's live tensor bytes (``live_bytes``, from each node's example value) peak
       somewhere; a gather is issued at the earliest of those anchors where holding its
       buffer until its first use keeps the graph at or below that peak, else at its first
       use. In forward, where activations accumulate, every gather is issued ahead; in
       backward the first ones, near the start where the loss's gradient and every
       activation are alive, are issued where they are used. (Allowing one unit over the
       peak away from the peak's node, as FSDP2 holds two units, was measured to put a
       rank's peak at 0.99 to 1.01 of eager FSDP2's on the 8-block GPT: not kept.)
    3. Reduce-scatters: issued as soon as their inputs exist (the unit's last
       gradient); before one is issued, the oldest ones are awaited (and their gradients
       cut out of the received buffers) until fewer than ``reduce_inflight`` remain in
       flight; the last ones at the graph's end. With 1, each reduction crosses the link
       while the next unit's backward computes, and one reduction's buffers (a unit's full
       gradients, and what the collective receives) are alive at a time, as in FSDP2.
    4. Every other node keeps its order; a node is placed only after its inputs.

    In the joint graph, before the partitioner (``tag_regathers``): every node from a
    resharded unit's shards to the views of its gathered parameters is tagged
    ``MUST_RECOMPUTE``, so the partitioner saves none of the gathered parameters for
    backward and backward all-gathers them again (AOTAutograd places recomputed nodes
    just before their first use in backward). Units kept gathered
    (``reshard_after_forward=False``) are not tagged: collectives are never recomputed,
    so their gathered parameters are saved.

Notes
    - A unit is named by ``node.meta["custom"]["fsdp_unit"]``
      (``torch.fx.traceback.annotate`` around its gather); without it, by the order of
      the all-gathers in forward.
    - The plan lists, per collective, the node it is issued before and the node it is
      awaited before (``Placement``), for the plan's table.
    - Inductor reorders nodes by its own rules, so under Inductor the reordered graph is
      cut at its collectives and each piece compiled alone (``segments``).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import fx

from .._torch_internals import (CheckpointPolicy, collective_starts, is_all_to_all, is_collective_start, is_op_overload,
                                is_reduction, is_wait)

__all__ = ["Placement", "Schedule", "plan_schedule", "apply_schedule", "tag_regathers", "unit_of", "UNIT_KEY"]

UNIT_KEY = "fsdp_unit"
# ac_graph_id of the re-gather tags: above any checkpointed region's id, so that the partitioner's
# rule for adjacent regions (a region's output feeding a later region is saved) never saves ours.
_REGATHER_GRAPH_ID = 1 << 30


@dataclass(frozen=True)
class Placement:
    """One collective's place in a graph: what it moves and between which nodes it flows."""

    kind: str  # "all-gather", "reduce-scatter" or "all-to-all (reduce)"
    unit: int | None
    numel: int
    issued_before: str  # the node it is issued just before ("start" for the graph's start)
    awaited_before: str  # the node it is awaited just before ("output" for the graph's end)


@dataclass
class Schedule:
    """A graph's new node order and each collective's placement."""

    order: list[fx.Node]
    placements: list[Placement] = field(default_factory=list)


def unit_of(node: fx.Node) -> int | None:
    custom = node.meta.get("custom") or {}
    return custom.get(UNIT_KEY)


def _viewish(node: fx.Node) -> bool:
    t = node.target
    if t is operator.getitem:
        return True
    return is_op_overload(t) and (t.is_view or t in _VIEW_LIKE)


_VIEW_LIKE = {torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten._unsafe_view.default,
              torch.ops.aten.slice.Tensor}


def _outputs(wait: fx.Node) -> list[fx.Node]:
    """The wait and every view-like node downstream of it only through view-like nodes."""
    out, seen, stack = [], set(), [wait]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        out.append(n)
        stack.extend(u for u in n.users if u.op == "call_function" and _viewish(u))
    return out


def _inputs(start: fx.Node) -> list[fx.Node]:
    """The nodes upstream of ``start`` that feed nothing else (its own preparation)."""
    mine, stack = {start}, list(start.all_input_nodes)
    ordered = []
    while stack:
        n = stack.pop()
        if n in mine or n.op != "call_function":
            continue
        if all(u in mine for u in n.users):
            mine.add(n)
            ordered.append(n)
            stack.extend(n.all_input_nodes)
    return ordered


def _where(node: fx.Node | None) -> str:
    if node is None:
        return "start"
    if node.op == "output":
        return "output"
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return f"{node.name} ({_clean_path(path)})"
    return node.name


def _clean_path(path: str) -> str:
    """A module path as dynamo records it (``L['original_forward'].__self__.blocks[3].mlp``, or with
    ``_modules['...']``), as a qualified name (``blocks.3.mlp``)."""
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"^L\['[^']*'\]", "", path)
    path = path.replace("L['", "").replace("']", "").replace("original_forward.__self__", "").replace("__self__", "")
    return path.strip(".") or "(root)"


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel()) if isinstance(val, torch.Tensor) else 0


def _tail(wait: fx.Node) -> list[fx.Node]:
    """The wait and every node downstream of it that needs nothing else (a reduction's sum, the slices
    and casts of each gradient): what finishing a reduction runs."""
    tail, stack = {wait: None}, list(wait.users)
    while stack:
        n = stack.pop()
        if n in tail or n.op != "call_function":
            continue
        if all(i in tail for i in n.all_input_nodes):
            tail[n] = None
            stack.extend(n.users)
    return list(tail)


@dataclass
class _Collectives:
    """A graph's collectives, as the schedule treats them."""

    gathers: list[tuple[fx.Node | None, fx.Node, list[fx.Node]]]  # (first use, start, start's preparation + start)
    lazy: set[fx.Node]  # pulled in just before their first user
    eager: set[fx.Node]  # placed as soon as their inputs are
    tails: dict[fx.Node, list[fx.Node]]  # a reduction's start -> its finish, placed by the in-flight bound
    waits: dict[fx.Node, fx.Node]  # start -> wait


def _collectives(gm: fx.GraphModule, pos: dict[fx.Node, int]) -> _Collectives:
    c = _Collectives([], set(), set(), {}, {})
    for start in collective_starts(gm.graph):
        (wait,) = [u for u in start.users if is_wait(u)]
        c.waits[start] = wait
        if is_reduction(start):
            c.eager.update(_inputs(start))
            c.eager.add(start)
            c.tails[start] = sorted(_tail(wait), key=pos.__getitem__)
            c.lazy.update(c.tails[start])
            continue
        outs = _outputs(wait)
        c.lazy.update(outs)
        inside = set(outs)
        users = [u for o in outs for u in o.users if u not in inside]
        first = min(users, key=pos.__getitem__) if users else None
        c.gathers.append((first, start, sorted(_inputs(start), key=pos.__getitem__) + [start]))
    c.gathers.sort(key=lambda g: pos[g[0]] if g[0] is not None else len(pos))
    return c


def _order(nodes: list[fx.Node], c: _Collectives, issue_at: dict[fx.Node, fx.Node | None], reduce_inflight: int
           ) -> tuple[list[fx.Node], dict[fx.Node, fx.Node], dict[fx.Node, fx.Node]]:
    """The node order with each gather issued just before its anchor (None: the graph's start);
    also each lazy node's first user and each awaited reduction's next reduction."""
    anchored: dict[fx.Node | None, list[fx.Node]] = {}
    for _, start, group in c.gathers:
        anchored.setdefault(issue_at[start], []).extend(group)
    special = c.lazy | c.eager | {n for group in anchored.values() for n in group}
    order: list[fx.Node] = []
    done: set[fx.Node] = set()
    first_user: dict[fx.Node, fx.Node] = {}
    issued: list[fx.Node] = []  # reductions, in the order they are issued
    finished = [0]  # how many of them are awaited so far
    awaited_before: dict[fx.Node, fx.Node] = {}  # a reduction's wait -> the reduction issued just after it

    def emit(n: fx.Node, by: fx.Node | None) -> None:
        if n in done:
            return
        for i in n.all_input_nodes:
            emit(i, by if n in c.lazy else n)
        if n in done:  # an eager node placed by one of its inputs
            return
        if n in c.tails:  # a reduction about to be issued: finish the oldest ones beyond the bound first
            while len(issued) - finished[0] >= reduce_inflight:
                older = issued[finished[0]]
                finished[0] += 1
                awaited_before[c.waits[older]] = n
                for m in c.tails[older]:
                    emit(m, None)
            issued.append(n)
        done.add(n)
        order.append(n)
        if n in c.lazy and by is not None:
            first_user.setdefault(n, by)
        for u in n.users:
            if u in c.eager and u not in done and all(i in done for i in u.all_input_nodes):
                emit(u, None)

    for n in nodes:
        if n.op == "placeholder":
            emit(n, None)
    for n in anchored.get(None, []):
        emit(n, None)
    for n in nodes:
        if n in special or n.op == "placeholder":
            continue
        for m in anchored.get(n, []):
            emit(m, None)
        emit(n, None)
    if len(order) != len(nodes):  # pragma: no cover - an internal invariant
        raise AssertionError(f"traced FSDP schedule placed {len(order)} of {len(nodes)} nodes")
    return order, first_user, awaited_before


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel()) * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


def live_bytes(order: Sequence[fx.Node], inputs_freed: bool) -> list[int]:
    """Bytes of tensors alive after each node of ``order`` (``node.meta["val"]``): a node's output
    is alive from the node to the last use of it or of any view of it (a view, a wait and a
    ``getitem`` share their input's storage), the graph's outputs to the end; inputs are alive from
    the start, to their last use when ``inputs_freed`` (AOTAutograd's boxed backward), else to the end."""
    pos = {n: i for i, n in enumerate(order)}
    base: dict[fx.Node, fx.Node] = {}
    for n in order:
        alias = n.op == "call_function" and (_viewish(n) and n.target is not torch.ops.aten.clone.default
                                             and n.target is not torch.ops.aten._to_copy.default or is_wait(n))
        base[n] = base[n.args[0]] if alias and n.args and isinstance(n.args[0], fx.Node) else n
    end = len(order)
    last = {b: pos[b] for b in set(base.values())}
    for n in order:
        for i in n.all_input_nodes:
            b = base[i]
            last[b] = end if n.op == "output" else max(last[b], pos[n])
    delta = [0] * (end + 1)
    for b, stop in last.items():
        size = _nbytes(b.meta.get("val"))
        if not size:
            continue
        first = 0 if b.op == "placeholder" else pos[b]
        stop = end if b.op == "placeholder" and not inputs_freed else stop
        delta[first] += size
        delta[min(stop + 1, end)] -= size
    out, running = [], 0
    for d in delta[:end]:
        running += d
        out.append(running)
    return out


def plan_schedule(gm: fx.GraphModule, prefetch: int = 1, reduce_inflight: int = 1, inputs_freed: bool = False,
                  extra_bytes: int = 0) -> Schedule:
    """The node order of Note [Traced FSDP schedule] for ``gm``; nothing is changed.

    Args:
        gm: a forward, backward or inference graph after AOTAutograd.
        prefetch: how many units ahead an all-gather may be issued, memory allowing.
        reduce_inflight: reductions in flight at most.
        inputs_freed: whether the graph frees its inputs after their last use (a boxed backward),
            for the memory the prefetch may not raise.
        extra_bytes: how far prefetching may raise the graph's just-in-time peak (a memory budget
            above FSDP2's footprint, ``FSDPConfig.memory_budget_mb``); 0 by default.
    """
    if reduce_inflight < 1:
        raise ValueError(f"reduce_inflight={reduce_inflight}: at least the reduction being issued is in flight")
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    c = _collectives(gm, pos)
    # just in time: every gather issued at its first use; its peak is the bound prefetching keeps to
    issue_at: dict[fx.Node, fx.Node | None] = {start: first for first, start, _ in c.gathers}
    order, _, _ = _order(nodes, c, issue_at, reduce_inflight)
    live = live_bytes(order, inputs_freed)
    peak = max(live, default=0)
    at = {n: i for i, n in enumerate(order)}
    for k, (first, start, _) in enumerate(c.gathers):
        if first is None:
            continue
        size = _nbytes(start.meta.get("val"))
        here = at[first]
        earlier = [None] if k < prefetch else []
        earlier += [c.gathers[j][0] for j in range(max(0, k - prefetch), k)]
        for anchor in earlier:  # the earliest anchor the memory allows
            a = 0 if anchor is None else at[anchor]
            if a < here and max(live[a:here]) + size <= peak + extra_bytes:
                for i in range(a, here):
                    live[i] += size
                issue_at[start] = anchor
                break
    order, first_user, awaited_before = _order(nodes, c, issue_at, reduce_inflight)

    placements = []
    for start, wait in c.waits.items():
        rs = is_reduction(start)
        after = order[order.index(start) + 1] if rs else issue_at[start]
        kind = ("all-to-all (reduce)" if is_all_to_all(start) else "reduce-scatter") if rs else "all-gather"
        if wait in awaited_before:
            awaited = f"before {awaited_before[wait].name} is issued"
        else:
            awaited = _where(first_user.get(wait))
        placements.append(Placement(kind=kind, unit=unit_of(start), numel=_numel(start),
                                    issued_before=_where(after), awaited_before=awaited))
    return Schedule(order, placements)


def apply_schedule(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    """Reorder ``gm``'s nodes to ``schedule.order`` (same nodes, same edges)."""
    for a, b in zip(schedule.order, schedule.order[1:]):
        a.append(b)
    gm.graph.lint()
    gm.recompile()
    return gm


def tag_regathers(joint: fx.GraphModule, resharded: Sequence[bool] | None = None) -> int:
    """Tag each resharded unit's gather for recompute in backward (Note [Traced FSDP
    schedule]); ``resharded[u]`` says whether unit ``u`` reshards (all, when None).
    Returns how many all-gathers were tagged."""
    tagged = 0
    for index, start in enumerate(s for s in collective_starts(joint.graph) if not is_reduction(s)):
        unit = unit_of(start)
        unit = index if unit is None else unit
        if resharded is not None and not resharded[unit]:
            continue
        (wait,) = [u for u in start.users if is_wait(u)]
        for n in _inputs(start) + [start] + _outputs(wait):
            if "recompute" in n.meta and n not in (start, wait):
                continue  # a view inside a checkpointed region keeps its region's tag
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = _REGATHER_GRAPH_ID
        tagged += 1
    return tagged


def is_collective(node: fx.Node) -> bool:
    return is_collective_start(node) or is_wait(node)
