"""Every private torch access of ``ddp_opt.in_backward``, one function each, each naming
what it reaches and why (as ``ddp_opt._torch_internals`` does for the rest of ddp_opt)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = ["current_graph_task_id", "ddp_join_enabled", "ddp_reduced_parameters", "queue_backward_callback",
           "reducer_leaves_grads"]


def reducer_leaves_grads(ddp_model: DistributedDataParallel) -> None:
    """DDP's C++ reducer stops copying the reduced buckets back into ``.grad`` at the end of backward."""
    # Reducer._set_optimizer_in_backward(): DDP's own switch for _apply_optimizer_in_backward, whose hook
    # has stepped and freed the gradients; set on DDP's current reducer (a rebuilt one needs it again).
    ddp_model.reducer._set_optimizer_in_backward()


def ddp_reduced_parameters(ddp_model: DistributedDataParallel) -> list:
    """The parameters DDP's python reducer all-reduces from its post-accumulate-grad hooks, in its order."""
    # DDP._module_parameters: the parameters DDP syncs (those in _ddp_params_and_buffers_to_ignore left out);
    # DDP._register_accum_grad_hook hooks each of them that requires grad.
    return [p for p in ddp_model._module_parameters if p.requires_grad]



def queue_backward_callback(callback) -> None:
    """Run ``callback`` when the running backward has finished, after the callbacks queued before it."""
    # Variable._execution_engine.queue_callback: autograd's final callbacks of the current graph task (DDP's
    # reducer queues its end-of-backward there; FSDP's post-backward too). A callback may queue another.
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def current_graph_task_id() -> int:
    """An id of the running backward (autograd graph task), -1 outside one."""
    # torch._C._current_graph_task_id: as FSDP2's _fsdp_common and torch.autograd.graph use it.
    return torch._C._current_graph_task_id()


def ddp_join_enabled(ddp_model: DistributedDataParallel) -> bool:
    """Whether DDP runs inside its ``join()`` context (uneven inputs)."""
    # DDP._join_config.enable: set by DDP.join() for the context's duration.
    config = getattr(ddp_model, "_join_config", None)
    return config is not None and config.enable
