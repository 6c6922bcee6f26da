"""What the traced FSDP plan measures (Note [Traced FSDP plan]): the link, one fit per
collective on the mesh's group, and each block's forward seconds on the real batch.
Every rank returns rank 0's numbers."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from compiler.ranks import LinkEstimate, broadcast_floats, fit_link, time_sizes

from .plan import CollectiveLink

log = logging.getLogger(__name__)

__all__ = ["measure_collectives", "time_blocks", "PROBE_SIZES"]

PROBE_SIZES = (64 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)  # gathered bytes


def measure_collectives(group: dist.ProcessGroup, device: torch.device, sizes: Sequence[int] = PROBE_SIZES,
                        reps: int = 3) -> CollectiveLink:
    """Fit ``alpha + bytes / rate`` to timed ``all_gather_into_tensor``,
    ``reduce_scatter_tensor`` and ``all_to_all_single`` (with the sum of its rows) calls of
    each size (the full, gathered bytes)."""
    world = dist.get_world_size(group)
    full = {s: torch.zeros(max(world, s // 4 // world * world), device=device) for s in sizes}
    part = {s: torch.zeros(t.numel() // world, device=device) for s, t in full.items()}

    def all_gather(s: int) -> None:
        dist.all_gather_into_tensor(full[s], part[s], group=group)

    def reduce_scatter(s: int) -> None:
        dist.reduce_scatter_tensor(part[s], full[s], group=group)

    received = {s: torch.empty_like(t) for s, t in full.items()}

    def all_to_all(s: int) -> None:  # as traced FSDP reduces with it: the exchange, then the sum of the rows
        dist.all_to_all_single(received[s], full[s], group=group)
        received[s].view(world, -1).sum(0)

    fits = []
    for run in (all_gather, reduce_scatter, all_to_all):
        seconds = time_sizes(run, sizes, device, reps=reps)
        fit = fit_link(list(sizes), seconds)
        fits.append(fit)
        log.debug("fsdp_opt traced: %s %s", run.__name__, ", ".join(
            f"{s // 1024} KiB {t * 1e3:.2f} ms" for s, t in zip(sizes, seconds)))
    values = broadcast_floats([v for f in fits for v in (f.alpha_s, f.bandwidth)], group)
    a, b, c = (LinkEstimate(values[i], values[i + 1], "measured") for i in (0, 2, 4))
    return CollectiveLink(a, b, c)


def time_blocks(blocks: Sequence[nn.Module], run: Callable[[], Any], device: torch.device,
                group: dist.ProcessGroup, enter: Callable[[int], None], leave: Callable[[int], None]
                ) -> tuple[float, list[float]]:
    """Seconds of one eager forward (``run()``) and of each block's forward inside it, rank
    0's on every rank. ``enter(i)`` runs before block ``i``'s clock starts (it gathers the
    block's parameters), ``leave(i)`` after it stops (it frees them): the block times hold no
    collective, and no more than one block is gathered at a time."""
    starts: dict[int, float] = {}
    seconds = [0.0] * len(blocks)
    handles = []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for i, block in enumerate(blocks):
        def pre(module: nn.Module, args: Any, i: int = i) -> None:
            enter(i)
            sync()
            starts[i] = time.perf_counter()

        def post(module: nn.Module, args: Any, out: Any, i: int = i) -> None:
            sync()
            seconds[i] += time.perf_counter() - starts[i]
            leave(i)

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    try:
        with torch.no_grad():
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            total = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    values = broadcast_floats([total] + seconds, group)
    return values[0], values[1:]
