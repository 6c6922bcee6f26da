"""Counting compiles during a run, and the no-recompile-after-warm-up stance.

Note [Recompile accounting]

Background
    A recompile costs a compile (seconds to minutes) in the middle of training,
    and after ``torch._dynamo.config.recompile_limit`` of them dynamo gives up
    on the frame and runs it eagerly, silently. Variable-length batches are the
    usual cause (Note [Padding strategies] in ``launch.data.batching``).

Algorithm
    - Counting reuses :class:`compiler.Diagnoser`: it wraps the model's
      backend (every captured graph passes through it) and reads the recompiles
      from dynamo's compilation metrics. :class:`CompileCounter` takes a
      snapshot after warm-up and at the end, so the summary can say how many
      graphs and recompiles each phase had.
    - ``train.no_recompile_after_warmup=true``: after warm-up the model's forward
      runs under ``torch._dynamo.config.patch(error_on_recompile=True)``, scoped
      to that call (the compiled optimizer step is not covered; it compiles in
      step 1). Dynamo then raises ``RecompileError`` before compiling, and
      :func:`no_recompile` turns it into :class:`RecompileAfterWarmupError`
      naming the input, its shape and the shapes warm-up compiled.

Notes
    - With ``parallel=fsdp`` the blocks are compiled by ``fsdp_opt`` out of the
      diagnoser's reach: counts are None there (the stance still works, it is
      dynamo's flag).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from compiler import Diagnoser, size_guard

from ._torch_internals import RecompileError, error_on_recompile, refuse_no_recompile

__all__ = ["CompileCounter", "CompileCounts", "RecompileAfterWarmupError", "no_recompile"]


@dataclass
class CompileCounts:
    graphs: int
    recompiles: int


class CompileCounter:
    """Graphs and recompiles seen by a :class:`Diagnoser` since :meth:`start`."""

    def __init__(self, diagnoser: Diagnoser) -> None:
        self.diagnoser = diagnoser

    def start(self) -> None:
        self.diagnoser.__enter__()

    def snapshot(self) -> CompileCounts:
        self.diagnoser.__exit__(None, None, None)  # re-reads the metrics since start()
        return CompileCounts(len(self.diagnoser.graphs), len(self.diagnoser.recompiles()))


class RecompileAfterWarmupError(RuntimeError):
    """A recompile after warm-up under ``train.no_recompile_after_warmup=true``."""


@contextlib.contextmanager
def no_recompile(enabled: bool, inputs: dict[str, torch.Tensor], step: int,
                 warmup_shapes: list[tuple[int, ...]]) -> Iterator[None]:
    """Raise :class:`RecompileAfterWarmupError` if the body would recompile.

    Args:
        enabled: False: do nothing.
        inputs: the model's inputs by argument name, to name the one that changed.
        step: the training step, for the message.
        warmup_shapes: the input shapes warm-up compiled.
    """
    if not enabled:
        yield
        return
    refuse_no_recompile()  # a torch without dynamo's RecompileError (the launcher's checks refuse it first)
    try:
        with error_on_recompile():
            yield
    except RecompileError as e:
        raise RecompileAfterWarmupError(_message(str(e), inputs, step, warmup_shapes)) from None


def _message(reason: str, inputs: dict[str, torch.Tensor], step: int, warmup_shapes: list[tuple[int, ...]]) -> str:
    size = size_guard(reason)
    if size and size[0] in inputs:
        name = size[0]
        what = (f"input '{name}' has shape {tuple(inputs[name].shape)} (axis {size[1]} changed), "
                "a shape warm-up did not compile")
    else:
        shapes = ", ".join(f"'{k}' {tuple(v.shape)}" for k, v in inputs.items())
        what = f"a guard failed for inputs {shapes}"
    guard = "; ".join(line.strip()[2:] for line in reason.splitlines() if line.strip().startswith("- "))
    return (
        f"train.no_recompile_after_warmup=true and step {step} would recompile the model: {what} "
        f"(warm-up compiled {', '.join(str(s) for s in warmup_shapes)}; dynamo: {guard}). A recompile after "
        "warm-up stalls training for a compile and counts toward torch._dynamo.config.recompile_limit. "
        "Fix: feed this shape during warm-up, use data.padding=multiple (warm-up compiles every padded shape) "
        "or data.padding=dynamic (one graph for all lengths); or set train.no_recompile_after_warmup=false "
        "to allow recompiles."
    )
