"""One training step as the loop runs it: micro-batches, gradient sync, autocast,
the optimizer step; and the warm-up pass that compiles every shape first.

Note [Gradient accumulation under compile_ddp]

Background
    ``train.grad_accum=k`` splits each rank's share of the global batch into
    ``k`` micro-batches and takes one optimizer step per ``k`` forward/backward
    passes: the same global batch in less memory.

Algorithm
    All micro-steps but the last run under DDP's ``no_sync()`` (FSDP2:
    ``set_requires_gradient_sync(False)``): their gradients accumulate locally in
    ``.grad``, and the last micro-step's backward all-reduces the sum once. Each
    micro-batch's loss is scaled by ``1/k``, so with equal micro-batches the
    accumulated gradient is the gradient of the mean loss over the whole batch:
    parity with one large-batch step (tests/launch/test_launch_step_multirank.py, 2 ranks).

Notes
    - ``compile_ddp`` compiles the module *inside* DDP, so ``no_sync`` (a flag on
      the DDP wrapper, read outside the graph) is no guard of the compiled
      forward: sync and no-sync micro-steps share one graph.
    - Bucket realignment (Note [Bucket realignment] in ``ddp_opt.alignment.realign``)
      happens before a forward once DDP's reducer is finalized and the plan
      exists. With ``grad_accum > 1`` the first micro-step (no_sync) creates the
      plan and the second re-creates the reducer before its forward; the
      gradients already accumulated in ``.grad`` are untouched by that, and the
      new reducer reads them when the synced backward marks them ready (the
      parity test, tests/launch/test_launch_step_multirank.py, starts with exactly this
      sequence).
    - With variable lengths each micro-batch's loss is the mean over *its* real
      tokens; scaling by ``1/k`` weighs micro-batches equally, not tokens (the
      common practice; exact token weighting would need the step's token count
      before the first backward).

Note [Warm-up]

    Before step 1, :func:`warm_up` runs forward and backward once for each
    input shape training can produce (``launch.data.batching.warmup_lengths``), so
    every graph is compiled before the clock of the first step starts and
    ``train.no_recompile_after_warmup`` can hold from step 1. It must not
    change training: no optimizer step is taken, the gradients are zeroed
    afterwards (in place when the optimizer step is compiled), and the RNG
    states are restored (each step also reseeds from (seed, rank, step)). A
    model with buffers updated in forward (BatchNorm running stats) would see
    the warm-up batches; the models here have none. Under DDP the warm-up
    backward all-reduces like a real step (every rank warms up the same shapes
    in the same order), except with ``ddp.optimizer_in_backward``: there a
    synchronising backward updates the parameters inside it, so the warm-up
    backwards run under ``no_sync`` (no reduction, no update; the compiled
    graphs are the same, Note [Gradient accumulation under compile_ddp]).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.nn.parallel import DistributedDataParallel

from ..data.batching import PaddedBatch, pad_batch, sequence_lengths, warmup_lengths
from ..runtime.guard import all_finite
from ..runtime.precision import autocast
from ..runtime.recompiles import no_recompile
from .optim import OptimizerStep

__all__ = ["StepRunner", "input_names", "micro_batches"]


def micro_batches(data: Any, *, step: int, rank: int, world_size: int, local_batch: int, seq_len: int,
                  grad_accum: int, lengths: str, padding: str, pad_multiple: int, seed: int,
                  device: torch.device) -> list[PaddedBatch]:
    """This rank's batch for ``step``, split into ``grad_accum`` padded micro-batches.

    The rank's batch (and its lengths) does not depend on ``grad_accum``: only
    how it is cut does, so runs with different ``grad_accum`` see the same data."""
    x, y = data.batch(step, rank, world_size, local_batch, seq_len)
    n = sequence_lengths(lengths, seed, rank, step, local_batch, seq_len)
    size = local_batch // grad_accum
    return [pad_batch(x[i:i + size], y[i:i + size], n[i:i + size], padding, pad_multiple, device)
            for i in range(0, local_batch, size)]


def input_names(model: torch.nn.Module) -> tuple[str, str]:
    """The model's names for (inputs, targets), as dynamo's guards name them."""
    names = [n for n, p in inspect.signature(model.forward).parameters.items()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (names + ["inputs", "targets"])[0], (names[1:] + ["targets"])[0]


@contextlib.contextmanager
def _grad_sync(module: torch.nn.Module, enabled: bool) -> Iterator[None]:
    if enabled:
        yield
    elif isinstance(module, DistributedDataParallel):
        with module.no_sync():
            yield
    elif hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


@dataclass
class StepRunner:
    """Runs training steps and the warm-up pass.

    Attributes:
        forward: the (compiled) model, ``forward(inputs, targets) -> (logits, loss)``.
        module: the module gradients sync through (DDP, FSDP or plain).
        optimizer_step: the optimizer step (eager or compiled), zeroing gradients.
        precision, device: the autocast region (``launch.runtime.precision``).
        input_names: the model's argument names for inputs and targets, for errors.
        no_recompile_after_warmup: raise on a recompile after :meth:`warm_up`.
        skip_nonfinite: when the loss is not finite on some rank, skip the update on
            every rank (one all-reduce per step; Note [Finite-loss guard] in ``launch.runtime.guard``).
        backward_context: what every backward runs in (``Wrapped.backward_context``: compiled
            autograd under ``ddp.strategy=traced``).
        update_in_backward: the synchronising backward updates the parameters itself
            (``ddp.optimizer_in_backward``); the optimizer step after it finds no gradients.
    """

    forward: Callable[..., Any]
    module: torch.nn.Module
    optimizer_step: OptimizerStep
    precision: str = "fp32"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    input_names: tuple[str, str] = ("idx", "targets")
    no_recompile_after_warmup: bool = False
    skip_nonfinite: bool = False
    backward_context: Callable[[], ContextManager] = contextlib.nullcontext
    update_in_backward: bool = False
    warmup_shapes: list[tuple[int, ...]] = field(default_factory=list)
    _warm: bool = False
    skipped: bool = False  # the last step's update was skipped (non-finite loss, skip_nonfinite)
    grad_norm: torch.Tensor | None = None  # the last step's gradient norm before clipping (train.max_grad_norm)

    def step(self, batches: list[PaddedBatch], step: int) -> torch.Tensor:
        """Forward/backward every micro-batch, then one optimizer step.

        Returns:
            The mean of the micro-batches' losses, detached.
        """
        k = len(batches)
        total = torch.zeros((), device=self.device)
        scaler = self.optimizer_step.scaler
        for i, b in enumerate(batches):
            with _grad_sync(self.module, enabled=i == k - 1):
                loss = self._forward(b, step)
                scaled = loss / k
                with self.backward_context():
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
            total += scaled.detach().float()
        # Note [Finite-loss guard] in launch.runtime.guard: under skip, every rank agrees before the update.
        self.skipped = self.skip_nonfinite and not all_finite(total)
        self.grad_norm = None
        if self.skipped:
            self._skip_update()
        else:
            self.grad_norm = self.optimizer_step()  # clips first (Note [Gradient clipping] in launch.step.optim)
        return total

    def _skip_update(self) -> None:
        """Drop this step's gradients without an optimizer step (nor its moments and step count)."""
        opt = self.optimizer_step
        opt.optimizer.zero_grad(set_to_none=not opt.compiled)
        if opt.scaler is not None:  # as GradScaler.update does on inf gradients: back the scale off
            opt.scaler.update(opt.scaler.get_scale() * opt.scaler.get_backoff_factor())

    def _forward(self, b: PaddedBatch, step: int) -> torch.Tensor:
        inputs = dict(zip(self.input_names, (b.inputs, b.targets)))
        with no_recompile(self._warm and self.no_recompile_after_warmup, inputs, step, self.warmup_shapes):
            with autocast(self.precision, self.device):
                _, loss = self.forward(b.inputs, b.targets)
        return loss

    def warm_up(self, data: Any, *, rank: int, world_size: int, micro_batch: int, seq_len: int, padding: str,
                pad_multiple: int) -> list[tuple[int, ...]]:
        """Compile every shape training can produce (Note [Warm-up]).

        Returns:
            The input shapes fed, in order.
        """
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        x, y = data.batch(0, rank, world_size, micro_batch, seq_len)
        shapes = []
        for length in warmup_lengths(seq_len, padding, pad_multiple):
            full = torch.full((micro_batch,), length, dtype=torch.int64)
            b = pad_batch(x, y, full, padding, pad_multiple, self.device)
            with _grad_sync(self.module, enabled=not self.update_in_backward):  # Note [Warm-up]
                loss = self._forward(b, step=0)
                with self.backward_context():
                    loss.backward()
            shapes.append(tuple(b.inputs.shape))
        self.optimizer_step.optimizer.zero_grad(set_to_none=not self.optimizer_step.compiled)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        self.warmup_shapes, self._warm = shapes, True
        return shapes
