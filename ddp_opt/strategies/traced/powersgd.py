"""PowerSGD under the traced strategy (``compile_ddp(strategy="traced", compression="powersgd:4")``):
the power iteration, its all-reduces and its memories traced into the compiled backward.

Note [Traced PowerSGD]

Background
    The traced strategy's python reducer calls a hook per gradient inside the backward
    compiled autograd traces (Note [Traced strategy]); PyTorch's ``powerSGD_hook`` takes a
    DDP bucket and keeps memories per bucket index (Note [PowerSGD compression]). Sending
    each matrix's P and Q alone would cost two round trips per matrix, where PowerSGD
    gains on a slow link by sending few, small messages.

Algorithm
    - Memories per parameter, made when compiling, for each gradient PyTorch's rule would
      compress (``shape[0] x rest``, rank ``r = min(n, m, R)``, when ``2 (n + m) r < n m``):
      an error ``E`` (zeros) and a ``Q`` (normal, generator seeded 0, equal on every rank),
      graph inputs written back in place.
    - Hooks per parameter (:func:`attach`) are traced in gradient-ready order, so the
      bookkeeping runs once while tracing and leaves a fixed graph; DDP's own hook is a no-op.
    - Buckets fill up to the traced plan's caps (``TracedPlan.caps``) and go in PyTorch's
      three stages: (1) ``M = grad + E``, ``P = M orth(Q)``, one all-reduce of the
      uncompressed gradients and the P's; (2) ``P = orth(P)``, ``Q = M^T P``, one
      all-reduce of the Q's; (3) ``grad = P Q^T / world``, ``E = M - grad``. When bucket k
      closes it enters stage 1, k-1 stage 2, k-2 stage 3, so each wait comes after the
      next bucket's gradients; every rank traces one graph, so the collectives keep one
      order. ``orth`` is Gram-Schmidt for ``r <= 2`` and half dtypes, else QR.
    - The products with a rank-r factor are taken transposed, the same sums on a faster
      kernel (Note [Products with a rank-r factor] in ``factors.py``).
    - The first START synchronised steps (counted as ``compiled.backward`` ends) reduce
      uncompressed; then the backward compiles once more with compression. A backward
      leaving some parameters without gradient is refused before the optimizer step.

Numerics
    Per matrix the arithmetic is PyTorch's hook's (tests/ddp_opt/test_ddp_traced_powersgd.py).
    Unlike it, no error is kept for uncompressed tensors, and the first Q is drawn per
    matrix, not per bucket.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..._torch_internals import is_ddp_ignored
from ...compression.factors import compressed_shape, orthogonalize, project, project_back
from ...compression.powersgd import PowerSGD
from ...planning.buckets import BucketCaps
from ._torch_internals import add_python_reducer_hook, functional_all_reduce

__all__ = ["TracedPowerSGD", "attach"]

SEED = 0  # the first Q's, as PowerSGD.state's random_seed


class TracedPowerSGD:
    """The traced hooks' state: per-parameter memories, the step count, and the bookkeeping of
    one backward while it is traced (Note [Traced PowerSGD]).

    Args:
        spec: the rank and the start.
        ddp_model: the DDP module (its group; its ``require_backward_grad_sync``).
        params: the parameters DDP reduces, in its order.
        plan: what holds ``caps`` (a ``TracedPlan``), read when a backward is traced.
    """

    def __init__(self, spec: PowerSGD, ddp_model: DistributedDataParallel, params: list[torch.nn.Parameter],
                 plan: Any) -> None:
        self.spec = spec
        self.ddp = ddp_model
        self.group = ddp_model.process_group
        self.world_size = dist.get_world_size(self.group)
        self.plan = plan
        self.expected = len(params)
        self.steps = 0
        self.compressing = False
        self.layout: tuple[int, ...] = ()  # gradients per bucket, as the last compressed backward was traced
        generator = torch.Generator().manual_seed(SEED)
        self.errors: list[torch.Tensor | None] = []
        self.qs: list[torch.Tensor | None] = []
        for param in params:
            shape = compressed_shape(param, spec.rank)
            n, m, rank = shape or (0, 0, 0)
            self.errors.append(torch.zeros(n, m, dtype=param.dtype, device=param.device) if shape else None)
            self.qs.append(torch.randn(m, rank, generator=generator).to(param.device, param.dtype)
                           if shape else None)
        self._clear()

    @property
    def compressed(self) -> int:
        """How many of the parameters' gradients are sent as P and Q."""
        return sum(e is not None for e in self.errors)

    def _clear(self) -> None:
        self._arrived, self._pending_bytes = 0, 0
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._inflight: list[list[Any]] = []
        self._sizes: list[int] = []  # gradients per bucket closed so far in this backward

    @contextlib.contextmanager
    def backward(self, inner: contextlib.AbstractContextManager, sync: bool) -> Iterator[None]:
        """A backward in ``inner`` (compiled autograd's context), counted as a step when it
        synchronises: it compresses from step ``spec.start``; one that left a parameter
        without a gradient is refused as it ends, before the optimizer step."""
        self.check_complete()
        if sync:
            self.compressing = self.steps >= self.spec.start
        try:
            with inner:
                yield
        except BaseException:
            self._clear()  # a backward that failed midway leaves no bookkeeping behind
            raise
        self.check_complete()
        self.steps += sync

    def check_complete(self) -> None:
        """Raise if the last backward gave a gradient to some of the parameters only."""
        if not (self._arrived or self._inflight):
            return
        arrived = self._arrived
        self._clear()
        raise RuntimeError(
            f"compile_ddp(strategy='traced', compression='{self.spec}'): the last backward gave gradients to "
            f"{arrived} of the {self.expected} parameters DDP reduces, so the compressed all-reduces of its last "
            "bucket never ran and the ranks' gradients differ. Under the traced strategy with PowerSGD every "
            "parameter needs a gradient in every synchronised step: freeze the others (requires_grad=False) before "
            "DDP(...) and compile_ddp, or use strategy='split' with DDP(..., find_unused_parameters=True).")

    def gradient_ready(self, index: int, grad: torch.Tensor) -> None:
        """The hook of parameter ``index``: its gradient is accumulated."""
        if not self.compressing:  # the python reducer's own all-reduce, which the plan fuses
            grad.copy_(functional_all_reduce(grad / self.world_size, self.group))
            return
        self._pending.append((index, grad))
        self._pending_bytes += grad.numel() * grad.element_size()
        self._arrived += 1
        last = self._arrived == self.expected
        caps: BucketCaps = self.plan.caps
        if last or self._pending_bytes >= caps.cap_for(len(self._sizes)):
            self._inflight.append([0, self._pending])  # [stages done, entries]
            self._sizes.append(len(self._pending))
            self._pending, self._pending_bytes = [], 0
            self._advance_all()  # the new bucket's stage 1, one stage further for the older ones
        if last:
            while self._inflight:
                self._advance_all()
            self.layout = tuple(self._sizes)
            self._clear()

    def _advance_all(self) -> None:
        """Every bucket in flight one stage further, oldest first; the finished ones dropped."""
        for bucket in self._inflight:
            self._advance(bucket)
        self._inflight = [b for b in self._inflight if b[0] < 3]

    def _advance(self, bucket: list[Any]) -> None:
        stage = bucket[0]
        if stage == 0:
            self._send_ps(bucket)
        elif stage == 1:
            self._send_qs(bucket)
        else:
            self._decompress(bucket)
        bucket[0] = stage + 1

    def _send_ps(self, bucket: list[Any]) -> None:
        plain, low = [], []
        for index, grad in bucket[1]:
            if self.errors[index] is None:
                plain.append(grad)
                continue
            matrix = grad.reshape(grad.shape[0], -1) + self.errors[index]
            low.append((index, grad, matrix, project(matrix, orthogonalize(self.qs[index]))))
        flat = torch.cat([g.reshape(-1) for g in plain] + [p.reshape(-1) for *_, p in low])
        bucket[1] = (plain, low, functional_all_reduce(flat, self.group))

    def _send_qs(self, bucket: list[Any]) -> None:
        plain, low, reduced = bucket[1]
        offset = 0
        for grad in plain:
            grad.copy_(reduced[offset:offset + grad.numel()].view_as(grad) / self.world_size)
            offset += grad.numel()
        sent = []
        for index, grad, matrix, p in low:
            p = orthogonalize(reduced[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
            sent.append((index, grad, matrix, p, project_back(matrix, p)))
        qs = functional_all_reduce(torch.cat([q.reshape(-1) for *_, q in sent]), self.group) if sent else None
        bucket[1] = (sent, qs)

    def _decompress(self, bucket: list[Any]) -> None:
        sent, reduced = bucket[1]
        offset = 0
        for index, grad, matrix, p, q in sent:
            q = reduced[offset:offset + q.numel()].view_as(q) / self.world_size
            offset += q.numel()
            approx = p @ q.t()
            self.errors[index].copy_(matrix - approx)
            self.qs[index].copy_(q)
            grad.copy_(approx.view_as(grad))
        bucket[1] = None


def _reduced_elsewhere(state: Any, grad_and_param: tuple[torch.Tensor, torch.nn.Parameter]) -> None:
    """DDP's python reducer hook: nothing; each parameter's own hook (:func:`attach`) reduces."""


def _gradient_ready(state: TracedPowerSGD, index: int, param: torch.nn.Parameter) -> None:
    if state.ddp.require_backward_grad_sync:  # DDP's hook skips no_sync backwards alike
        state.gradient_ready(index, param.grad)


def attach(spec: PowerSGD, ddp_model: DistributedDataParallel, plan: Any) -> TracedPowerSGD:
    """PowerSGD on ``ddp_model``'s python reducer (``use_python_reducer`` done): one hook per
    parameter DDP reduces, DDP's own all-reduce replaced by nothing. Returns the state."""
    params = [p for _, p in ddp_model.module.named_parameters() if p.requires_grad and not is_ddp_ignored(p)]
    state = TracedPowerSGD(spec, ddp_model, params, plan)
    add_python_reducer_hook(ddp_model, None, _reduced_elsewhere)
    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(functools.partial(_gradient_ready, state, index))
    return state
