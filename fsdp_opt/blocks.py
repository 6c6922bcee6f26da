"""Finding the repeated blocks of a model: the modules that are compiled one by
one and sharded as units. Pure inspection of the module tree; nothing changes."""

from __future__ import annotations

from typing import Sequence

from torch import nn

__all__ = ["find_blocks", "block_lists"]


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
