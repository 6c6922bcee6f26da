"""Where the traced backward runs each bucket's wait and optimizer updates (Note [Traced update]
in ``ddp_opt.strategies.traced.update``): two buckets behind its all-reduce, where nothing they write is
read any more, else at the graph's end.
"""

from __future__ import annotations

import logging
from typing import Iterable

from torch import fx

from ._torch_internals import aliasing, comm_role

log = logging.getLogger(__name__)

__all__ = ["UPDATE_LAG", "readers_of_reductions", "sink_updates"]

UPDATE_LAG = 2  # buckets: bucket k is waited for and updated just before bucket k + 2 is filled


def readers_of_reductions(nodes: list[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
    """The nodes that feed a collective, and those that read an all-reduce's result (through its wait)."""
    feeds_comm: set[fx.Node] = set()
    for node in reversed(nodes):
        if comm_role(node) == "collective" or any(user in feeds_comm for user in node.users):
            feeds_comm.add(node)
    after_wait: set[fx.Node] = set()
    for node in nodes:
        if comm_role(node) == "wait" or any(arg in after_wait for arg in node.all_input_nodes):
            after_wait.add(node)
    return feeds_comm, after_wait


def sink_updates(graph: fx.Graph, lag: int = UPDATE_LAG) -> int:
    """With the optimizer in backward: every wait and every node that reads an all-reduce's result
    and feeds no collective (the bucket's split, the update, its write into the parameter and state)
    moved down, in graph order, to just before the first node that fills the bucket ``lag``
    all-reduces later, or to the end of the graph when there is none, or when it would move past a
    node it shares memory with, one of them writing (``_end_conflicts``). Nothing moves when a node left
    in place reads a moved one. Returns how many nodes moved."""
    nodes = list(graph.nodes)
    feeds_comm, after_wait = readers_of_reductions(nodes)
    movable = [node for node in nodes if node in after_wait and node not in feeds_comm
               and node.op == "call_function"]
    moving = set(movable)
    if any(user not in moving and user.op != "output" for node in movable for user in node.users):
        return 0
    order = {node: k for k, node in enumerate(nodes)}
    collectives = [node for node in nodes if comm_role(node) == "collective"]
    fills = [_fill_start(comm, order) for comm in collectives]
    bucket = _buckets(movable, {comm: k for k, comm in enumerate(collectives)})
    end = len(nodes) - 1  # the output node
    anchor = list(range(len(nodes)))  # position -> the first node at or after it that stays (moved nodes go before)
    for k in reversed(range(end)):
        if nodes[k] in moving:
            anchor[k] = anchor[k + 1]
    spot: dict[fx.Node, int] = {}
    for node in movable:  # graph order: a node's moved inputs have their spots
        k = bucket[node] + lag
        want = order[fills[k]] if 0 <= bucket[node] and k < len(fills) else end
        after = [spot[a] if a in moving else order[a] + 1 for a in node.all_input_nodes]
        spot[node] = anchor[min(max([want] + after), end)]
    _end_conflicts(nodes, movable, spot, order, end)
    log.debug("ddp_opt traced backward: %d wait(s) and node(s) reading all-reduced gradients moved, %d to the end",
              len(movable), sum(spot[node] == end for node in movable))
    for node in movable:
        nodes[spot[node]].prepend(node)
    return len(movable)


def _fill_start(comm: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    """Where ``comm``'s bucket starts to be filled: the earliest of its input (the concatenation) and that
    input's own inputs used by nothing else (each gradient's division into its slice, ``reduce_in_place``)."""
    first = comm
    for arg in comm.all_input_nodes:
        first = min(first, arg, key=order.__getitem__)
        for part in arg.all_input_nodes:
            if set(part.users) == {arg} and part.op == "call_function":
                first = min(first, part, key=order.__getitem__)
    return first


def _buckets(movable: Iterable[fx.Node], index: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Per moved node, the last bucket (its collective's position) whose result it reads; -1 for none."""
    bucket: dict[fx.Node, int] = {}
    for node in movable:
        read = [index.get(node.args[0], -1)] if comm_role(node) == "wait" and node.args else []
        bucket[node] = max(read + [bucket.get(arg, -1) for arg in node.all_input_nodes], default=-1)
    return bucket


def _end_conflicts(nodes: list[fx.Node], movable: list[fx.Node], spot: dict[fx.Node, int],
                   order: dict[fx.Node, int], end: int) -> None:
    """Send to the end every moved node (and what reads it) that its new place puts on the other side of a node
    it conflicts with: one of them writes memory the other reads or writes. Rule and reason: an update writes
    its parameter, and a kernel of backward that reads the parameter may sit below the bucket's fill point in
    the graph although its gradient is final; it must read the old value. The end of the graph is where
    ``optimizer.step()`` runs, after all of backward."""
    roots: dict[fx.Node, frozenset[fx.Node]] = {}
    reads: dict[fx.Node, frozenset[fx.Node]] = {}
    writes: dict[fx.Node, frozenset[fx.Node]] = {}
    for node in nodes:
        shared, written = aliasing(node)
        roots[node] = frozenset().union(*(roots[a] for a in shared)) if shared else frozenset({node})
        reads[node] = frozenset().union(*(roots[a] for a in node.all_input_nodes))
        writes[node] = frozenset().union(*(roots[a] for a in written))

    written = frozenset().union(*writes.values())

    def place(node: fx.Node) -> tuple[int, int, int]:  # a moved node goes just before the node at its spot
        return (spot[node], 0, order[node]) if node in spot else (order[node], 1, 0)

    conflicting = True
    while conflicting:
        conflicting = False
        for node in movable:
            if spot[node] == end or not writes[node] and not reads[node] & written:
                continue
            here = place(node)
            for other in nodes:
                crossed = (order[other] < order[node]) != (place(other) < here)
                if other is not node and crossed and (writes[node] & (reads[other] | writes[other])
                                                      or writes[other] & reads[node]):
                    _send_to_end(node, spot, end)
                    conflicting = True
                    break


def _send_to_end(node: fx.Node, spot: dict[fx.Node, int], end: int) -> None:
    """``node`` and every moved node that reads it, directly or not, to the end."""
    spot[node] = end
    stack = [user for user in node.users if user in spot]
    while stack:
        current = stack.pop()
        if spot[current] != end:
            spot[current] = end
            stack += [user for user in current.users if user in spot]
