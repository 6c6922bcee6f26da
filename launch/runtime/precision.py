"""Mixed precision for the training step: the autocast region and the grad scaler.

Note [Autocast outside the compiled forward]

Background
    ``train.precision`` picks ``fp32`` (no autocast), ``bf16`` (autocast to
    bfloat16, CPU and CUDA) or ``fp16`` (autocast to float16 with a
    ``GradScaler``, CUDA only: float16's 5-bit exponent underflows small
    gradients to zero unless the loss is scaled up first).

Algorithm
    The loop enters :func:`autocast` around forward and loss, *outside* the
    compiled forward. Dynamo records the ambient autocast state in its global
    state guard and AOTAutograd traces the model under it, so the captured
    graph holds the concrete ``bf16`` casts (``_to_copy`` nodes) and no autocast
    region at all: the DDP planner splits an ordinary graph (tested in
    tests/launch/test_launch_optim.py; a region inside the model's forward would be
    cut and re-entered per partition, Note [Bucket planning]).
    Parameters, gradients and the optimizer state stay float32; DDP reduces
    float32 gradients.

Notes
    - Parity tolerances (tests/launch/test_launch_step_multirank.py, 2 ranks, 3 steps
      of a small GPT): compiled DDP (aot_eager) in bf16 matches eager DDP in
      bf16 within 1e-3 on the losses and 1e-4 on the parameters (aot_eager runs
      the same casts; the margin is for fusing backends); bf16 losses match fp32
      within 1e-2 (bf16 keeps 8 bits of mantissa).
    - The warm-up pass runs under the same autocast as training: the autocast
      state is part of the guard, a different one would be a recompile.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["PRECISION_DTYPES", "autocast", "grad_scaler"]

PRECISION_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Autocast to ``precision``'s dtype on ``device`` (nothing for fp32)."""
    dtype = PRECISION_DTYPES[precision]
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A ``GradScaler`` for fp16 (CUDA), None otherwise."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)
