"""The whole strategy (``compile_ddp(..., strategy="whole")``): each captured graph compiled
whole, DDP's reducer all-reducing its buckets after backward, nothing overlapped; a baseline
for the others."""

from __future__ import annotations

from typing import Callable

from .base import Built, Setup

__all__ = ["build"]


def build(setup: Setup, backend: Callable) -> Built:
    """Each captured graph compiled whole."""
    return Built(backend)
