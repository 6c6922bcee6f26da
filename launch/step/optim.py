"""The optimizer and its step, eager or compiled (``compile.optimizer``).

Note [Compiled optimizer step]

Background
    An eager AdamW step over many parameters is a long chain of small kernels.
    ``torch.compile`` of ``optimizer.step`` fuses it into a few: on a GPU the difference
    between launch-bound and bandwidth-bound, on a CPU mostly Python overhead saved.

Algorithm
    :func:`build_optimizer` makes AdamW, ``fused`` on CUDA and ``foreach`` elsewhere. With
    ``compile.optimizer=true``, :class:`OptimizerStep` compiles a function calling
    ``optimizer.step()``; its first call creates the optimizer state, so the first
    training step compiles it (warm-up takes no optimizer step: it must not change the
    weights).

Notes
    - When the step is compiled, gradients are zeroed in place
      (``zero_grad(set_to_none=False)``): the compiled step reads the same tensors every
      step (no copy into CUDA graphs' static inputs), and accumulating into zeros gives
      exactly a fresh gradient's values.
    - Parity (tests/launch/test_launch_optim.py): within an ulp after step 1, within 1e-5 later,
      except a gradient that is analytically zero (float noise Adam normalises): 1e-4.
    - A float lr is a constant to dynamo, so each new value recompiles. With ``tensor_lr``
      the step reads each group's lr from a 0-dim tensor updated in place, and compiles
      once. Only around the compiled call is ``lr`` that tensor (and ``foreach`` off
      unless ``fused``/``capturable``: foreach Adam refuses a tensor lr on CPU), so
      checkpoints never see it.

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
    process's full batch: tests/launch/test_launch_clip_multirank.py.

Note [Optimizer before the wrapping]

    ``ddp.optimizer_in_backward=true`` gives the job's AdamW to ``compile_ddp`` (Note
    [Optimizer in backward] in ``ddp_opt.in_backward.stepper``), so it must exist before the
    model is compiled: :func:`wrap_with_optimizer` builds it over the model's parameters, which
    DDP keeps as they are, then wraps. Otherwise it is built after the wrapping, over the wrapped
    module's parameters (FSDP2 replaces them with its shards). Either way it is the one
    optimizer object of the run: the checkpoint saves it and a resume loads into it, so
    the updates inside backward continue from the loaded state.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch

from ..config.schema import JobConfig, ParallelMode
from ..runtime.dist import DistEnv
from ..runtime.parallel import Wrapped, apply_parallel

__all__ = ["build_optimizer", "wrap_with_optimizer", "OptimizerStep", "clip_grad_norm"]


def build_optimizer(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW, ``fused`` on CUDA and ``foreach`` elsewhere."""
    if device.type == "cuda":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)


def wrap_with_optimizer(model: torch.nn.Module, cfg: JobConfig, env: DistEnv,
                        wrap_backend: Callable[[Callable], Callable] | None = None
                        ) -> tuple[Wrapped, torch.optim.AdamW]:
    """Wrap ``model`` (``launch.runtime.parallel.apply_parallel``) and build the job's AdamW, in the
    order Note [Optimizer before the wrapping] gives."""
    t = cfg.train
    if cfg.parallel.name == ParallelMode.DDP and cfg.ddp.optimizer_in_backward:
        optimizer = build_optimizer(model.parameters(), t.lr, t.weight_decay, env.device)
        return apply_parallel(model, cfg, env, wrap_backend, optimizer), optimizer
    wrapped = apply_parallel(model, cfg, env, wrap_backend)
    return wrapped, build_optimizer(wrapped.module.parameters(), t.lr, t.weight_decay, env.device)


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
