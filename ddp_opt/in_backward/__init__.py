"""The optimizer step inside backward (``compile_ddp(..., optimizer=opt)``): each bucket
of parameters updated by the user's optimizer as soon as its gradients are reduced
(Note [Optimizer in backward]). ``stepper`` steps the optimizer on one bucket, ``reducer``
chains that to DDP's reducer (the split, whole and regional strategies), ``release`` gives
DDP's bucket buffers back between steps; the traced strategy's update is its own
(``ddp_opt.strategies.traced.update``)."""

from .stepper import BucketStep, refusal

__all__ = ["BucketStep", "refusal"]
