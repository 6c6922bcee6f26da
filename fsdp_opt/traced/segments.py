"""A scheduled traced-FSDP graph run as compiled pieces between its collectives
(Note [Compiled segments]).

Note [Compiled segments]

Background
    Inductor schedules a graph's kernels by its own rules: it orders each collective
    after the previous collective's wait, and places waits where its scheduler likes,
    so the order that Note [Traced FSDP schedule] gives a graph does not survive a
    whole-graph compile. What does survive is a call boundary.

Algorithm
    - Cut the scheduled graph at every collective node (start and wait): each maximal
      run of other nodes is a segment; each collective node is a piece of its own.
    - Compile each segment that computes something (a node other than views, casts and
      concatenations) with the backend's graph compiler (Inductor's
      ``compile_fx_inner``), on fake inputs taken from the graph's metadata.
    - The outer graph, plain Python, calls the pieces in the scheduled order: the
      collectives start, compute runs, and each wait comes where the schedule put it.

Notes
    - Fusion stops at a cut; the cuts are where units begin and end, so most of a
      block's kernels still fuse.
    - ``aot_eager`` needs no cut: an FX graph runs in its node order.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from torch import fx

from compiler import ensure_tuple_output, split_graph

from .._torch_internals import is_collective_start, is_wait
from .schedule import _viewish

log = logging.getLogger(__name__)

__all__ = ["PieceCompiler", "compile_segments", "segment_of"]

# (piece graph, fake example inputs) -> a callable taking the inputs as one list and returning a list or tuple
PieceCompiler = Callable[[fx.GraphModule, list], Callable[[list], Sequence[Any]]]


def segment_of(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Each non-placeholder node's piece: a collective node alone, the runs between them together."""
    part, index = {}, 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_collective_start(node) or is_wait(node):
            part[node] = index + 1
            index += 2
        else:
            part[node] = index
    return part


def _computes(piece: fx.GraphModule) -> bool:
    cheap = {torch.ops.aten.cat.default, torch.ops.aten.constant_pad_nd.default, torch.ops.aten.div.Tensor}
    return any(n.op == "call_function" and not _viewish(n) and n.target not in cheap
               and not is_collective_start(n) and not is_wait(n) for n in piece.graph.nodes)


def _canonical_names(piece: fx.GraphModule) -> None:
    """Name the piece's nodes by position, so that the pieces of identical blocks have identical
    code and the graph compiler's cache (keyed by the code) compiles one and serves the others."""
    for i, node in enumerate(piece.graph.nodes):
        if node.op == "placeholder":
            node._rename(f"arg{i}")
            node.target = node.name  # the argument's name in the generated signature
        elif node.op != "output":
            node._rename(f"v{i}")
    piece.recompile()


class _Compiled(torch.nn.Module):
    """A compiled piece in the outer graph: called with positional tensors, as the outer
    graph calls a child; the compiled code takes them as one list."""

    def __init__(self, compiled: Callable[[list], Sequence[Any]], unwrap: bool) -> None:
        super().__init__()
        self.compiled, self.unwrap = compiled, unwrap

    def forward(self, *args: Any) -> Any:
        out = self.compiled(list(args))
        return out[0] if self.unwrap else tuple(out)


def compile_segments(gm: fx.GraphModule, example_inputs: Sequence[Any], compile_piece: PieceCompiler
                     ) -> fx.GraphModule:
    """``gm`` cut at its collectives, every computing segment compiled by ``compile_piece``.

    Args:
        gm: a scheduled post-AOTAutograd graph (forward, backward or inference).
        example_inputs: its inputs, for the example values of its placeholders.
        compile_piece: compiles one segment from its graph and fake inputs.

    Returns:
        The outer graph module; call it with ``gm``'s inputs.
    """
    part = segment_of(gm)
    split = split_graph(gm, part.__getitem__)
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    for i, n in enumerate(gm.graph.find_nodes(op="placeholder")):
        if vals.get(n.name) is None and i < len(example_inputs):
            vals[n.name] = example_inputs[i]
    compiled = 0
    for name in split.partition_names:
        piece = getattr(split.gm, name)
        if not _computes(piece):
            continue
        fakes = [vals[p.name] for p in piece.graph.find_nodes(op="placeholder")]
        unwrap = ensure_tuple_output(piece)
        _canonical_names(piece)
        setattr(split.gm, name, _Compiled(compile_piece(piece, fakes), unwrap))
        compiled += 1
    log.debug("fsdp_opt traced: %d of %d pieces compiled between the collectives", compiled,
              len(split.partition_names))
    return split.gm
