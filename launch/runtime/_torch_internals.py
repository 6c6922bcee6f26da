"""Every private torch name the launcher uses, in one place.

These are ``torch._dynamo`` names with no public equivalent in torch 2.11-2.13;
each function says what it relies on, so that a torch upgrade that moves one
breaks here, visibly, and nowhere else.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# One definition, in the core: dynamo's recompile limit (torch._dynamo.config.recompile_limit).
from compiler._torch_internals import recompile_limit

__all__ = ["RecompileError", "error_on_recompile", "mark_dynamic", "recompile_limit"]

# Raised by dynamo instead of recompiling a frame while `error_on_recompile` is set.
RecompileError = torch._dynamo.exc.RecompileError


@contextlib.contextmanager
def error_on_recompile() -> Iterator[None]:
    """Make a recompile raise :data:`RecompileError` inside the block only
    (``torch._dynamo.config.patch(error_on_recompile=True)``, scoped, not process-wide)."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Compile ``tensor``'s axis ``dim`` as a symbolic size from the first graph on
    (``torch._dynamo.mark_dynamic``; ``torch.compiler`` has no public spelling of it)."""
    torch._dynamo.mark_dynamic(tensor, dim)
