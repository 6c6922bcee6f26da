"""Regional compile: find a model's repeated blocks and compile each in place.

Both wrappers use it: ``ddp_opt`` compiles the blocks once and buckets DDP's
gradients by whole blocks (Note [Regional compile] in ``ddp_opt.regional``),
``fsdp_opt`` compiles each block before sharding it. Finding is pure inspection
of the module tree; :func:`compile_blocks` compiles the blocks in place.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from torch import nn

from .backends import SettingError

log = logging.getLogger(__name__)

__all__ = ["block_lists", "check_blocks_setting", "compile_blocks", "find_blocks"]


def check_blocks_setting(blocks: str | Sequence[str], owner: str) -> str | tuple[str, ...]:
    """Validate a ``blocks`` setting before any model is seen; returns it normalized
    (a sequence becomes a tuple). ``owner`` names the config in the message."""
    if isinstance(blocks, str):
        if not blocks:
            raise SettingError("blocks", f"{owner}.blocks='' names no module. Use 'auto' or the name of the block "
                                         "ModuleList.")
        return blocks
    names = tuple(blocks) if isinstance(blocks, (list, tuple)) else ()
    if not names or not all(isinstance(n, str) and n for n in names):
        raise SettingError(
            "blocks",
            f"{owner}.blocks={blocks!r}: expected 'auto', the name of one ModuleList, or a "
            "non-empty sequence of module names such as ('layers.0', 'layers.1').",
        )
    return names


def compile_blocks(found: list[tuple[str, nn.Module]], backend: Callable, *, dynamic: bool | None = None,
                   fullgraph: bool = False, **more: Any) -> None:
    """Compile each block in place (``Module.compile``); instances of one class
    share one dynamo graph (parameters are graph inputs, not constants)."""
    for _, block in found:
        block.compile(backend=backend, dynamic=dynamic, fullgraph=fullgraph, **more)
    log.info("regional compile: %d blocks of %s compiled in place",
             len(found), "/".join(sorted({type(b).__name__ for _, b in found})))


def block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every ``nn.ModuleList`` in ``model``, with its name, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]


def _is_uniform(lst: nn.ModuleList) -> bool:
    return len(lst) > 0 and len({type(child) for child in lst}) == 1


def _describe(model: nn.Module) -> str:
    lists = block_lists(model)
    if not lists:
        return "the model has no nn.ModuleList at all"
    parts = []
    for name, lst in lists:
        kinds = sorted({type(c).__name__ for c in lst})
        parts.append(f"'{name}' ({len(lst)} x {'/'.join(kinds) or 'nothing'})")
    return "candidate ModuleLists: " + ", ".join(parts)


def find_blocks(model: nn.Module, blocks: str | Sequence[str] = "auto") -> list[tuple[str, nn.Module]]:
    """The blocks to compile and shard, as ``(name, module)`` in forward order.

    Args:
        model: the unsharded model.
        blocks: ``"auto"``: the children of every ModuleList whose children are
            all of one class, outermost lists only (a list nested inside a block
            belongs to that block); the name of one ModuleList (``"blocks"``):
            its children; or a sequence of module names (``("blocks.0", ...)``).

    Returns:
        ``(qualified name, module)`` pairs, in the order of ``named_modules``
        (the model's definition order, which is the forward order for the usual
        ``for block in self.blocks`` loop).

    Raises:
        ValueError: nothing found, a name that is not in the model, or a block
            nested inside another block. The message lists the candidate ModuleLists.
    """
    if blocks == "auto":
        chosen: list[tuple[str, nn.Module]] = []
        for name, lst in block_lists(model):
            if not _is_uniform(lst) or any(_inside(name, n) for n, _ in chosen):
                continue
            chosen.extend((f"{name}.{child_name}" if name else child_name, child) for child_name, child in lst.named_children())
        if not chosen:
            raise ValueError(
                f"blocks='auto' found no repeated blocks in {type(model).__name__}: it looks for an "
                f"nn.ModuleList whose children are all one class, and {_describe(model)}. Name the blocks "
                "explicitly: blocks='layers' for a ModuleList, or blocks=('encoder.0', 'encoder.1', ...)."
            )
        return chosen

    modules = dict(model.named_modules())
    names = [blocks] if isinstance(blocks, str) else list(blocks)
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(
            f"blocks={blocks!r}: {missing} not found in {type(model).__name__}; {_describe(model)}. "
            "Pass the name of a ModuleList, a sequence of module names, or 'auto'."
        )
    if isinstance(blocks, str):
        lst = modules[blocks]
        if not isinstance(lst, nn.ModuleList) or len(lst) == 0:
            raise ValueError(
                f"blocks={blocks!r} names a {type(lst).__name__}, not a non-empty nn.ModuleList; "
                f"{_describe(model)}. Name the ModuleList, or pass the block names as a sequence."
            )
        return [(f"{blocks}.{n}", child) for n, child in lst.named_children()]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if a == b or _inside(a, b) or _inside(b, a):
                raise ValueError(
                    f"blocks={blocks!r}: '{a}' and '{b}' overlap (the same module, or one inside the "
                    "other). Each parameter belongs to one shard unit: list disjoint modules."
                )
    order = {name: i for i, name in enumerate(modules)}
    return sorted(((n, modules[n]) for n in names), key=lambda item: order[item[0]])


def _inside(child: str, parent: str) -> bool:
    return parent == "" or child.startswith(parent + ".")
