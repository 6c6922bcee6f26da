"""One shard unit's all-gather and reduce-scatter as one autograd function, traceable by
dynamo: forward all-gathers every parameter of the unit in one collective, backward
reduce-scatters their gradients in one collective (Note [Unit gather]).

Note [Unit gather]

Background
    FSDP2 keeps each parameter as a ``Shard(0)`` DTensor: rank ``r`` holds rows
    ``[r c, (r + 1) c)`` of every parameter, ``c = ceil(rows / world)`` (the last
    ranks may hold fewer rows, or none). Its hooks all-gather a unit's shards before
    the unit's forward and reduce-scatter its gradients after the unit's backward,
    outside any graph dynamo sees. Here the same two collectives are written as
    functional collectives inside one ``autograd.Function``, so that a whole-model
    ``torch.compile(fullgraph=True)`` captures them: forward and backward become one
    graph each, with every collective in it, and the graph passes of
    ``fsdp_opt.traced.schedule`` decide where each is issued and awaited.

Algorithm
    Forward (``UnitGather.forward``), for the unit's parameters ``p_i``:

    1. Pad each local shard to ``c_i`` rows, cast it to the compute dtype, flatten, and
       concatenate: one flat buffer of ``S = sum c_i r_i`` elements (``r_i`` the
       elements of one row).
    2. One ``all_gather_into_tensor`` of it: ``world x S`` elements, rank-major.
    3. Parameter ``i`` is columns ``[o_i, o_i + c_i r_i)`` of that ``world x S``
       matrix, reshaped to ``world c_i`` rows and cut to its real rows.

    Backward (``UnitGather.backward``), given the full gradients:

    1. Each gradient (zeros where a parameter got none) is cast to the reduce dtype,
       padded to ``world c_i`` rows and viewed as ``world x c_i r_i``; the views are
       concatenated by columns into ``world x S``, the layout of step 2 above.
    2. One ``reduce_scatter_tensor`` with ``sum``: rank ``r`` receives row ``r``, the sum
       of every rank's row ``r``; divided by ``world`` (the mean over ranks, as FSDP2 and
       DDP reduce) on the received shard, so no second buffer of the whole unit is made. Or (``reduce_via="all_to_all"``) one
       ``all_to_all_single`` that sends row ``j`` to rank ``j``, and rank ``r`` sums the
       ``world`` rows it receives: gloo's ``reduce_scatter_tensor`` moves every byte of
       the buffer (measured over a shaped link: as long as an all-reduce, twice an
       all-gather of the same bytes), the all-to-all only the ``(world - 1) / world``
       that other ranks own, as an all-gather does. The plan picks the faster on the
       measured link (Note [Traced FSDP plan]).
    3. Parameter ``i``'s gradient shard is columns ``[o_i, o_i + c_i r_i)``, reshaped
       to ``c_i`` rows, cut to the local rows, cast to the parameter's dtype.

    Gradient accumulation without a reduce-scatter (``sync=False``): backward returns
    no gradient to the shards; the ``world x S`` buffer of step 1 goes to the extra
    input ``carry`` instead, a leaf that autograd accumulates micro-batch by
    micro-batch. The synchronising micro-batch passes the accumulated buffer as
    ``carry`` (``sync=True``), and backward adds it before step 2, so the one
    reduce-scatter carries every micro-batch's gradients.

Notes
    - The collectives are the ``_c10d_functional`` ops, each followed by its
      ``wait_tensor``; dynamo and AOTAutograd keep both as graph nodes.
    - Shapes are Python ints fixed at ``apply``: a rank whose shards have fewer rows
      traces a graph of other shapes (uneven sharding only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .._torch_internals import functional_all_gather, functional_all_to_all, functional_reduce_scatter

__all__ = ["ParamSlot", "UnitLayout", "UnitGather", "unit_layout", "REDUCTIONS"]

# How a unit's gradients are reduced: one reduce_scatter_tensor, or one all_to_all_single whose
# received chunks this rank sums (gloo's reduce-scatter carries every byte of the buffer, an
# all-to-all only the chunks other ranks own: Note [Unit gather]).
REDUCTIONS = ("reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lies in its unit's flat buffer.

    Attributes:
        shape: the parameter's full (unsharded) shape.
        chunk: rows per rank, ``ceil(shape[0] / world)``.
        local_rows: rows this rank holds (``chunk`` or fewer).
        offset: first element of its padded shard in the flat shard buffer.
        dtype: the parameter's own dtype (the dtype of its shard and gradient).
    """

    shape: tuple[int, ...]
    chunk: int
    local_rows: int
    offset: int
    dtype: torch.dtype

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def numel(self) -> int:  # elements of the padded shard
        return self.chunk * self.row_numel


