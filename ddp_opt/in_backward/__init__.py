"""The optimizer step inside backward (``compile_ddp(..., optimizer=opt)``): each bucket
of parameters updated by the user's optimizer as soon as its gradients are reduced
(Note [Optimizer in backward])."""

from .stepper import BucketStep, refusal

__all__ = ["BucketStep", "refusal"]
