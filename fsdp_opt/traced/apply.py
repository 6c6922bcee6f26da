"""``apply_traced``: shard a model for traced FSDP and compile its whole forward, with
every all-gather and reduce-scatter inside the graphs (``fsdp_opt.apply(model,
strategy="traced")``). One function holds the order; the parts are in this package."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import FSDPConfig
from .._torch_internals import graph_break_errors, tree_map
from .backend import GRAPH_COMPILERS, traced_backend
from .measure import measure_collectives, time_blocks
from .plan import TracedPlan, TracedUnit, choose_units, simulate
from .shard import TracedState, regroup, shard_model

log = logging.getLogger(__name__)

__all__ = ["apply_traced", "traced_refusal"]

MiB = 1 << 20


def traced_refusal(config: FSDPConfig, mesh: DeviceMesh | None) -> str | None:
    """Why ``config`` cannot run under ``strategy="traced"`` (what, why, the fix), or None."""
    fix = "or use strategy='per_block', which takes it"
    cc = config.compile
    if cc is None:
        return ("strategy='traced' compiles the whole model with its collectives inside the graph, and compile=None "
                "turns compile off. Give compile='inductor' or compile='aot_eager', or use strategy='per_block' "
                "for FSDP2 without compile.")
    if not isinstance(cc.backend, str) or cc.backend not in GRAPH_COMPILERS:
        name = cc.backend if isinstance(cc.backend, str) else getattr(cc.backend, "__name__", "a callable")
        return (f"strategy='traced' with compile backend {name!r}: traced FSDP partitions the joint graph and "
                f"orders its collectives itself, so it compiles with {' or '.join(map(repr, GRAPH_COMPILERS))} "
                f"only. Pick one of them, {fix}.")
    if cc.mode is not None and "reduce-overhead" in cc.mode:
        return (f"strategy='traced' with mode={cc.mode!r}: CUDA graphs cannot hold the collectives traced FSDP "
                f"runs between its compiled pieces. Use mode=None or 'max-autotune-no-cudagraphs', {fix}.")
    if config.replicate:
        return "strategy='traced' shards every parameter; replicate=True keeps them whole. Use strategy='per_block' " \
               "for FSDP2's replicate."
    if config.offload_policy is not None:
        return f"strategy='traced' keeps the shards on the compute device; offload_policy moves them. Drop " \
               f"offload_policy, {fix}."
    if not isinstance(config.reshard_after_forward, bool):
        return (f"strategy='traced' with reshard_after_forward={config.reshard_after_forward!r}: resharding to a "
                f"smaller world after forward is FSDP2's hybrid mode, which traced FSDP does not build. Use True or "
                f"False, {fix}.")
    if mesh is not None and mesh.ndim != 1:
        return f"strategy='traced' takes a 1-D mesh (one data-parallel dimension), got a {mesh.ndim}-D mesh: " \
               f"HSDP is not built for it. Pass a 1-D mesh, {fix}."
    return None


def apply_traced(model: nn.Module, config: FSDPConfig, mesh: DeviceMesh, blocks: Sequence[tuple[str, nn.Module]],
                 model_name: str, wrap_backend: Callable[[Callable], Callable] | None = None) -> TracedPlan:
    """Shard ``model`` in place and make its forward the compiled traced forward.

    The order: the parameters are sharded (``shard_model``) into one unit per block and
    the root, or the grouping ``shard_unit_mb`` gives; with ``shard_unit_mb="auto"`` the
    link is measured now and the units are planned at the first call, from the block
    times of an eager forward of the real batch (Note [Traced FSDP plan]); the forward
    is compiled whole at the first call.

    Args:
        wrap_backend: wraps the traced backend (the shared compile, Note [Backend wrapping order]).

    Returns:
        The plan; its units may change at the first call (auto), and its table shows each
        collective's placement once the graphs compile.
    """
    cc = config.compile
    mp = config.mp_policy
    names = [name for name, _ in blocks]
    _refuse_scalars(model)
    group = mesh.get_group()
    device = next(model.parameters()).device
    state = shard_model(model, mesh, compute_dtype=mp.param_dtype if mp is not None else None,
                        reduce_dtype=mp.reduce_dtype if mp is not None else None)
    regroup(state, model, [None] + [[name] for name in names])
    unit_bytes = [_gathered_bytes(state, u) for u in range(len(state.units))]
    root = TracedUnit(0, (), unit_bytes[0], resharded=False)
    singles = [TracedUnit(i + 1, (name,), unit_bytes[i + 1]) for i, name in enumerate(names)]
    auto = config.shard_unit_mb == "auto"
    how = "auto" if auto else "one unit per block" if config.shard_unit_mb is None else \
        f"shard_unit_mb={config.shard_unit_mb}"
    plan = TracedPlan(units=[root] + singles, prefetch=max(1, config.prefetch), how=how,
                      budget_bytes=_budget_bytes(config, unit_bytes), keep_units=config.memory_budget_mb is not None)
    if auto:
        plan.link = measure_collectives(group, device)
        plan.reduce_via = plan.link.reduction(max(unit_bytes))[0]
    else:  # gloo's reduce-scatter moves every byte of the buffer, NCCL's only what other ranks own
        plan.reduce_via = "all_to_all" if "gloo" in str(dist.get_backend(group)).lower() else "reduce_scatter"
    state.reduce_via = plan.reduce_via
    if config.shard_unit_mb not in (None, "auto"):
        plan.units = [root] + _fixed_grouping(singles, config.shard_unit_mb)
    regroup(state, model, [None] + [list(u.blocks) for u in plan.units[1:]])
    if not config.reshard_after_forward:
        plan.units = [replace(u, resharded=False) for u in plan.units]

    extra = max(0, plan.budget_bytes - _budget_bytes(dataclasses.replace(config, memory_budget_mb=None), unit_bytes))
    backend = traced_backend(cc.backend, prefetch=plan.prefetch, reduce_inflight=plan.reduce_inflight,
                             resharded=lambda: [u.resharded for u in plan.units], extra_bytes=extra,
                             on_schedule=functools.partial(_record, plan), mode=cc.mode, options=cc.options,
                             dynamic=cc.dynamic)
    if wrap_backend is not None:
        backend = wrap_backend(backend)
    original_forward = model.forward

    def traced_forward(sync: bool, carries: list[torch.Tensor] | None, shards: list[torch.Tensor], *args: Any,
                       **kwargs: Any) -> Any:
        state.gathered = state.gather(sync, carries, shards)
        out = original_forward(*args, **kwargs)
        state.gathered = None
        return out

    def first_call(*args: Any, **kwargs: Any) -> None:
        if auto and plan.keep_units:  # within FSDP2's footprint one unit per block is the only choice
            _plan_from_first_batch(plan, state, model, blocks, original_forward, args, kwargs, device, group)
        state.compiled = torch.compile(traced_forward, backend=backend, fullgraph=True, dynamic=cc.dynamic)

    model.__dict__["forward"] = _eager_forward(state, first_call, model_name)
    model.__dict__["set_requires_gradient_sync"] = functools.partial(_set_sync, state)
    return plan


def _eager_forward(state: TracedState, first_call: Callable[..., None], model_name: str) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if state.compiled is None:
            first_call(*args, **kwargs)
        if state.compute_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), state.compute_dtype)
        sync = state.sync or not torch.is_grad_enabled()
        try:
            return state.compiled(sync, state.carries_for_call(sync) if torch.is_grad_enabled() else None,
                                  state.shards(), *args, **kwargs)
        except graph_break_errors() as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(
                f"fsdp_opt.apply(strategy='traced'): the forward of {model_name} cannot be captured as one graph "
                f"({reason}); traced FSDP needs every all-gather and reduce-scatter in one graph. Remove the graph "
                "break (TORCH_LOGS=graph_breaks shows where), or use strategy='per_block'."
            ) from e
        finally:
            state.gathered = None

    return forward


def _set_sync(state: TracedState, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
    """FSDP2's ``set_requires_gradient_sync``: False accumulates unreduced gradients until a
    backward with True reduce-scatters them all."""
    state.sync = bool(requires_gradient_sync)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def _record(plan: TracedPlan, kind: str, schedule: Any) -> None:
    plan.placements[kind] = schedule.placements
    if kind != "forward" and _rank() == 0:
        log.info("%s", plan.table())


def _plan_from_first_batch(plan: TracedPlan, state: TracedState, model: nn.Module,
                           blocks: Sequence[tuple[str, nn.Module]], forward: Callable[..., Any], args: tuple,
                           kwargs: dict, device: torch.device, group: dist.ProcessGroup) -> None:
    """Time an eager forward of the first batch, block by block, and plan the units from
    it and the measured link (Note [Traced FSDP plan]). The root is gathered throughout, each
    block only while it runs (unit ``i + 1`` is block ``i``: one unit per block until now)."""
    shards = state.shards()
    gathered: list[Any] = [None] * len(state.params)

    def enter(i: int) -> None:
        state.gather_unit(i + 1, gathered, True, None, shards)

    def leave(i: int) -> None:
        for index in state.units[i + 1]:
            gathered[index] = None

    with torch.no_grad():
        state.gather_unit(0, gathered, True, None, shards)
        state.gathered = gathered
        try:
            total, block_s = time_blocks([m for _, m in blocks], lambda: forward(*args, **kwargs), device, group,
                                         enter, leave)
        finally:
            state.gathered = None
    root_s = max(total - sum(block_s), 0.0)
    root = replace(plan.units[0], fwd_s=root_s, bwd_s=2 * root_s)
    singles = [replace(u, fwd_s=s, bwd_s=2 * s) for u, s in zip(plan.units[1:], block_s)]
    units, seconds, peak = choose_units(root, singles, plan.link, prefetch=plan.prefetch,
                                        budget_bytes=plan.budget_bytes, keep=plan.keep_units)
    plan.units, plan.predicted_s, plan.peak_bytes = units, seconds, peak
    regroup(state, model, [None] + [list(u.blocks) for u in units[1:]])
    if _rank() == 0:
        base, _ = simulate([root] + singles, plan.link, plan.prefetch)
        log.info("fsdp_opt traced: planned %d unit(s) from the measured link and block times (predicted %.1f ms "
                 "of forward and backward, %.1f ms with one unit per block)", len(units), seconds * 1e3,
                 base * 1e3)


def _fixed_grouping(blocks: list[TracedUnit], mb: float) -> list[TracedUnit]:
    """Consecutive blocks grouped until a unit holds ``mb`` MiB (Note [Shard unit grouping])."""
    groups, current = [], []
    for b in blocks:
        current.append(b)
        if sum(u.nbytes for u in current) >= mb * MiB:
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return [TracedUnit(i + 1, tuple(n for u in g for n in u.blocks), sum(u.nbytes for u in g))
            for i, g in enumerate(groups)]


def _budget_bytes(config: FSDPConfig, unit_bytes: list[int]) -> int:
    if config.memory_budget_mb is not None:
        return int(config.memory_budget_mb * MiB)
    blocks = sorted(unit_bytes[1:], reverse=True)
    return unit_bytes[0] + sum(blocks[:2])  # what FSDP2 holds: the root, a unit in use and the next one


def _gathered_bytes(state: TracedState, unit: int) -> int:
    layout = state.layouts[unit]
    if layout is None:
        return 0
    return sum(s.numel * layout.world * layout.gather_dtype(s).itemsize for s in layout.slots)


def _refuse_scalars(model: nn.Module) -> None:
    scalars = [n for n, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise ValueError(
            f"fsdp_opt.apply(strategy='traced'): parameter(s) {scalars[:3]} have no dimension to shard: traced FSDP "
            "shards every parameter on dim 0, as FSDP2 does. Make them 1-element tensors (shape (1,)), or use "
            "strategy='per_block'."
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
