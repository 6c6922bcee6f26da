"""Regional compile: find a model's repeated blocks and compile each in place.

Both wrappers use it: ``ddp_opt`` compiles the blocks once and buckets DDP's
gradients by whole blocks (Note [Regional compile] in ``ddp_opt.strategies.regional``),
``fsdp_opt`` compiles each block before sharding it. Finding is pure inspection
of the module tree (Note [Finding blocks]); :func:`compile_blocks` compiles the
blocks in place.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from torch import nn

from .backends import SettingError

log = logging.getLogger(__name__)

__all__ = ["block_containers", "block_lists", "check_blocks_setting", "compile_blocks", "find_blocks"]

# The containers models keep their blocks in: nanoGPT and HF a ModuleList, torchtitan a
# ModuleDict keyed "0", "1", ..., torchvision a Sequential per stage.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_KINDS = "an nn.ModuleList, nn.ModuleDict or nn.Sequential"


def check_blocks_setting(blocks: str | Sequence[str], owner: str) -> str | tuple[str, ...]:
    """Validate a ``blocks`` setting before any model is seen; returns it normalized
    (a sequence becomes a tuple). ``owner`` names the config in the message."""
    if isinstance(blocks, str):
        if not blocks:
            raise SettingError("blocks", f"{owner}.blocks='' names no module. Use 'auto' or the name of the "
                                         "ModuleList, ModuleDict or Sequential that holds the blocks.")
        return blocks
    names = tuple(blocks) if isinstance(blocks, (list, tuple)) else ()
    if not names or not all(isinstance(n, str) and n for n in names):
        raise SettingError(
            "blocks",
            f"{owner}.blocks={blocks!r}: expected 'auto', the name of one ModuleList, ModuleDict or Sequential, "
            "or a non-empty sequence of module names such as ('layers.0', 'layers.1').",
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


def block_containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every ``nn.ModuleList``, ``nn.ModuleDict`` and ``nn.Sequential`` in ``model``
    (the model itself included, as ``""``), with its name, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, CONTAINERS)]


def block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every ``nn.ModuleList`` in ``model``, with its name, in module order
    (:func:`block_containers` also lists ModuleDicts and Sequentials)."""
    return [(name, m) for name, m in block_containers(model) if isinstance(m, nn.ModuleList)]


def find_blocks(model: nn.Module, blocks: str | Sequence[str] = "auto") -> list[tuple[str, nn.Module]]:
    """The blocks to compile and shard, as ``(name, module)`` in forward order.

    Note [Finding blocks]
    ---------------------
    Background: a block is the unit compiled once and reused, and sharded as one
    FSDP unit. Models write their repeated blocks in a few ways: nanoGPT and HF
    ``nn.ModuleList``, torchtitan ``nn.ModuleDict`` (keys ``"0"``, ``"1"``, ...),
    torchvision ``nn.Sequential`` per stage, small models plain attributes
    (``self.block_a = Block(); self.block_b = Block()``).

    Algorithm (``blocks="auto"``):

    1. Containers: the children of every ModuleList, ModuleDict or Sequential
       whose children are all one class (a Sequential needs at least two, so a
       model that is a Sequential of different layers is not taken), outermost
       containers only: a container inside a chosen block belongs to that block.
    2. Only when step 1 finds nothing, or finds only blocks inside the ones this
       step finds (each ``Block`` keeping its own ModuleList of heads): repeated
       children, two or more direct children of one class that has parameters
       (a container is not a block), under one module that is not a container
       (a mixed container is a pipeline of layers, not a stack of blocks). The
       outermost such module is taken (the shallowest, the first in definition
       order among equals), with every repeated class it holds.

    Notes: names are qualified (``layers.0``) and come back in ``named_modules``
    order, the definition order, which is the forward order of the usual
    ``for layer in self.layers`` loop.

    Debugging: ``block_containers(model)`` lists every candidate container; the
    error of a failed search lists them and names modules that work.

    Args:
        model: the unsharded model.
        blocks: ``"auto"`` (see the Note); the name of one ModuleList, ModuleDict
            or Sequential (``"layers"``): its children, whatever their classes; or
            a sequence of module names (``("layers.0", "layers.1")``).

    Returns:
        ``(qualified name, module)`` pairs, in module order.

    Raises:
        ValueError: nothing found, a name that is not in the model or not a
            non-empty container, or a block nested inside another block. The
            message lists the candidate containers and names modules that work.
    """
    if blocks == "auto":
        chosen = _auto(model)
        if not chosen:
            raise ValueError(
                f"blocks='auto' found no repeated blocks in {type(model).__name__}: it looks for {_KINDS} whose "
                "children are all one class, then for two or more children of one class (with parameters) "
                f"under one module, and {_describe(model)}. {_how_to_name(model)}"
            )
        return chosen

    modules = dict(model.named_modules())
    names = [blocks] if isinstance(blocks, str) else list(blocks)
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(
            f"blocks={blocks!r}: {missing} not found in {type(model).__name__}; {_describe(model)}. "
            f"{_how_to_name(model, auto=True)}"
        )
    if isinstance(blocks, str):
        found = modules[blocks]
        if not isinstance(found, CONTAINERS) or len(found) == 0:
            what = f"an empty {type(found).__name__}" if isinstance(found, CONTAINERS) else \
                f"a {type(found).__name__}, not {_KINDS}"
            raise ValueError(
                f"blocks={blocks!r} names {what}: a single name must be a non-empty container whose children "
                f"are the blocks; {_describe(model)}. {_how_to_name(model, under=blocks, auto=True)}"
            )
        return [(_join(blocks, n), child) for n, child in found.named_children()]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if a == b or _inside(a, b) or _inside(b, a):
                raise ValueError(
                    f"blocks={blocks!r}: '{a}' and '{b}' overlap (the same module, or one inside the "
                    "other). Each parameter belongs to one shard unit: list disjoint modules."
                )
    order = {name: i for i, name in enumerate(modules)}
    return sorted(((n, modules[n]) for n in names), key=lambda item: order[item[0]])


