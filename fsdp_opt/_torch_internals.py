"""Every private torch name ``fsdp_opt`` uses, in one place, each with what it
relies on; pinned by ``tests/test_torch_contracts_ddp.py``."""

from __future__ import annotations

import torch
from torch import nn


def compiled_autograd_active() -> bool:
    # torch._dynamo.config.compiled_autograd (the global switch) and the module-level flags
    # compiled_autograd_enabled / in_compiled_autograd_region set by compiled_autograd._enable.
    from torch._dynamo import compiled_autograd as ca

    return bool(torch._dynamo.config.compiled_autograd or ca.compiled_autograd_enabled
                or ca.in_compiled_autograd_region)


def checkpoint_wrapper(block: nn.Module) -> nn.Module:
    # torch.distributed.algorithms._checkpoint.checkpoint_wrapper: activation checkpointing as a
    # module wrapper whose state_dict hooks drop its _checkpoint_wrapped_module. prefix.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(block)


def replicate_with_fsdp():
    # torch.distributed._composable.replicate_with_fsdp.replicate(module, mesh=, mp_policy=, offload_policy=):
    # FSDP2's machinery with every parameter replicated and gradients all-reduced per unit (torchtitan's
    # replicate, in torch 2.11 to 2.15 at this private path).
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate
