"""Shard-unit planning: which blocks are sharded together by one ``fully_shard``
call. A pure function of the blocks and the target size; nothing is sharded here.

Note [Shard unit grouping]

Background
    FSDP2 makes one parameter group per ``fully_shard`` call (a "shard unit"):
    one all-gather of all the unit's parameters before its forward (and again in
    backward when ``reshard_after_forward``), one reduce-scatter of its
    gradients after its backward. One unit per block is the usual recipe, but
    small blocks then make many small collectives, each paying the link's
    fixed latency and FSDP's copy-in/copy-out overhead; one unit for the whole
    model loses all overlap and holds every gathered parameter at once.
    ``fully_shard([a, b])`` groups several modules into one unit, so consecutive
    small blocks can share one collective of a chosen size.

Algorithm
    - Walk the blocks in forward order.
    - Add each block's parameter bytes to the current unit: ``numel`` times the
      element size of the dtype the all-gather moves (the mixed-precision
      ``param_dtype`` for floating-point parameters when one is set, else the
      parameter's own). These are unsharded bytes, the all-gather's output; each
      rank sends ``bytes / world_size``. A parameter shared by several blocks is
      counted once, in the first block that holds it.
    - Close the unit as soon as its size reaches the target; the next block
      starts a new one. A block larger than the target is a unit by itself.
    - The last unit keeps whatever is left, even below the target: it is the
      first unit in backward, so a small one starts the first reduce-scatter
      early (the same reason DDP's first bucket is small).
    - No target (``None``) gives one unit per block; a target larger than the
      model gives one unit.

Notes
    - Units hold consecutive blocks only: a unit of non-adjacent blocks would be
      gathered at the first one's forward and held through the blocks between.
    - Everything not in a block (embeddings, final norm, head) belongs to the
      root unit, made by ``fully_shard(model)`` last; the plan reports its size.
    - Parameters without ``requires_grad`` are counted: FSDP2 all-gathers them too.

Debugging
    ``print(format_units(plan.units, plan.root_bytes))`` shows the units;
    ``fsdp_opt.apply`` logs the same table at INFO on rank 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from compiler import find_blocks
from .config import FSDPConfig

log = logging.getLogger(__name__)

__all__ = ["ShardUnit", "FSDPPlan", "plan_shard_units", "plan_fsdp", "format_units"]

MiB = 1024 * 1024


@dataclass(frozen=True)
class ShardUnit:
    """Consecutive blocks sharded by one ``fully_shard`` call.

    Attributes:
        index: position in forward order.
        blocks: qualified names of the blocks, in forward order.
        size: bytes of the unit's all-gather (unsharded parameters, counted once).
        target: the byte target the unit was filled against; None when every
            block is its own unit.
    """

    index: int
    blocks: tuple[str, ...]
    size: int
    target: int | None = None


@dataclass(frozen=True)
class FSDPPlan:
    """What ``fsdp_opt.apply`` does to a model, decided before it does it.

    Attributes:
        units: the shard units, in forward order.
        root_bytes: bytes of the parameters left to the root unit.
        config: the configuration the plan was made from.
        compile_cache: the loaded ``compiler.CompileCache`` with
            ``FSDPCompileConfig(cache_dir=...)``, set by ``apply``; else None.
        share: the ``compiler.ranks.share.CompileShare`` of the mesh's ranks when the
            blocks are compiled on more than one rank, set by ``apply``; else None.
        traced: under ``strategy="traced"``, the ``fsdp_opt.traced.TracedPlan`` (its units
            replace ``units``, which then list the blocks one per unit); else None.
    """

    units: tuple[ShardUnit, ...]
    root_bytes: int
    config: FSDPConfig
    compile_cache: Any = field(default=None, compare=False, repr=False)
    share: Any = field(default=None, compare=False, repr=False)
    traced: Any = field(default=None, compare=False, repr=False)

    @property
    def block_names(self) -> list[str]:
        return [name for unit in self.units for name in unit.blocks]

    def table(self) -> str:
        """The plan as a table (see :func:`format_units`; traced: ``TracedPlan.table``)."""
        if self.traced is not None:
            return self.traced.table()
        return format_units(self.units, self.root_bytes)


def _param_bytes(p: torch.Tensor, param_dtype: torch.dtype | None) -> int:
    dtype = param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype
    return p.numel() * torch.empty((), dtype=dtype).element_size()


def plan_shard_units(
    blocks: Sequence[tuple[str, nn.Module]],
    shard_unit_mb: float | None,
    *,
    param_dtype: torch.dtype | None = None,
) -> list[ShardUnit]:
    """Group consecutive blocks into shard units (see Note [Shard unit grouping]).

    Args:
        blocks: ``(name, module)`` pairs in forward order, as ``find_blocks`` returns.
        shard_unit_mb: target all-gather size of a unit in MiB; None for one unit
            per block.
        param_dtype: the dtype FSDP2 all-gathers floating-point parameters in
            (``MixedPrecisionPolicy.param_dtype``); None for their own dtype.

    Returns:
        Units in forward order, covering every block exactly once; empty only
        when ``blocks`` is.
    """
    target = None if shard_unit_mb is None else max(1, int(shard_unit_mb * MiB))
    seen: set[int] = set()
    units: list[ShardUnit] = []
    names: list[str] = []
    size = 0
    for i, (name, module) in enumerate(blocks):
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                size += _param_bytes(p, param_dtype)
        names.append(name)
        last = i == len(blocks) - 1
        if target is None or size >= target or last:
            units.append(ShardUnit(len(units), tuple(names), size, target))
            names, size = [], 0
    return units


def plan_fsdp(model: nn.Module, config: FSDPConfig | None = None) -> FSDPPlan:
    """Find the blocks of ``model`` and group them into shard units. Pure.

    Args:
        model: the unsharded model.
        config: the sharding configuration; None for the defaults.

    Returns:
        The plan: units in forward order and the bytes left to the root.

    Raises:
        ValueError: blocks not found (see ``find_blocks``).
    """
    config = config or FSDPConfig()
    blocks = find_blocks(model, config.blocks)
    param_dtype = config.mp_policy.param_dtype if config.mp_policy is not None else None
    # "auto": one unit per block under per_block (measured its fastest); traced replans its own units
    mb = None if config.shard_unit_mb == "auto" else config.shard_unit_mb
    units = plan_shard_units(blocks, mb, param_dtype=param_dtype)
    in_blocks = {id(p) for _, b in blocks for p in b.parameters()}
    root_bytes, seen = 0, set()
    for p in model.parameters():
        if id(p) not in in_blocks and id(p) not in seen:
            seen.add(id(p))
            root_bytes += _param_bytes(p, param_dtype)
    return FSDPPlan(tuple(units), root_bytes, config)


def format_units(units: Sequence[ShardUnit], root_bytes: int | None = None) -> str:
    """A table of shard units in forward order: index, MiB, target, block names.

    Args:
        units: the units, as ``plan_shard_units`` returns.
        root_bytes: when given, a last row for the root unit.

    Returns:
        The table, one row per block (the unit's numbers on its first row).
    """
    from tabulate import tabulate

    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / MiB:.3f}"

    rows = []
    for u in units:
        rows.append((u.index, len(u.blocks), u.size, mib(u.size), mib(u.target), u.blocks[0]))
        rows.extend(("", "", "", "", "", name) for name in u.blocks[1:])
    if root_bytes is not None:
        rows.append(("root", "", root_bytes, mib(root_bytes), "-", "(parameters outside the blocks)"))
    return tabulate(rows, headers=("unit", "n", "bytes", "MiB", "target MiB", "blocks"), tablefmt="simple")
