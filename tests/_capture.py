"""Capture the FX graph dynamo hands a backend, for planner tests."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx


def capture(model: torch.nn.Module, *args: Any, inspect: Callable[[fx.GraphModule, list], None] | None = None) -> fx.GraphModule:
    """Run ``model(*args)`` under dynamo once; return the (single) captured graph.

    ``inspect(gm, example_inputs)`` runs inside the backend call, where dynamo's
    tracing context and fake inputs are live. Plan there: once dynamo is done it
    erases the real tensors behind its placeholders (``meta["grapharg"]``)."""
    graphs = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        if inspect is not None:
            inspect(gm, example_inputs)
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(model, backend=backend)(*args)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, f"expected one graph, dynamo captured {len(graphs)}"
    return graphs[0]


def plan_captured(model: torch.nn.Module, caps, *args: Any, inspect: Callable | None = None) -> list:
    """``plan_buckets`` on the graph of ``model(*args)``, from inside the backend call."""
    from ddp_opt import plan_buckets

    planned = []

    def both(gm, example_inputs):
        planned.extend(plan_buckets(gm, caps))
        if inspect is not None:
            inspect(gm, example_inputs)

    capture(model, *args, inspect=both)
    return planned
