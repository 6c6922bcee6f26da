"""The optimizer in backward under DDP's reducer (the split, whole and regional
strategies): each bucket's update chained to its comm hook's future
(Note [Optimizer in backward], Note [Update after the reduction])."""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the bucket hook's
# annotations with the real types.
import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .._torch_internals import rebuild_reducer
from ._torch_internals import reducer_leaves_grads
from .stepper import BucketStep

__all__ = ["allreduce_hook", "grads_in_buckets", "leave_grads", "then_step"]


def allreduce_hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own reduction as a comm hook: the bucket divided by the world size, then summed."""
    tensor = bucket.buffer().div_(dist.get_world_size(group))
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def then_step(hook: Callable, stepper: BucketStep) -> Callable:
    """``hook`` (a DDP comm hook ``(state, bucket) -> Future[Tensor]``) followed by the update of
    the bucket's parameters from the reduced gradients.

    Note [Update after the reduction]

    Background
        DDP's reducer calls the comm hook when a bucket's gradients are ready and waits
        for the futures it returned at the end of backward, then copies each bucket
        back into ``.grad``.

    Algorithm
        - The update is chained to the hook's future (``fut.then``): it runs on the
          thread that completes the reduction, while backward goes on. The reduced
          bucket is copied into DDP's bucket buffer when the hook's result is another
          tensor; the bucket's per-parameter views are the gradients handed to the
          update.
        - ``reducer_leaves_grads`` tells the reducer not to copy the buckets back into
          ``.grad`` at the end of backward (PyTorch's own optimizer-in-backward switch),
          so the freed gradients stay freed; realignment sets it again on the new reducer.
        - The gradients are views of DDP's bucket buffers (:func:`grads_in_buckets`): the
          reducer points each ``.grad`` at its slot of the bucket as the gradient arrives,
          so a gradient takes no memory beside the buckets, which DDP keeps for the whole
          run; the update then frees nothing more than the views. Otherwise every
          gradient of a bucket would live twice until that bucket's update.
        - A ``no_sync`` backward calls no hook: gradients accumulate as before, and the
          synchronising backward reduces and updates them.
        - With ``stepper.release``, each updated bucket's buffer is given back at the end of backward
          and taken again at its next gradient (Note [Bucket buffers between steps]).
    """

    @functools.wraps(hook)
    def hook_then_step(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        def update(fut: torch.futures.Future) -> torch.Tensor:
            reduced = fut.value()
            reduced = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
            buffer = bucket.buffer()
            if reduced is not buffer:
                buffer.copy_(reduced)
            params = bucket.parameters()
            stepper.step(params, bucket.gradients())
            if stepper.release is not None:
                stepper.release.updated(buffer, params)
            return buffer

        return hook(state, bucket).then(update)

    return hook_then_step


def leave_grads(ddp_model: DistributedDataParallel) -> None:
    """After each backward, the reducer leaves ``.grad`` as the updates left it (None)."""
    reducer_leaves_grads(ddp_model)


def grads_in_buckets(ddp_model: DistributedDataParallel, rebuild_now: bool) -> None:
    """DDP's gradients as views of its bucket buffers (``gradient_as_bucket_view=True``), so that
    under the optimizer in backward no gradient lives beside its bucket (Note [Update after the
    reduction]). The reducer takes the setting when built: ``rebuild_now`` re-creates it (before
    DDP's first iteration; ``compile_ddp``), else the next re-creation takes it (realignment;
    ``compile_for_ddp`` attaches inside the first forward, where the reducer is in use)."""
    if ddp_model.gradient_as_bucket_view:
        return
    ddp_model.gradient_as_bucket_view = True
    if rebuild_now:
        rebuild_reducer(ddp_model, None)
