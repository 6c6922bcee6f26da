"""Every private torch name ``fsdp_opt`` uses, in one place, each with what it
relies on; pinned by ``tests/contracts/test_torch_contracts_ddp.py``."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy  # noqa: F401 - public; re-exported for the traced schedule


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


def functional_all_gather(flat: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    # torch.ops._c10d_functional.all_gather_into_tensor(input, group_size, group_name) and
    # wait_tensor(output): the functional all-gather (rank-major along dim 0) that dynamo and
    # AOTAutograd keep as two graph nodes, the collective and its wait.
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_gather_into_tensor(flat, world, group_name))


def functional_all_to_all(flat: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    # torch.ops._c10d_functional.all_to_all_single(input, output_split_sizes, input_split_sizes, group_name)
    # and wait_tensor: chunk j of dim 0 goes to rank j; rank r receives chunk r of every rank, rank-major.
    ops = torch.ops._c10d_functional
    sizes = [flat.shape[0] // world] * world
    return ops.wait_tensor(ops.all_to_all_single(flat, sizes, sizes, group_name))


def functional_reduce_scatter(flat: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    # torch.ops._c10d_functional.reduce_scatter_tensor(input, "sum", group_size, group_name) and
    # wait_tensor: rank r receives the sum over ranks of chunk r of dim 0.
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.reduce_scatter_tensor(flat, "sum", world, group_name))


# The functional collectives' graph nodes, as AOTAutograd leaves them (torch.ops._c10d_functional).
def _c10d_ops() -> Any:
    return torch.ops._c10d_functional


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _c10d_ops().wait_tensor.default


def is_all_gather(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _c10d_ops().all_gather_into_tensor.default


def is_reduce_scatter(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _c10d_ops().reduce_scatter_tensor.default


def is_all_to_all(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _c10d_ops().all_to_all_single.default


def is_reduction(node: fx.Node) -> bool:
    """A gradient reduction's collective: a reduce-scatter, or the all-to-all traced FSDP sums after."""
    return is_reduce_scatter(node) or is_all_to_all(node)


def is_collective_start(node: fx.Node) -> bool:
    return is_all_gather(node) or is_reduction(node)


def collective_starts(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if is_collective_start(n)]


def min_cut_partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
    # torch._functorch.partitioners.min_cut_rematerialization_partition(joint, joint_inputs, **kw): Inductor's
    # partitioner; it recomputes in backward every node tagged meta["recompute"] = MUST_RECOMPUTE and never
    # recomputes a _c10d_functional collective otherwise.
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def boxed_graph(gm: fx.GraphModule) -> Any:
    # torch.fx.graph._BoxedCodeGen: the generated forward takes one list and clears it once it has the
    # inputs (AOTAutograd's boxed calling convention, _boxed_call = True), so that each input, a saved
    # activation among them, is freed after its last use instead of when the graph returns. A torch without
    # it: torch.fx.Interpreter.boxed_run, which clears the list too (node by node in Python).
    codegen = getattr(fx.graph, "_BoxedCodeGen", None)
    if codegen is not None:
        gm.graph.set_codegen(codegen())
        gm.recompile()

        def run(args: list) -> Any:
            return gm(args)
    else:
        def run(args: list) -> Any:
            return fx.Interpreter(gm).boxed_run(args)

    run._boxed_call = True
    return run


def aot_backend(*, fw_compiler: Any, bw_compiler: Any, inference_compiler: Any, partition_fn: Any,
                inductor_decompositions: bool) -> Any:
    # torch._dynamo.backends.common.aot_autograd(**kw): a dynamo backend running AOTAutograd with these
    # compilers (each returns a GraphModule, run with the boxed calling convention, boxed_graph) and
    # partitioner; torch._inductor.decomposition.select_decomp_table() is the decomposition table
    # Inductor's graphs are traced with.
    from torch._dynamo.backends.common import aot_autograd

    def boxed(compile_fn: Any) -> Any:
        def compile_boxed(gm: fx.GraphModule, example_inputs: Any) -> Any:
            return boxed_graph(compile_fn(gm, example_inputs))

        return compile_boxed

    kwargs: dict[str, Any] = dict(fw_compiler=boxed(fw_compiler), bw_compiler=boxed(bw_compiler),
                                  inference_compiler=boxed(inference_compiler), partition_fn=partition_fn,
                                  keep_inference_input_mutations=True)
    if inductor_decompositions:
        from torch._inductor.decomposition import select_decomp_table

        kwargs["decompositions"] = select_decomp_table()
    return aot_autograd(**kwargs)


def inductor_piece_compiler(*, is_backward: bool, graph_id: int) -> Any:
    # torch._inductor.compile_fx.compile_fx_inner(gm, example_inputs, is_backward=, graph_id=): compiles one
    # post-AOTAutograd graph (the graphs AOTAutograd hands Inductor) to a callable taking its inputs as one
    # list; its FX graph cache keys each piece. It records the graph's output strides in the
    # TracingContext (output_strides), which must be empty when it starts: each piece's are dropped, as
    # the outer graph's outputs are the pieces' and keep their traced strides (keep_output_stride).
    from torch._guards import TracingContext
    from torch._inductor.compile_fx import compile_fx_inner

    def compile_piece(gm: fx.GraphModule, example_inputs: list) -> Any:
        context = TracingContext.try_get()
        saved = None
        if context is not None and getattr(context, "output_strides", None) is not None:
            saved, context.output_strides = context.output_strides, []
        try:
            return compile_fx_inner(gm, example_inputs, is_backward=is_backward, graph_id=graph_id)
        finally:
            if saved is not None:
                context.output_strides = saved

    return compile_piece


def inductor_config_patch(mode: str | None, options: dict | None, dynamic: bool | None) -> Any:
    # torch._inductor.list_mode_options(mode, dynamic) and torch._inductor.config.patch(**options): the
    # settings torch.compile(mode=, options=) applies around Inductor's compile.
    import torch._inductor.config as inductor_config
    from torch._inductor import list_mode_options

    settings = dict(list_mode_options(mode, dynamic)) if mode else {}
    settings.update(options or {})
    return inductor_config.patch(settings)


def annotate_unit(unit: int) -> Any:
    # torch.fx.traceback.annotate({...}): the nodes traced inside carry node.meta["custom"], through dynamo and
    # AOTAutograd into the forward and backward graphs (the backward nodes of an autograd.Function too); a
    # torch without it: no annotation, and the schedule names units by their order.
    import contextlib

    import torch.fx.traceback as fx_traceback

    annotate = getattr(fx_traceback, "annotate", None)
    return annotate({"fsdp_unit": unit}) if annotate is not None else contextlib.nullcontext()


def is_op_overload(target: Any) -> bool:
    # torch._ops.OpOverload: an aten op with its overload chosen, the targets whose schema says whether they view.
    return isinstance(target, torch._ops.OpOverload)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    # torch.utils._pytree.tree_map: ``fn`` on every leaf of nested lists, tuples and dicts (the forward's
    # arguments), the structure kept.
    from torch.utils._pytree import tree_map as pytree_map

    return pytree_map(fn, tree)


def graph_break_errors() -> tuple[type[BaseException], ...]:
    # torch._dynamo.exc.Unsupported: what a fullgraph compile raises at a graph break (UserError for some
    # unsupported user code).
    import torch._dynamo.exc as exc

    return tuple(e for e in (getattr(exc, "Unsupported", None), getattr(exc, "UserError", None)) if e is not None)
