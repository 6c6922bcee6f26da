"""Every private torch access of the traced strategy, one function each, each naming what it
reaches and why (as ``ddp_opt._torch_internals`` does for the rest of ddp_opt): DDP's python
reducer under compiled autograd, Inductor's DDP all-reduce fusion, and what its graph passes
read of the captured graphs. ``tests/contracts/test_torch_contracts_ddp.py`` pins them."""

from __future__ import annotations

import contextlib
import operator
import re
from typing import Any, Iterator

import torch
from torch import fx
from torch.nn.parallel import DistributedDataParallel

__all__ = ["add_python_reducer_hook", "aliasing", "checkpointed_flex_attention", "comm_role",
           "custom_graph_pass_base", "functional_all_reduce", "fuse_ddp_allreduces", "has_all_reduce",
           "memory_reorder_off", "mutates", "python_reducer_ddp", "reduce_in_place", "traced_backward",
           "traced_strategy_missing", "use_python_reducer"]


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


# --- the traced strategy: DDP's python reducer under compiled autograd ---------------------------


def traced_strategy_missing() -> str | None:
    """Why this torch cannot run ``strategy="traced"``, or None when it can."""
    try:
        from torch._dynamo import compiled_autograd  # noqa: F401
        from torch._inductor.fx_passes import ddp_fusion
    except ImportError as e:
        return f"compiled autograd or Inductor's DDP fusion is missing ({e})"
    needed = [(DistributedDataParallel, "_register_accum_grad_hook"), (ddp_fusion, "get_all_comm_blocks"),
              (ddp_fusion, "_fuse_allreduce"), (compiled_autograd, "_enable")]
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in needed if not hasattr(owner, name)]
    return f"{', '.join(missing)} not found" if missing else None


def use_python_reducer(ddp_model: DistributedDataParallel) -> None:
    """Switch a built DDP module to PyTorch's python reducer, as DDP's ``__init__`` does under ``optimize_ddp=
    "python_reducer"``: per-gradient all-reduce hooks compiled autograd traces; the C++ reducer detached, emptied."""
    # Reducer._remove_autograd_hooks(): the C++ reducer no longer sees gradients.
    ddp_model.reducer._remove_autograd_hooks()
    # DDP._use_python_reducer: DDP's _pre_forward/_post_forward/_run_ddp_forward skip the C++ reducer.
    ddp_model._use_python_reducer = True
    # DDP._ddp_init_helper(params, expect_sparse, names, static_graph) (no collective): DDP.reducer and .logger
    # re-created over a placeholder on DDP._module_parameters' device, so the old reducer's buffers are freed.
    placeholder = torch.zeros(1, device=next((p.device for p in ddp_model._module_parameters), "cpu")).requires_grad_()
    ddp_model._ddp_init_helper([placeholder], [False], {0: "placeholder"}, ddp_model.static_graph)
    ddp_model.reducer._remove_autograd_hooks()
    # As DDP.__init__ does: dynamo inlines torch.nn.parallel.distributed (the hooks are traced).
    torch._dynamo.trace_rules.LEGACY_MOD_INLINELIST.add("torch.nn.parallel.distributed")
    torch._dynamo.trace_rules.get_legacy_mod_inlinelist.cache_clear()
    # DDP._register_accum_grad_hook(): per-parameter all-reduce hooks (skipped without require_backward_grad_sync).
    ddp_model._register_accum_grad_hook()


