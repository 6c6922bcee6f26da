"""Graph splitting: cut one FX graph into partitions by a ``Node -> int`` policy.

The policy is the whole plan: a caller decides which node goes where (``ddp_opt``
by gradient buckets, a test by hand) and this module does the cut, carries
dynamo's metadata to the pieces and makes each piece return a tuple, which
AOTAutograd-based backends require.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import fx
from torch.fx.passes.split_module import split_module

from . import _torch_internals as _ti

__all__ = ["SplitGraph", "split_graph", "ensure_tuple_output"]


@dataclass
class SplitGraph:
    """The result of :func:`split_graph`.

    Attributes:
        gm: the outer graph; each partition is a ``call_module`` of a child.
        partition_names: child names in execution order (``submod_0``, ...).
    """

    gm: fx.GraphModule
    partition_names: list[str]

    def partitions(self) -> list[fx.GraphModule]:
        return [getattr(self.gm, n) for n in self.partition_names]


def split_graph(gm: fx.GraphModule, partition_of: Callable[[fx.Node], int]) -> SplitGraph:
    """Split ``gm`` so that each node lands in partition ``partition_of(node)``.

    Partition indices must not decrease along the graph's node order for nodes
    that depend on each other (a plan built by walking the graph guarantees it).

    Args:
        gm: a graph module captured by dynamo (or built by hand).
        partition_of: the policy, called once per non-placeholder, non-output node.

    Returns:
        A :class:`SplitGraph` whose outer graph calls the partitions in order.
    """
    split_gm = split_module(gm, None, partition_of)  # type: ignore[arg-type]
    names = [
        n.target
        for n in split_gm.graph.nodes
        if n.op == "call_module" and str(n.target).startswith("submod_")
    ]
    split_gm.meta["partition_names"] = names
    _carry_dynamo_metadata(gm, split_gm, names)
    return SplitGraph(split_gm, names)


def _carry_dynamo_metadata(orig: fx.GraphModule, split_gm: fx.GraphModule, names: list[str]) -> None:
    # AOTAutograd reads a placeholder's dynamo source to tell parameters (static
    # inputs) from activations, and the graph's meta for tracing settings. A node
    # that was internal to the whole graph becomes a placeholder of a piece and
    # simply has no source, as in PyTorch's own splitter. HOP bodies (wrap_body_*)
    # are children of the split graph too but keep their own metadata.
    sources = _ti.placeholder_sources(orig)
    for name in names:
        piece = getattr(split_gm, name)
        piece.meta = orig.meta
        _ti.carry_sources(orig, piece, sources)


def ensure_tuple_output(gm: fx.GraphModule) -> bool:
    """Make ``gm`` return a tuple. Returns True when a singleton was wrapped, so the
    caller can unwrap the compiled result again."""
    (out,) = gm.graph.find_nodes(op="output")
    if isinstance(out.args[0], (tuple, list)):
        return False
    out.args = ((out.args[0],),)
    gm.graph.lint()
    gm.recompile()
    return True

