"""The bf16 comm hooks a user registers on the peers (the compression sweep): DDP's bucket hook
and, for PyTorch's compiled-autograd reducer, a hook per gradient.

No ``from __future__ import annotations`` and no annotations on the hooks: DDP's
``register_comm_hook`` compares a hook's annotations with real types, and requires its second
parameter to be named ``bucket`` (the python reducer passes ``(grad, param)`` in it).
"""

import torch
import torch.distributed as dist

from .._torch_internals import bf16_compress, functional_all_reduce

__all__ = ["bucket_bf16_hook", "per_gradient_bf16_hook"]


def bucket_bf16_hook(state, bucket):
    """PyTorch's ``bf16_compress_hook``, which DDP refuses by that name on gloo ("required CUDA 11+
    and NCCL 2.10+"), registered under this one: what a user on gloo does."""
    return bf16_compress(state, bucket)


def per_gradient_bf16_hook(state, bucket):
    """For the compiled-autograd reducer, which calls a hook per gradient with ``(grad, param)``:
    cast, functional all-reduce, cast back (what a user writes)."""
    grad, _ = bucket
    reduced = functional_all_reduce(grad.to(torch.bfloat16) / dist.get_world_size(), dist.group.WORLD)
    grad.copy_(reduced.to(grad.dtype))