def _auto(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Note [Finding blocks]: the containers' children, else the repeated children."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, container in block_containers(model):
        if not _uniform(container) or any(_inside(name, n) for n, _ in chosen):
            continue
        chosen.extend((_join(name, n), child) for n, child in container.named_children())
    repeated = _repeated_children(model)
    if chosen and not all(any(_inside(n, r) for r, _ in repeated) for n, _ in chosen):
        log.debug("find_blocks: %d blocks in containers of %s", len(chosen), type(model).__name__)
        return chosen
    log.debug("find_blocks: %d repeated children in %s", len(repeated), type(model).__name__)
    return repeated


def _repeated_children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Step 2 of Note [Finding blocks]: the repeated children of the outermost module
    that has any."""
    best: tuple[int, list[tuple[str, nn.Module]]] | None = None
    for name, parent in model.named_modules():
        depth = name.count(".") + 1 if name else 0
        if isinstance(parent, CONTAINERS) or (best is not None and depth >= best[0]):
            continue
        by_class: dict[type, list[nn.Module]] = {}
        for child in parent.children():
            if not isinstance(child, CONTAINERS):
                by_class.setdefault(type(child), []).append(child)
        repeated = {id(c) for group in by_class.values() if len(group) >= 2 and all(map(_has_params, group))
                    for c in group}
        if repeated:
            best = (depth, [(_join(name, n), c) for n, c in parent.named_children() if id(c) in repeated])
    return best[1] if best is not None else []


def _uniform(container: nn.Module) -> bool:
    kinds = [type(child) for child in container.children()]
    least = 2 if isinstance(container, nn.Sequential) else 1
    return len(kinds) >= least and len(set(kinds)) == 1


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _outermost(containers: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    kept: list[tuple[str, nn.Module]] = []
    for name, c in containers:
        if not any(k and name != k and _inside(name, k) for k, _ in kept):  # the model itself hides nothing
            kept.append((name, c))
    return kept


def _describe(model: nn.Module, limit: int = 8) -> str:
    """The outermost candidate containers, for error messages."""
    containers = _outermost(block_containers(model))
    if not containers:
        return "the model has no nn.ModuleList, nn.ModuleDict or nn.Sequential"
    parts = []
    for name, c in containers[:limit]:
        kinds = "/".join(sorted({type(child).__name__ for child in c.children()}))
        parts.append(f"{repr(name) if name else '(the model itself)'} ({type(c).__name__}, "
                     f"{f'{len(c)} x {kinds}' if len(c) else 'empty'})")
    more = f" and {len(containers) - limit} more" if len(containers) > limit else ""
    return "candidate containers: " + ", ".join(parts) + more


def _how_to_name(model: nn.Module, under: str = "", auto: bool = False) -> str:
    """Fixes that work for this model: ``blocks='auto'`` where it finds blocks (with
    ``auto``), a non-empty container the model has, and a tuple of its own module
    names (the children with parameters of ``under``, or of the first module that
    has more than one)."""
    found = _auto(model) if auto else []
    ways = [f"blocks='auto' (finds {found[0][0]}{f' .. {found[-1][0]}' if len(found) > 1 else ''})"] if found else []
    ways += [f"blocks={n!r} (the children of that container)"
             for n, c in block_containers(model) if n and len(c)][:1]
    names = _example_names(model.get_submodule(under), under) or (_example_names(model, "") if under else [])
    if names:
        shown = ", ".join(repr(n) for n in names[:6]) + (", ..." if len(names) > 6 else "")
        ways.append(f"blocks=({shown}{',' if len(names) == 1 else ''}) (any disjoint modules)")
    if not ways:
        return (f"{type(model).__name__} has no submodules with parameters, so there are no blocks to compile "
                "or shard one by one: compile or shard the model whole.")
    return "Name the blocks explicitly: " + ", or ".join(ways) + "."


def _example_names(module: nn.Module, prefix: str) -> list[str]:
    """The children with parameters of ``module`` (or of its only such child, and so
    on down), leaving out one that shares a parameter with an earlier one (a tied
    head): a parameter belongs to one block."""
    while True:
        children, seen = [], set()
        for n, c in module.named_children():
            ids = {id(p) for p in c.parameters()}
            if ids and not ids & seen:
                children.append((n, c))
            seen |= ids
        if len(children) == 1 and next(children[0][1].children(), None) is not None:
            prefix, module = _join(prefix, children[0][0]), children[0][1]
            continue
        return [_join(prefix, n) for n, _ in children]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _inside(child: str, parent: str) -> bool:
    return parent == "" or child.startswith(parent + ".")
