"""After the first step: the compile cache saved, and what the first step's compile cost, on every rank: CPU seconds of the rank's process
tree up to the end of its first step, and what the shared compile did there
(Note [Shared compile]). Gathered on every rank; rank 0 writes it to ``metrics.json``."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from compiler.cache import save_on_local_rank0
from compiler.ranks import CompileShare, cpu_seconds

from .dist import print0

__all__ = ["after_first_compile", "describe", "first_step_compile", "save_compile_cache"]


def save_compile_cache(wrapped: Any) -> None:
    """Save ``compile.cache_dir``'s entry (local rank 0; written only when this process
    compiled something the entry lacks, Note [Compile cache]); a no-op without one."""
    if wrapped.compiled_ddp is not None:
        wrapped.compiled_ddp.save_compile_cache()
    else:
        save_on_local_rank0(wrapped.compile_cache)


def after_first_compile(wrapped: Any, world_size: int) -> dict[str, Any]:
    """After the first step: :func:`save_compile_cache`, then :func:`first_step_compile`
    (a collective: every rank calls it)."""
    save_compile_cache(wrapped)
    return first_step_compile(wrapped.share, world_size, wrapped.cpu_at_compile)


def describe(share: CompileShare, ranks: list[dict[str, Any]]) -> str | None:
    """One line for the log when a rank loaded another's compile: who compiled and who
    loaded, and the CPU it took; None when no rank loaded anything (every rank compiled
    what it ran: ``metrics.json`` still has the counts)."""
    if not share.share or not sum(r.get("loaded", 0) for r in ranks):
        return None
    counts = ", ".join(f"{r.get('compiled', 0)}/{r.get('loaded', 0)}" for r in ranks)
    cpu = sum(r.get("cpu_since_compile_s", 0.0) for r in ranks)
    return (f"compile: the ranks shared the compiles (compile.share=true); compiled/loaded per rank: {counts}; "
            f"CPU for it, all ranks: {cpu:.1f}s")


def first_step_compile(share: CompileShare | None, world_size: int, cpu_at_compile: float) -> dict[str, Any]:
    """Every rank's ``cpu_s`` (its process and its child processes, from process start to
    now: the end of its first step), ``cpu_since_compile_s`` (the same since
    ``cpu_at_compile``, taken once the model was wrapped for compile: the first step's
    tracing, compiles, loads and waits) and its
    shared-compile counts; a collective."""
    now = cpu_seconds()
    mine: dict[str, Any] = {"cpu_s": round(now, 2), "cpu_since_compile_s": round(now - cpu_at_compile, 2)}
    if share is not None:
        mine.update(share.stats.as_dict())
    ranks = [mine]
    if world_size > 1 and dist.is_initialized():
        ranks = [None] * world_size
        dist.all_gather_object(ranks, mine)
    if share is not None and (line := describe(share, ranks)) is not None:
        print0(line)
    return {
        "shared": bool(share is not None and share.share),
        "cpu_s_total": round(sum(r["cpu_s"] for r in ranks), 2),
        "cpu_since_compile_s_total": round(sum(r.get("cpu_since_compile_s", 0.0) for r in ranks), 2),
        "ranks": ranks,
    }