def functional_all_reduce(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed._functional_collectives as fcol  # all_reduce(t, "sum", group): traceable, as DDP's
    return fcol.all_reduce(tensor, "sum", group)


def add_python_reducer_hook(ddp_model: DistributedDataParallel, state: Any, hook: Any) -> None:
    """The python reducer calls ``hook(state, (param.grad, param))`` per gradient instead of its all-reduce."""
    # DDP._comm_hooks: (hook, state) pairs called with (param.grad, param) (register_comm_hook: the C++ reducer's).
    ddp_model._comm_hooks.append((hook, state))


@contextlib.contextmanager
def traced_backward(compiler_fn: Any, fusion_passes: list | None = None,
                    bucket_size_mb: float | None = None) -> Iterator[None]:
    """The context a backward of DDP's python reducer runs in: compiled autograd on with ``compiler_fn``,
    Inductor's DDP all-reduce fusion on with ``fusion_passes`` (callables ``graph -> None`` or names of
    Inductor's passes; None: its defaults) and ``bucket_size_mb`` (None: Inductor's default)."""
    from torch._dynamo import compiled_autograd

    fusion: dict[str, Any] = {"_fuse_ddp_communication": True}
    if fusion_passes is not None:
        fusion["_fuse_ddp_communication_passes"] = fusion_passes
    if bucket_size_mb is not None:
        fusion["_fuse_ddp_bucket_size"] = bucket_size_mb
    # torch._dynamo.config.optimize_ddp = "python_reducer": read while the backward is traced.
    # Inductor's private _fuse_ddp_communication(_passes, _bucket_size): fuse the traced all-reduces into buckets.
    # torch._dynamo.compiled_autograd._enable(compiler_fn): backward() runs as one compiled graph.
    with (python_reducer_ddp(), torch._inductor.config.patch(**fusion), compiled_autograd._enable(compiler_fn)):
        yield


def python_reducer_ddp() -> contextlib.AbstractContextManager:
    """Where a DDP made inside takes the python reducer, and a backward traced inside traces its hooks."""
    # torch._dynamo.config.optimize_ddp = "python_reducer": read by DDP.__init__ (_use_python_reducer), which then
    # registers AccumulateGrad hooks that all-reduce each gradient with functional collectives.
    return torch._dynamo.config.patch(optimize_ddp="python_reducer")


def has_all_reduce(gm: fx.GraphModule) -> bool:
    """Whether a captured graph all-reduces (the python reducer's hooks in a synchronised backward)."""
    # torch.ops._c10d_functional.all_reduce(_): the functional collectives the hooks call.
    packets = (torch.ops._c10d_functional.all_reduce, torch.ops._c10d_functional.all_reduce_)
    ops = {*packets, *(packet.default for packet in packets)}
    return any(node.op == "call_function" and node.target in ops for node in gm.graph.nodes)


def memory_reorder_off() -> contextlib.AbstractContextManager:
    """Inductor compiles in graph order: its peak-memory reordering (``reorder_for_peak_memory``) off; in a
    traced backward it moved each bucket's wait up to its all-reduce (Note [Traced strategy])."""
    return torch._inductor.config.patch(reorder_for_peak_memory=False)


def fuse_ddp_allreduces(graph: fx.Graph, group_fn: Any, any_readers: bool = False) -> None:
    """Fuse the python reducer's all-reduces into the buckets ``group_fn(sizes in wire bytes) -> lengths`` chooses;
    ``any_readers``: a reduced gradient may be read after its write-back (the traced update, Note [Traced update])."""
    from torch._inductor.fx_passes import ddp_fusion
    output = next(node for node in reversed(graph.nodes) if node.op == "output")

    def reducer_block(block: Any) -> bool:
        # ddp_fusion._fuse_ddp_communication's filter (div -> all_reduce -> wait -> copy_ or the output), which
        # also takes a functional aten.copy: a gradient written back from a narrower dtype is not a no-op copy.
        arg, users = block.comm_node.args[0], block.wait_nodes[0].users
        divided = isinstance(arg, fx.Node) and arg.target == torch.ops.aten.div.Tensor
        written_back = len(users) == 1 and (output in users or next(iter(users)).target in (
            torch.ops.aten.copy_.default, torch.ops.aten.copy.default))
        return divided and (any_readers or written_back)  # any_readers: _scatter_fused_allreduce_waits moves them

    # ddp_fusion.get_all_comm_blocks(graph, ops, comm_filter): CommBlocks in graph order (comm_node.meta: tensor_meta).
    ops = (torch.ops._c10d_functional.all_reduce_.default, torch.ops._c10d_functional.all_reduce.default)
    blocks = ddp_fusion.get_all_comm_blocks(graph, ops, comm_filter=reducer_block)
    sizes = [block.shape.numel() * block.comm_node.meta["tensor_meta"].dtype.itemsize for block in blocks]
    node_indices = {node: i for i, node in enumerate(graph.nodes)}
    start = 0
    for length in group_fn(sizes):
        # ddp_fusion._fuse_allreduce(graph, blocks, node_indices, use_concat=True): one concatenated all-reduce.
        ddp_fusion._fuse_allreduce(graph, blocks[start:start + length], node_indices, use_concat=True)
        start += length


def custom_graph_pass_base() -> type:
    # torch._inductor.custom_graph_pass.CustomGraphPass: a pass with a uuid() keeps the FX graph cache on.
    from torch._inductor.custom_graph_pass import CustomGraphPass
    return CustomGraphPass
