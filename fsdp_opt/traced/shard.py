"""The model side of traced FSDP: parameters stored as FSDP2 stores them (``Shard(0)``
DTensors, same names), read through properties that return the gathered tensors while
the compiled forward runs, and the forward that gathers each unit (Note [Traced
parameters]).

Note [Traced parameters]

Background
    The compiled forward must see full parameters where the model's code reads
    ``self.weight``, while ``state_dict``, the optimizer and DCP see the sharded
    DTensors FSDP2 would hold, under the same names. A whole-model compile captures
    everything between the start of forward and its end, so the gathers are issued
    there, in one frame with the model's code.

Algorithm
    - Every parameter becomes a ``Shard(0)`` DTensor parameter on the mesh, each rank
      keeping its own rows of its own copy as ``fully_shard`` does (a tied parameter
      once, in every module that holds it).
    - Each module holding parameters gets a subclass of its class with one property per
      parameter name: while a forward runs, it returns the gathered tensor; otherwise
      the DTensor parameter, as ``module._parameters`` holds it. ``state_dict`` reads
      ``_parameters`` directly and never the properties.
    - ``TracedState.forward`` (compiled whole, ``fullgraph=True``) gathers every unit
      (``UnitGather``, one call per unit, each under ``annotate({"fsdp_unit": u})``),
      publishes the gathered tensors for the properties, runs the model's own forward,
      and withdraws them. The schedule pass then moves each gather to where it is
      needed (Note [Traced FSDP schedule]).
    - Gradient accumulation: ``set_requires_gradient_sync(False)`` makes the next
      backwards accumulate each unit's unreduced gradients in a carry buffer; the next
      synchronising backward reduce-scatters them with its own (Note [Unit gather]).

Notes
    The eager wrapper around the compiled call withdraws the gathered tensors also when
    forward raises, and casts floating-point inputs to the compute dtype (FSDP2's
    ``cast_forward_inputs`` at the root).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .._torch_internals import annotate_unit
from .gather import UnitGather, UnitLayout, unit_layout

__all__ = ["TracedState", "shard_model", "regroup", "TRACED_ATTR"]

TRACED_ATTR = "_distcompile_traced_fsdp"  # the TracedState on the root module
_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


@dataclass
class TracedState:
    """What traced FSDP keeps on the model (Note [Traced parameters]).

    Attributes:
        params: the DTensor parameters, each once, indexed as the properties read them.
        units: per unit, the indices of its parameters.
        layouts: per unit, the flat layout of its all-gather.
        compute_dtype, reduce_dtype: FSDP2's ``param_dtype`` and ``reduce_dtype``; floating-point
            inputs are cast to the first (None: left as they are).
        world, rank, group_name: the mesh's group.
        gathered: while forward runs, the gathered tensor of every parameter; else None.
        sync: whether the next backward reduce-scatters (False accumulates).
        carries: per unit, the leaf whose gradient accumulates unreduced gradients.
        compiled: the compiled gathering forward, set by ``apply``.
    """

    params: list[nn.Parameter]
    units: list[list[int]]
    layouts: list[UnitLayout | None]  # None for a unit with no parameter (a model without root parameters)
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    world: int = 1
    rank: int = 0
    group_name: str = ""
    reduce_via: str = "reduce_scatter"  # how units reduce their gradients (Note [Unit gather])
    index: dict[int, int] = field(default_factory=dict)  # id(parameter) -> its index in params
    gathered: list[torch.Tensor] | None = None
    sync: bool = True
    carries: list[torch.Tensor | None] = field(default_factory=list)
    compiled: Callable[..., Any] | None = None

    def shards(self) -> list[torch.Tensor]:
        """Each parameter's local shard, as a differentiable view of its DTensor (taken outside the
        compiled forward, so that the graph holds plain tensors and no DTensor)."""
        return [p.to_local() for p in self.params]

    def gather(self, sync: bool, carries: Sequence[torch.Tensor] | None, shards: Sequence[torch.Tensor]
               ) -> list[torch.Tensor]:
        """Every parameter gathered, unit by unit (traced inside the compiled forward)."""
        full: list[Any] = [None] * len(self.params)
        for u in range(len(self.units)):
            self.gather_unit(u, full, sync, None if carries is None else carries[u], shards)
        return full

    def gather_unit(self, u: int, into: list[Any], sync: bool, carry: torch.Tensor | None,
                    shards: Sequence[torch.Tensor]) -> None:
        """Unit ``u``'s parameters gathered into their places in ``into``."""
        indices, layout = self.units[u], self.layouts[u]
        if not indices:
            return
        with annotate_unit(u):
            outs = UnitGather.apply(layout, sync, carry, *[shards[i] for i in indices])
        for i, out in zip(indices, outs):
            into[i] = out

    def carries_for_call(self, sync: bool) -> list[torch.Tensor] | None:
        """The carries the next compiled call takes: leaves to accumulate into when not
        synchronising, the accumulated buffers (taken off their leaves) when synchronising
        after accumulation, None otherwise."""
        if not sync:
            if not self.carries:
                self.carries = [_carry_leaf(layout, self.params[idx[0]]) if idx else None for idx, layout in
                                zip(self.units, self.layouts)]
            return list(self.carries)
        if not self.carries or all(c is None or c.grad is None for c in self.carries):
            return None
        out = []
        for carry in self.carries:
            if carry is None:
                out.append(None)
                continue
            out.append(carry.grad if carry.grad is not None else torch.zeros_like(carry))
            carry.grad = None
        return out