@dataclass(frozen=True)
class UnitLayout:
    """The flat layout of one unit's all-gather (Note [Unit gather])."""

    slots: tuple[ParamSlot, ...]
    world: int
    group_name: str
    compute_dtype: torch.dtype | None  # None: each parameter's own dtype
    reduce_dtype: torch.dtype | None  # None: the compute dtype
    reduce_via: str = "reduce_scatter"  # one of REDUCTIONS

    @property
    def shard_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def gather_dtype(self, slot: ParamSlot) -> torch.dtype:
        return self.compute_dtype if self.compute_dtype is not None and slot.dtype.is_floating_point else slot.dtype

    def grad_dtype(self, slot: ParamSlot) -> torch.dtype:
        reduce = self.reduce_dtype if self.reduce_dtype is not None else self.compute_dtype
        return reduce if reduce is not None and slot.dtype.is_floating_point else slot.dtype


def unit_layout(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype], *, world: int, rank: int,
                group_name: str, compute_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                reduce_via: str = "reduce_scatter") -> UnitLayout:
    """The layout of a unit whose parameters have these full shapes and dtypes, on ``rank``."""
    slots, offset = [], 0
    for shape, dtype in zip(shapes, dtypes):
        chunk = -(-shape[0] // world)
        local = max(0, min(chunk, shape[0] - rank * chunk))
        slot = ParamSlot(tuple(shape), chunk, local, offset, dtype)
        slots.append(slot)
        offset += slot.numel
    dtypes_used = {s.dtype for s in slots}
    if compute_dtype is None and len(dtypes_used) > 1:
        raise ValueError(f"a unit's parameters have several dtypes {sorted(map(str, dtypes_used))}: one all-gather "
                         "carries one dtype")
    return UnitLayout(tuple(slots), world, group_name, compute_dtype, reduce_dtype, reduce_via)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    missing = rows - t.shape[0]
    if missing == 0:
        return t
    return torch.cat([t, t.new_zeros((missing,) + tuple(t.shape[1:]))])


def _columns(layout: UnitLayout, grads: Sequence[torch.Tensor | None], carry: torch.Tensor | None,
             device: torch.device) -> torch.Tensor:
    """Backward step 1: the gradients as one ``world x S`` buffer (plus ``carry``)."""
    world, cols = layout.world, []
    for slot, g in zip(layout.slots, grads):
        dtype = layout.grad_dtype(slot)
        if g is None:
            cols.append(torch.zeros((world, slot.numel), dtype=dtype, device=device))
            continue
        cols.append(_pad_rows(g.to(dtype), world * slot.chunk).reshape(world, slot.numel))
    flat = torch.cat(cols, dim=1)
    return flat if carry is None else flat + carry


class UnitGather(torch.autograd.Function):
    """``apply(layout, sync, carry, *shards) -> full parameters`` (Note [Unit gather])."""

    @staticmethod
    def forward(ctx, layout: UnitLayout, sync: bool, carry: torch.Tensor | None, *shards: torch.Tensor):
        ctx.layout, ctx.sync, ctx.has_carry = layout, sync, carry is not None
        ctx.device = shards[0].device
        if sync and carry is not None:
            ctx.save_for_backward(carry)
        world = layout.world
        flat = torch.cat([_pad_rows(s, slot.chunk).to(layout.gather_dtype(slot)).reshape(-1)
                          for slot, s in zip(layout.slots, shards)])
        gathered = functional_all_gather(flat, world, layout.group_name).view(world, -1)
        full = []
        for slot in layout.slots:
            cols = gathered[:, slot.offset:slot.offset + slot.numel]
            full.append(cols.reshape((world * slot.chunk,) + slot.shape[1:])[:slot.shape[0]])
        return tuple(full)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        layout = ctx.layout
        carry = ctx.saved_tensors[0] if ctx.sync and ctx.has_carry else None
        if not ctx.sync:  # accumulate: the buffer is the carry's gradient, the shards get none
            return (None, None, _columns(layout, grads, carry, ctx.device)) + (None,) * len(layout.slots)
        world = layout.world
        flat = _columns(layout, grads, carry, ctx.device).reshape(-1)
        if layout.reduce_via == "all_to_all":
            reduced = functional_all_to_all(flat, world, layout.group_name).view(world, -1).sum(0)
        else:
            reduced = functional_reduce_scatter(flat, world, layout.group_name)
        reduced = reduced / world  # the mean over ranks, on the shard: no second buffer of the whole unit
        shard_grads = []
        for slot in layout.slots:
            piece = reduced[slot.offset:slot.offset + slot.numel].view((slot.chunk,) + slot.shape[1:])
            shard_grads.append(piece[:slot.local_rows].to(slot.dtype))
        return (None, None, None) + tuple(shard_grads)
