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
    - A changing lr (Note [LR schedule] in ``launch.step.schedule``): a float lr in
      the param groups is a constant to dynamo, so each new value recompiles
      the step (5 graphs for 5 values, tested). With ``tensor_lr`` the compiled
      step reads the lr from one 0-dim tensor per group, updated in place, so
      the step compiles once. Around the compiled call only, each group's
      ``lr`` is that tensor and, unless the group is ``fused`` or
      ``capturable``, ``foreach`` is False: torch's foreach Adam refuses a
      tensor lr without ``capturable``, which CPU tensors cannot be. Outside the
      call the groups hold a float lr and their own flags, so checkpoints (and
      DCP's eager ``_init_optim_state`` on load) never see the tensor.

Note [Gradient clipping]

    ``train.max_grad_norm > 0`` clips the gradients' total L2 norm right before
    the optimizer step, eagerly (also when the step is compiled): after the last
    micro-step's backward, so over the accumulated and synchronised gradients
    (DDP all-reduced, FSDP2 reduce-scattered shards); after
    ``GradScaler.unscale_`` under fp16, so the norm and the clip are of the true
    gradients (``scaler.step`` then skips the update on inf, as without
    clipping); never on a step skipped for a non-finite loss (no norm is taken
    there). FSDP2's gradients are DTensor shards: the norm is computed over the
    shards and reduced (``full_tensor``), the same total on every rank, as
    torchtitan does. Parity with ``torch.nn.utils.clip_grad_norm_`` on one
    process's full batch: tests/test_launch_clip_multirank.py.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = ["build_optimizer", "OptimizerStep", "clip_grad_norm"]


def build_optimizer(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW, ``fused`` on CUDA and ``foreach`` elsewhere."""
    if device.type == "cuda":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their total L2 norm is at most ``max_norm``; return
    the norm before clipping (Note [Gradient clipping]). DTensor gradients (FSDP2)
    give their global norm, the same on every rank."""
    params = [p for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    full_tensor = getattr(total, "full_tensor", None)
    if callable(full_tensor):  # a DTensor: the norm over every rank's shards
        total = full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


class OptimizerStep:
    """Clip, ``optimizer.step()``, then zero the gradients; compiled when ``backend`` is given.

    Args:
        optimizer: the optimizer.
        backend: a dynamo backend (name or callable) to compile the step with, or
            None for the eager step.
        scaler: a ``GradScaler`` (fp16): the step goes through ``scaler.step``
            and ``scaler.update`` (eager only).
        max_grad_norm: clip the gradients' total norm to this first; 0: no clipping.
        tensor_lr: the compiled step reads the lr as a tensor, so that
            :meth:`set_lr` does not recompile it (Note [Compiled optimizer step]).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, backend: str | Callable | None = None,
                 scaler: torch.amp.GradScaler | None = None, *, max_grad_norm: float = 0.0,
                 tensor_lr: bool = False) -> None:
        if backend is not None and scaler is not None:
            raise ValueError("a compiled optimizer step with a GradScaler is not supported: use one of them")
        self.optimizer, self.scaler, self.compiled = optimizer, scaler, backend is not None
        self.max_grad_norm = max_grad_norm
        self._step: Callable[[], Any] = self._eager_step
        self._lr_tensors: list[torch.Tensor] | None = None
        if backend is not None:
            self._step = torch.compile(self._eager_step, backend=backend)
            if tensor_lr:
                self._lr_tensors = [torch.tensor(float(g["lr"]), device=g["params"][0].device)
                                    for g in optimizer.param_groups]

    def _eager_step(self) -> None:
        self.optimizer.step()

    def set_lr(self, lr: float) -> None:
        """The lr of the coming steps, on every param group (and its tensor)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for t in self._lr_tensors or ():
            t.fill_(lr)

    def __call__(self) -> torch.Tensor | None:
        """One step. Returns the gradients' total norm before clipping, or None without clipping."""
        norm = None
        if self.scaler is not None:
            if self.max_grad_norm > 0:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
                norm = self._clip()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if self.max_grad_norm > 0:
                norm = self._clip()
            with self._tensor_lr():
                self._step()
        # Note [Compiled optimizer step]: in place when compiled (stable addresses).
        self.optimizer.zero_grad(set_to_none=not self.compiled)
        return norm

    def _clip(self) -> torch.Tensor:
        return clip_grad_norm((p for g in self.optimizer.param_groups for p in g["params"]), self.max_grad_norm)

    @contextlib.contextmanager
    def _tensor_lr(self) -> Iterator[None]:
        """Each group's lr as its tensor, for the compiled call only (Note [Compiled optimizer step])."""
        if self._lr_tensors is None:
            yield
            return
        groups = self.optimizer.param_groups
        saved = [(g["lr"], g.get("foreach")) for g in groups]
        for g, t in zip(groups, self._lr_tensors):
            t.fill_(float(g["lr"]))
            g["lr"] = t
            if not (g.get("fused") or g.get("capturable")):
                g["foreach"] = False
        try:
            yield
        finally:
            for g, (lr, foreach) in zip(groups, saved):
                g["lr"], g["foreach"] = lr, foreach
