"""Every private torch access of ``ddp_opt.strategies``' graph passes, one function each, each
naming what it reaches and why (as ``ddp_opt._torch_internals`` does for the rest of ddp_opt)."""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["comm_role", "mutates"]


def comm_role(node: fx.Node) -> str | None:
    """``"collective"`` for a functional collective of ``node``'s graph, ``"wait"`` for its wait, else None."""
    # torch.ops._c10d_functional.*: the functional collectives a traced backward issues, and wait_tensor.
    target = node.target if node.op == "call_function" else None
    if getattr(target, "namespace", None) != "_c10d_functional":
        return None
    return "wait" if target is torch.ops._c10d_functional.wait_tensor.default else "collective"


def mutates(node: fx.Node) -> bool:
    """Whether ``node`` may write to one of its arguments: an op with a mutable schema, an in-place or
    ``out=`` call of an op packet, or anything that is not an op call."""
    target = node.target
    if node.op in ("placeholder", "get_attr", "output") or target is operator.getitem:
        return False
    if node.op != "call_function":
        return True
    # torch._ops.OpOverloadPacket: aten.cat, aten.split as Inductor's DDP fusion pass writes them.
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target).endswith("_") or "out" in node.kwargs
    schema = getattr(target, "_schema", None)  # OpOverload._schema: the op's declared aliasing
    return schema is None or schema.is_mutable
