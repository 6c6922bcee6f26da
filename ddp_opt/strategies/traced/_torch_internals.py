"""Every private torch access of ``ddp_opt.strategies``' graph passes, one function each, each
naming what it reaches and why (as ``ddp_opt._torch_internals`` does for the rest of ddp_opt)."""

from __future__ import annotations

import operator
import re

import torch
from torch import fx

__all__ = ["aliasing", "checkpointed_flex_attention", "comm_role", "mutates", "reduce_in_place"]


def comm_role(node: fx.Node) -> str | None:
    """``"collective"`` for a functional collective of ``node``'s graph, ``"wait"`` for its wait, else None."""
    # torch.ops._c10d_functional.*: the functional collectives a traced backward issues, and wait_tensor.
    target = node.target if node.op == "call_function" else None
    if getattr(target, "namespace", None) != "_c10d_functional":
        return None
    return "wait" if target is torch.ops._c10d_functional.wait_tensor.default else "collective"


def checkpointed_flex_attention(gm: fx.GraphModule) -> list[str]:
    """The activation-checkpointed regions of ``gm`` that call FlexAttention, each as where the user's code
    called ``checkpoint`` (``file:line``, from the node's stack trace) or else as its body module's name."""
    # torch.ops.higher_order.tag_activation_checkpoint: how dynamo captures torch.utils.checkpoint, the region's
    # body a GraphModule named by its first argument (a get_attr); torch.ops.higher_order.flex_attention: the
    # FlexAttention op, in that body or in a region nested in it.
    checkpoint = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    if checkpoint is None or flex is None:
        return []

    def calls_flex(module: fx.GraphModule) -> bool:
        return any(node.target is flex for node in module.graph.nodes) or any(
            calls_flex(child) for child in module.children() if isinstance(child, fx.GraphModule))

    found = []
    for node in gm.graph.nodes:
        body = node.args[0] if node.target is checkpoint and node.args else None
        if isinstance(body, fx.Node) and body.op == "get_attr":
            module = getattr(gm, str(body.target), None)
            if isinstance(module, fx.GraphModule) and calls_flex(module):
                found.append(_called_at(node) or str(body.target))
    return found


def _called_at(node: fx.Node) -> str | None:
    """``file:line`` of the innermost frame of ``node``'s stack trace (dynamo's ``meta["stack_trace"]``)."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else None


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


def aliasing(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(the argument nodes ``node``'s result may share memory with, those it may write to), from the op's
    declared aliasing; an op that declares none but may mutate (``mutates``) is taken to alias and write all."""
    inputs = node.all_input_nodes
    target = node.target
    if node.op != "call_function":
        return [], []
    if target is operator.getitem or comm_role(node) == "wait":  # wait_tensor returns its collective's buffer
        return inputs[:1], []
    op = getattr(target, "default", target)  # OpOverloadPacket -> its default overload, as for mutates
    if op is torch.ops.aten._unsafe_view.default:  # a view that declares no alias (AOTAutograd's reshape)
        return inputs[:1], []
    schema = getattr(op, "_schema", None)  # OpOverload._schema: the op's declared aliasing
    if schema is None:
        return (inputs, inputs) if mutates(node) else ([], [])
    shared, written = [], []
    for k, arg in enumerate(schema.arguments):
        value = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
        values = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node)]
        if arg.alias_info is not None:
            shared += values
            if arg.alias_info.is_write:
                written += values
    outputs_alias = any(ret.alias_info is not None for ret in schema.returns)
    return (shared if outputs_alias else []), written


def reduce_in_place(graph: fx.Graph) -> int:
    """Each fused bucket ``all_reduce(div(cat(parts), n))`` rewritten as ``all_reduce_(cat(div(part, n) ...))``:
    one bucket buffer, reduced in place (Note [Traced strategy]). Returns how many buckets were rewritten."""
    # torch.ops._c10d_functional.all_reduce_: the in-place functional all-reduce Inductor lowers without a copy
    # (comm_lowering: all_reduce clones its input first). Absent from a torch: nothing is rewritten.
    in_place = getattr(torch.ops._c10d_functional, "all_reduce_", None)
    aten = torch.ops.aten
    rewritten = 0
    for comm in list(graph.nodes):
        if comm.op != "call_function" or comm.target is not torch.ops._c10d_functional.all_reduce.default:
            continue
        div = comm.args[0]
        if in_place is None or not (isinstance(div, fx.Node) and div.target == aten.div.Tensor
                                    and len(div.users) == 1):
            continue
        cat = div.args[0]
        if not (isinstance(cat, fx.Node) and cat.target in (aten.cat, aten.cat.default) and len(cat.users) == 1
                and len(cat.args) == 1 and not cat.kwargs):
            continue
        parts = []
        for part in cat.args[0]:
            with graph.inserting_before(cat):
                parts.append(graph.call_function(aten.div.Tensor, (part, div.args[1])))
            parts[-1].meta.update(part.meta)  # same shape and dtype: a division by a number
        cat.args = (parts,)
        with graph.inserting_after(comm):
            reduced = graph.call_function(in_place.default, (cat, *comm.args[1:]), dict(comm.kwargs))
        reduced.meta.update(cat.meta)
        comm.replace_all_uses_with(reduced)
        graph.erase_node(comm)
        graph.erase_node(div)
        rewritten += 1
    return rewritten
