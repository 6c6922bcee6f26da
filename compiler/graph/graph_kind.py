"""What kind of graph a backend is compiling: one whose backward will run, or not.

A graph captured under ``torch.no_grad()`` (an evaluation, often on one rank only)
or whose inputs need no gradient never runs a backward, so nothing collective
follows it in data-parallel training: no gradient bucket to plan, no plan to
agree on with peers, no barrier to hold them at. Dynamo calls the backend with
the grad mode of the frame it captured, so the mode read here is the graph's.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["produces_gradients"]


def produces_gradients(example_inputs: Sequence[Any]) -> bool:
    """True when the graph being compiled will run a backward: grad mode is on and
    some input (a lifted parameter, an activation) requires a gradient."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
