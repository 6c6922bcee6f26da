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

from .. import _torch_internals as _ti

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
    that depend on each other (a plan built by walking the graph guarantees it),
    nor for any node when the graph holds an autocast or grad-mode region:
    ``split_module`` then re-enters the region in each partition it cuts through.

    Args:
        gm: a graph module captured by dynamo (or built by hand).
        partition_of: the policy, called once per non-placeholder, non-output node.

    Returns:
        A :class:`SplitGraph` whose outer graph calls the partitions in order.
    """
    _ti.warn_if_missing_at_import(_ti.REGIONS, "a captured graph's autocast or grad-mode nodes are not recognised: "
                                  "the partitions' order around them is not checked and the grad mode is not "
                                  "restored between partitions")
    _check_order_around_regions(gm, partition_of)
    # Partitions run in index order (split_module's default is a topological order
    # that may run an independent later piece first): a grad-mode switch a piece
    # leaves set is only undone by the pieces after it in the node order.
    split_gm = split_module(gm, None, partition_of, keep_original_order=True)  # type: ignore[arg-type]
    names = [
        n.target
        for n in split_gm.graph.nodes
        if n.op == "call_module" and str(n.target).startswith("submod_")
    ]
    split_gm.meta["partition_names"] = names
    _restore_grad_mode_between_partitions(gm, split_gm, names)
    _carry_dynamo_metadata(gm, split_gm, names)
    return SplitGraph(split_gm, names)


def _check_order_around_regions(gm: fx.GraphModule, partition_of: Callable[[fx.Node], int]) -> None:
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    region = next((n for n in nodes if n.op == "call_function" and n.target in _ti.SPLIT_REENTERED_TARGETS), None)
    if region is None:
        return
    highest = None
    for node in nodes:
        pid = partition_of(node)
        if highest is not None and pid < highest[1]:
            raise ValueError(
                f"split_graph: node {node.name!r} is in partition {pid}, after {highest[0]!r} in partition "
                f"{highest[1]}. The graph holds an autocast or grad-mode region ({region.name!r}), which "
                "split_module re-enters in each partition only when partition indices never decrease along the "
                "node order. Give the partition policy consecutive runs of nodes (as plan_buckets does)."
            )
        highest = (node.name, pid)


def _restore_grad_mode_between_partitions(orig: fx.GraphModule, split_gm: fx.GraphModule, names: list[str]) -> None:
    # split_module re-enters a grad-mode region at the start of each later partition
    # but does not leave it at the end of a piece, so a piece cut inside no_grad
    # returns with grad off: the next piece would then be compiled (AOTAutograd
    # decides on the grad mode at its first call) as inference-only, though it
    # turns grad back on inside, and the gradients through it would be lost. Each
    # piece but the last puts the mode back to the graph's entry mode; the last
    # leaves it as the whole graph did.
    switches = [n for n in orig.graph.nodes if n.op == "call_function" and n.target is _ti.SET_GRAD_ENABLED]
    if not switches:
        return
    entry = not switches[0].args[0]  # dynamo records a switch only when it changes the mode
    for name in names[:-1]:
        piece = getattr(split_gm, name)
        inside = [n for n in piece.graph.nodes if n.op == "call_function" and n.target is _ti.SET_GRAD_ENABLED]
        if inside and inside[-1].args[0] != entry:
            (out,) = piece.graph.find_nodes(op="output")
            with piece.graph.inserting_before(out):
                piece.graph.call_function(_ti.SET_GRAD_ENABLED, (entry,))
            piece.graph.lint()
            piece.recompile()


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

