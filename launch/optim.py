"""The optimizer and its step, eager or compiled (``compile.optimizer``).

Note [Compiled optimizer step]

Background
    An eager AdamW step over many parameters is a long chain of small kernels
    (even the ``foreach`` implementation launches a few per parameter group and
    op). ``torch.compile`` of ``optimizer.step`` fuses the update into a few
    kernels: on a GPU that is the difference between launch-bound and
    bandwidth-bound, on a CPU it mostly saves Python overhead.

Algorithm
    :func:`build_optimizer` makes AdamW with the ``fused`` implementation on
    CUDA (one kernel per step, eager) and ``foreach`` elsewhere. With
    ``compile.optimizer=true``, :class:`OptimizerStep` compiles a function that
    calls ``optimizer.step()`` with the job's backend; its first call also
    creates the optimizer state, so the first training step compiles it (once;
    no optimizer step is taken during warm-up, which must not change the
    weights).

Notes
    - Gradients at stable addresses: when the step is compiled, gradients are
      zeroed in place (``zero_grad(set_to_none=False)``) rather than freed. The
      compiled step reads the same gradient tensors every step (no fresh
      allocation in backward, and, under CUDA graphs, no copy of each gradient
      into the graph's static input buffers), and backward accumulates into
      zeros, which gives exactly the values a fresh gradient would have.
    - Parity (tests/test_launch_optim.py, aot_eager, 4 steps): after step 1
      parameters equal the eager optimizer's within an ulp (1.2e-7 seen); later
      steps carry those ulps on, within 1e-5 (rtol and atol), except the
      attention's key bias, whose gradient is analytically zero (float noise
      that Adam normalises to about lr * g / eps): within 1e-4 there.
    - The compiled step's frames are compiled by dynamo like the model's: their
      recompiles (none in the tests) count in the run's summary.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

__all__ = ["build_optimizer", "OptimizerStep"]


def build_optimizer(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW, ``fused`` on CUDA and ``foreach`` elsewhere."""
    if device.type == "cuda":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)


class OptimizerStep:
    """``optimizer.step()`` then zero the gradients; compiled when ``backend`` is given.

    Args:
        optimizer: the optimizer.
        backend: a dynamo backend (name or callable) to compile the step with, or
            None for the eager step.
        scaler: a ``GradScaler`` (fp16): the step goes through ``scaler.step``
            and ``scaler.update`` (eager only).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, backend: str | Callable | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        if backend is not None and scaler is not None:
            raise ValueError("a compiled optimizer step with a GradScaler is not supported: use one of them")
        self.optimizer, self.scaler, self.compiled = optimizer, scaler, backend is not None
        self._step: Callable[[], Any] = self._eager_step
        if backend is not None:
            self._step = torch.compile(self._eager_step, backend=backend)

    def _eager_step(self) -> None:
        self.optimizer.step()

    def __call__(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self._step()
        # Note [Compiled optimizer step]: in place when compiled (stable addresses).
        self.optimizer.zero_grad(set_to_none=not self.compiled)
