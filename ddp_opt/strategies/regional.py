"""Regional compile under DDP: compile the repeated block once, bucket by blocks.

Note [Regional compile]

Background
    Whole-model compile traces and lowers every transformer layer again, although the
    layers are the same code on parameters of the same shapes. Compiling the block's
    forward gives one dynamo graph that every instance reuses: with
    ``inline_inbuilt_nn_modules`` the parameters are graph inputs, so the first block's
    guards hold for the others.

Algorithm
    - ``compiler.graph.regional.find_blocks`` picks the repeated blocks;
      ``compiler.graph.regional.compile_blocks`` compiles each in place, never split inside.
    - Everything else (embeddings, final norm, head, loss) runs eagerly: a small share of
      the compute, and compiling it would need a break at every block.
    - A compiled block's backward is one autograd node, so partition boundaries are block
      boundaries: :func:`plan_block_buckets` groups whole blocks in gradient-ready order
      up to DDP's caps. Parameters registered after the last block open the first
      bucket, those before the first block close the last one. ``CompiledDDP``
      realigns DDP's reducer to these buckets after step 1 (Note [Bucket realignment]).

Notes
    - Each compiled block call pays a fixed price (guard check, AOTAutograd's wrappers)
      that a whole-model graph pays once, the same with ``aot_eager``: small blocks pay
      a visible share of the step (measured: docs/ddp.md, Regional compile).
    - The outside-parameter order is a heuristic; an unusual model shows it as alignment
      below 1.0, not as wrong results. A block that breaks its graph still works.
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

from compiler import find_blocks

from ..planning.buckets import Bucket, BucketCaps
from .base import Built, Setup, caps_from_ddp

__all__ = ["build", "find_ddp_blocks", "plan_block_buckets"]


def find_ddp_blocks(model: nn.Module, blocks: str | Sequence[str] = "auto") -> list[tuple[str, nn.Module]]:
    """``compiler.graph.regional.find_blocks`` with an error that says how to fix it for DDP."""
    try:
        return find_blocks(model, blocks)
    except ValueError as e:
        raise ValueError(
            f"Regional compile needs repeated blocks to compile once and reuse: {e} Pass them as "
            "compile_ddp(..., strategy='regional', blocks=...) (launcher: compile.blocks=...), or compile the whole "
            "model instead (compile_ddp(..., strategy='split'); launcher: ddp.strategy=split)."
        ) from None


def _unit(model_params: dict[int, str], params: list[nn.Parameter]) -> Bucket:
    unit = Bucket()
    for p in params:
        unit.params.append(model_params[id(p)])
        unit.param_ids.append(id(p))
        unit.size += p.numel() * p.element_size()
    return unit


def plan_block_buckets(model: nn.Module, found: list[tuple[str, nn.Module]], caps: BucketCaps) -> list[Bucket]:
    """Buckets made of whole blocks, in forward order (see the Note).

    Args:
        model: the model (DDP's ``module``).
        found: its blocks, in forward order, from :func:`find_ddp_blocks`.
        caps: DDP's caps (``caps_from_ddp``), in gradient-ready order.
    """
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = {id(p): n for n, p in trainable}
    in_block: dict[int, int] = {}
    for i, (_, block) in enumerate(found):
        for p in block.parameters():
            if id(p) in names:
                in_block.setdefault(id(p), i)
    order = [i for i, (n, p) in enumerate(trainable) if id(p) in in_block]
    first = order[0] if order else len(trainable)
    before = [p for i, (_, p) in enumerate(trainable) if id(p) not in in_block and i < first]
    after = [p for i, (_, p) in enumerate(trainable) if id(p) not in in_block and i >= first]
    per_block = [[p for _, p in trainable if in_block.get(id(p)) == i] for i in range(len(found))]

    # Gradient-ready order: after-the-blocks, last block .. first block, before. Greedy
    # over these units, as DDP fills its buckets over parameters: the small outside
    # groups ride with their neighbouring blocks instead of costing a collective each.
    units = ([after] if after else []) + list(reversed(per_block)) + ([before] if before else [])
    buckets: list[Bucket] = []
    current: Bucket | None = None
    for params in units:
        unit = _unit(names, params)
        if current is None:
            current = Bucket(cap=caps.cap_for(len(buckets)))
        current.size += unit.size
        current.params += unit.params
        current.param_ids += unit.param_ids
        if current.size >= current.cap:
            buckets.append(current)
            current = None
    if current is not None:
        buckets.append(current)
    return list(reversed(buckets))


def build(setup: Setup, backend: Callable) -> Built:
    """Each repeated block compiled once, DDP's buckets made of whole blocks (Note [Regional compile])."""
    inner = setup.ddp_model.module
    found = find_ddp_blocks(inner, setup.config.blocks)
    return Built(backend, blocks=found, block_buckets=plan_block_buckets(inner, found, caps_from_ddp(setup.ddp_model)))