def _carry_leaf(layout: UnitLayout, like: torch.Tensor) -> torch.Tensor:
    dtype = layout.grad_dtype(layout.slots[0])
    local = like.to_local() if isinstance(like, DTensor) else like
    return torch.zeros((layout.world, layout.shard_numel), dtype=dtype, device=local.device, requires_grad=True)


def _property(name: str) -> property:
    def read(self: nn.Module) -> Any:
        state = self.__dict__[TRACED_ATTR]
        if state.gathered is None:
            return self._parameters[name]
        return state.gathered[self.__dict__["_distcompile_slots"][name]]

    return property(read)


def _swap_class(module: nn.Module, names: tuple[str, ...]) -> None:
    cls = type(module)
    key = (cls, names)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Traced{cls.__name__}", (cls,), {n: _property(n) for n in names})
    module.__class__ = _CLASSES[key]


def shard_model(model: nn.Module, mesh: DeviceMesh, *, compute_dtype: torch.dtype | None,
                reduce_dtype: torch.dtype | None) -> TracedState:
    """Shard ``model``'s parameters in place and install the properties; no unit yet
    (``regroup`` makes them).

    Args:
        model: the unsharded model.
        mesh: the 1-D mesh of the data-parallel ranks.
        compute_dtype, reduce_dtype: FSDP2's ``param_dtype`` and ``reduce_dtype``.

    Returns:
        The state the compiled forward reads, also kept on ``model``.
    """
    sharded: dict[int, nn.Parameter] = {}
    params: list[nn.Parameter] = []
    state = TracedState(params=params, units=[], layouts=[], compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                        world=mesh.size(), rank=mesh.get_local_rank(), group_name=mesh.get_group().group_name)
    for module in model.modules():
        names = tuple(n for n, p in module._parameters.items() if p is not None)
        if not names:
            continue
        slots = {}
        for name in names:
            p = module._parameters[name]
            if id(p) not in sharded:
                sharded[id(p)] = nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None),
                                              requires_grad=p.requires_grad)
                state.index[id(sharded[id(p)])] = len(params)
                params.append(sharded[id(p)])
            module._parameters[name] = sharded[id(p)]
            slots[name] = state.index[id(sharded[id(p)])]
        module.__dict__["_distcompile_slots"] = slots
        module.__dict__[TRACED_ATTR] = state
        _swap_class(module, names)
    model.__dict__[TRACED_ATTR] = state
    return state


def regroup(state: TracedState, model: nn.Module, groups: Sequence[Sequence[str] | None]) -> None:
    """Make ``state``'s units: one per entry of ``groups``, each the parameters of those
    modules (qualified names) that no earlier unit took; ``None`` stands for every
    parameter no other unit takes (the root)."""
    modules = dict(model.named_modules())
    taken: set[int] = set()
    members: list[list[int] | None] = []
    for group in groups:
        if group is None:
            members.append(None)
            continue
        mine = [state.index[id(p)] for name in group for p in modules[name].parameters()]
        mine = [i for i in dict.fromkeys(mine) if i not in taken]
        taken.update(mine)
        members.append(mine)
    rest = [i for i in range(len(state.params)) if i not in taken]
    state.units = [m if m is not None else rest for m in members]  # a unit may be empty (no root parameter)
    state.layouts = [unit_layout([tuple(state.params[i].shape) for i in u], [state.params[i].dtype for i in u],
                                 world=state.world, rank=state.rank, group_name=state.group_name,
                                 compute_dtype=state.compute_dtype, reduce_dtype=state.reduce_dtype,
                                 reduce_via=state.reduce_via) if u else None
                     for u in state.units]
    state.carries = []
