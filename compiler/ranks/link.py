"""A serial link's cost, ``alpha + bytes / bandwidth``, fitted from timed collectives;
shared by ``ddp_opt``'s and ``fsdp_opt``'s plans. Every rank uses rank 0's numbers, so
that every rank plans alike."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["LinkEstimate", "fit_link", "best_seconds", "broadcast_floats", "time_sizes"]


@dataclass(frozen=True)
class LinkEstimate:
    """A serial link: ``alpha_s`` seconds per collective plus ``nbytes / bandwidth``.

    Attributes:
        alpha_s: latency per collective, seconds.
        bandwidth: bytes per second (of the buffer handed to the collective).
        source: where the numbers came from ("measured", "given", ...), for logs.
    """

    alpha_s: float
    bandwidth: float
    source: str = "given"

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0) or not (self.bandwidth > 0):
            raise ValueError(
                f"LinkEstimate(alpha_s={self.alpha_s!r}, bandwidth={self.bandwidth!r}): the latency must be >= 0 "
                "seconds and the bandwidth > 0 bytes/s, e.g. LinkEstimate(1e-3, 100e6) for 1 ms and 100 MB/s."
            )

    def transfer_s(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.bandwidth


def fit_link(sizes: Sequence[int], seconds: Sequence[float], source: str = "measured") -> LinkEstimate:
    """Least-squares fit of ``seconds = alpha + size / bandwidth``.

    A negative intercept becomes 0; a slope <= 0 (sizes too small to see the
    bandwidth) becomes 1 TB/s, i.e. latency-bound.
    """
    n = len(sizes)
    if n < 2 or len(set(sizes)) < 2 or len(seconds) != n:
        raise ValueError("fit_link needs timings of at least two different sizes")
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sxx
    alpha = my - slope * mx
    bandwidth = 1.0 / slope if slope > 0 else 1e12
    return LinkEstimate(max(alpha, 0.0), bandwidth, source)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """The fastest of ``reps`` timed calls of ``fn`` on ``device`` (synchronised), after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return max(min(times), 1e-9)


def time_sizes(run: Callable[[int], Any], sizes: Sequence[int], device: torch.device, *, reps: int = 3,
               warmup: int = 2) -> list[float]:
    """Median seconds of ``run(size)`` (which must finish its collective before returning) per size, after
    ``warmup`` calls at the smallest size."""
    for _ in range(warmup):
        run(min(sizes))
    out = []
    for s in sizes:
        times = []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            run(s)
            _sync(device)
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def broadcast_floats(values: list[float], group: dist.ProcessGroup | None) -> list[float]:
    """Rank 0's values on every rank (identity without a multi-rank group)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values
    box = [list(values)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return [float(v) for v in box[0]]
