"""Every private torch access of ``ddp_opt.in_backward``, one function each, each naming
what it reaches and why (as ``ddp_opt._torch_internals`` does for the rest of ddp_opt)."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ddp_reduced_parameters", "fuse_read_allreduces", "reducer_leaves_grads"]


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


def fuse_read_allreduces(graph: fx.Graph, group_fn: Any) -> None:
    """As ``ddp_opt._torch_internals.fuse_ddp_allreduces``, also where the reduced gradient is read after
    its write-back (the traced update reads it): every all-reduce of a divided gradient is the reducer's."""
    from torch._inductor.fx_passes import ddp_fusion

    def reducer_block(block: Any) -> bool:
        # The python reducer's pattern (div -> all_reduce -> wait); the wait may have any users: Inductor's
        # remove_noop_ops forwarded the same-dtype write-back copy's readers (the update) to the wait.
        # ddp_fusion._scatter_fused_allreduce_waits moves every reader after the fused bucket's wait.
        arg = block.comm_node.args[0]
        return isinstance(arg, fx.Node) and arg.target == torch.ops.aten.div.Tensor

    # ddp_fusion.get_all_comm_blocks(graph, ops, comm_filter): CommBlocks in graph order; CommBlock.comm_node
    # .meta["tensor_meta"]: the all-reduced tensor's metadata.
    ops = (torch.ops._c10d_functional.all_reduce_.default, torch.ops._c10d_functional.all_reduce.default)
    blocks = ddp_fusion.get_all_comm_blocks(graph, ops, comm_filter=reducer_block)
    sizes = [block.shape.numel() * block.comm_node.meta["tensor_meta"].dtype.itemsize for block in blocks]
    node_indices = {node: i for i, node in enumerate(graph.nodes)}
    start = 0
    for length in group_fn(sizes):
        # ddp_fusion._fuse_allreduce(graph, blocks, node_indices, use_concat=True): one concatenated all-reduce.
        ddp_fusion._fuse_allreduce(graph, blocks[start:start + length], node_indices, use_concat=True)
        start += length
