"""A compile another rank owns, as :class:`compiler.ranks.share.CompileShare` hands it out: a
callable that loads the owner's artifacts when resolved (Note [Shared compile])."""

from __future__ import annotations

from typing import Any, Callable

from torch import fx

from .barrier import key_label
from .liveness import PeerLost, WaitInterrupted

__all__ = ["Pending"]


class Pending:
    """What :meth:`CompileShare.wrap_compile` returns for a compile another rank owns:
    a callable that loads the owner's artifacts and compiles when resolved (by
    :meth:`CompileShare.resolve_pending` at the end of the graph's compile, or at its
    first call). A compile that still fails then is handed to the failure callbacks
    (``compiler.graph.partition.LazyPartition`` falls back to eager there), else raised."""

    def __init__(self, share: Any, backend: Callable, gm: fx.GraphModule, example_inputs: list,
                 key: str) -> None:
        self.share, self.backend, self.gm, self.example_inputs = share, backend, gm, example_inputs
        self.key, self.label = key, key_label(key)
        self.fn: Callable | None = None
        self.failure_callbacks: list[Callable[[Exception], Callable]] = []

    def resolve(self) -> Callable:
        if self.fn is None:
            try:
                self.fn = self.share._load_or_compile(self)
            except (PeerLost, WaitInterrupted):  # the job ends: no eager fallback for a dead peer
                raise
            except Exception as e:  # noqa: BLE001 - handed to whoever compiled through us
                if not self.failure_callbacks:
                    raise
                for callback in self.failure_callbacks:
                    self.fn = callback(e)
            self.example_inputs = []  # the fakes are not needed any more
        return self.fn

    def __call__(self, *args: Any) -> Any:
        return (self.fn or self.resolve())(*args)
