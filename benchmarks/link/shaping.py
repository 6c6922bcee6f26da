"""A simulated inter-node link for DDP: a comm hook that does the real all-reduce,
then completes its future only when a modelled serial link would have delivered
the bucket (see Note [Simulated link]).

Note [Simulated link]
---------------------
Background: loopback gloo all-reduces far faster than a network link, and both ranks
share the same cores, so nothing is left to overlap with (measured:
docs/benchmarks/index.md). What decides whether a compiled backward hides
communication on a real link is *when* each bucket becomes ready.

Model: one serial link per process, described by a latency ``alpha`` (seconds)
and a bandwidth (bytes/s). A bucket handed to the hook at wall time ``t_ready``
starts on the link at ``start = max(t_ready, link_free_at)`` and is delivered at
``done = start + alpha + nbytes / bandwidth``; ``link_free_at`` becomes ``done``.
Buckets are served in the order DDP launches them, one at a time.

Algorithm: the hook divides the bucket by the world size and launches the real
``all_reduce`` (so gradients stay exact), then hands ``(ready, size, real future,
result future)`` to a single background thread. The thread serves the buckets in
order: it takes ``t_ready``, schedules the bucket on the link, waits for the real
all-reduce and sleeps until ``done`` before setting the result, so backward is
never blocked by the model; DDP waits on the result future at the end of
backward, as it would on a real network.

CUDA tensors: the CPU queues kernels ahead of the GPU, so the hook's wall time is
not when the bucket exists. The hook records a CUDA event on the stream that
filled the bucket, and the thread takes ``t_ready`` once that event has
completed. The result future is built with ``devices=[the bucket's device]``, as
``torch.futures.Future`` requires for CUDA values: ``set_result`` then records
events on the thread's current stream and whoever waits on the future (DDP's
reducer) makes its own stream wait for them. The thread waits for the real
all-reduce and sets the result on a side stream of its own, so that the wait is
not put on the stream backward computes on (which would serialise the rest of
backward behind the all-reduce and hide no communication at all).

Notes: ``LinkModel`` is the pure time model (unit tested); ``SimulatedLink``
adds the clock, the thread and per-step accounting (``take_step_stats``). With
no link (``parse_link("none")``) the hook is plain all-reduce plus accounting
(``real.then(...)``, whose future carries the real one's devices).
"""

from __future__ import annotations

import contextlib
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import ContextManager

import torch
import torch.distributed as dist

__all__ = ["LinkModel", "SimulatedLink", "parse_link", "LINK_PRESETS"]

LINK_PRESETS = ("none", "1ms,1GB/s", "1ms,100MB/s")

_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_RATE_UNITS = {"B/s": 1, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "KiB/s": 2**10, "MiB/s": 2**20, "GiB/s": 2**30}


@dataclass(frozen=True)
class LinkModel:
    """Latency ``alpha_s`` (seconds) and ``bandwidth`` (bytes/s); None bandwidth = no link."""

    alpha_s: float = 0.0
    bandwidth: float | None = None
    label: str = "none"

    @property
    def enabled(self) -> bool:
        return self.bandwidth is not None

    def transfer_s(self, nbytes: int) -> float:
        """Seconds one bucket of ``nbytes`` occupies the link."""
        if not self.enabled:
            return 0.0
        return self.alpha_s + nbytes / self.bandwidth

    def schedule(self, ready_at: float, link_free_at: float, nbytes: int) -> tuple[float, float]:
        """(start, done) of a bucket ready at ``ready_at`` on a link free at ``link_free_at``."""
        start = max(ready_at, link_free_at)
        return start, start + self.transfer_s(nbytes)


def parse_link(spec: str) -> LinkModel:
    """Parse ``none`` or ``ALPHA,BANDWIDTH`` such as ``1ms,100MB/s`` or ``0.5ms,2.5GB/s``.

    Raises:
        ValueError: the text does not match; the message lists the accepted forms.
    """
    text = spec.strip()
    if text.lower() == "none":
        return LinkModel()
    m = re.fullmatch(r"\s*([0-9.]+)\s*(s|ms|us)\s*,\s*([0-9.]+)\s*([KMG]?i?B/s)\s*", text)
    if m is None or m.group(4) not in _RATE_UNITS:
        raise ValueError(
            f"--link {spec!r} is not a link description: expected 'none' or 'ALPHA,BANDWIDTH' with "
            f"ALPHA in s/ms/us and BANDWIDTH in {'/'.join(_RATE_UNITS)}, e.g. one of {', '.join(LINK_PRESETS)}. "
            "Use --link none to measure plain loopback all-reduce."
        )
    alpha = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    bandwidth = float(m.group(3)) * _RATE_UNITS[m.group(4)]
    if bandwidth <= 0:
        raise ValueError(f"--link {spec!r} has zero bandwidth, so no bucket would ever be delivered; give a "
                         "positive rate (e.g. 1ms,100MB/s) or use --link none.")
    return LinkModel(alpha, bandwidth, label=text.replace(" ", ""))


@dataclass
class _StepStats:
    buckets: int = 0
    nbytes: int = 0
    link_s: float = 0.0
    sizes: list[int] = field(default_factory=list)


class SimulatedLink:
    """Per-process link state; ``hook`` is the DDP comm hook.

    Register with ``ddp.register_comm_hook(link, SimulatedLink.hook)``. One link
    object may serve several DDP models in one process (they never run at once).
    """

    def __init__(self, model: LinkModel, process_group: dist.ProcessGroup | None = None) -> None:
        self.model = model
        self.process_group = process_group
        self.link_free_at = 0.0
        self._lock = threading.Lock()
        self._stats = _StepStats()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # the delivery thread's, one per CUDA device

    # -- accounting -------------------------------------------------------------------
    def take_step_stats(self) -> _StepStats:
        """Buckets, bytes and modelled link seconds since the last call."""
        with self._lock:
            stats, self._stats = self._stats, _StepStats()
        return stats

    # -- the hook ---------------------------------------------------------------------
    @staticmethod
    def hook(state, bucket):  # no annotations: DDP compares them as objects, and this module's are strings
        """DDP comm hook: ``state`` is the SimulatedLink, ``bucket`` a ``dist.GradBucket``."""
        return state._reduce(bucket.buffer())

    def probe(self, tensor: torch.Tensor) -> torch.futures.Future:
        """All-reduce ``tensor`` (summed) over the same path as the hook's buckets, not counted
        in the step stats: the link probe for ``compile_ddp(bucket_cap_mb="auto", link=link.probe)``."""
        return self._reduce(tensor, average=False, count=False)

    def _reduce(self, tensor: torch.Tensor, average: bool = True, count: bool = True) -> torch.futures.Future:
        ready_at = time.perf_counter()
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if average:
            tensor.div_(dist.get_world_size(group))
        real = dist.all_reduce(tensor, group=group, async_op=True).get_future()
        nbytes = tensor.numel() * tensor.element_size()
        if count:
            with self._lock:
                self._stats.buckets += 1
                self._stats.nbytes += nbytes
                self._stats.sizes.append(nbytes)
                self._stats.link_s += self.model.transfer_s(nbytes)
        if not self.model.enabled:
            return real.then(lambda fut: tensor)
        ready: float | torch.cuda.Event = ready_at
        devices = None
        if tensor.is_cuda:  # see the Note: ready when the GPU has filled the bucket; a future that names its device
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
            devices = [tensor.device]
        result: torch.futures.Future = torch.futures.Future(devices=devices)
        self._ensure_thread()
        self._queue.put((ready, nbytes, real, result, tensor))
        return result

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._deliver, name="simulated-link", daemon=True)
            self._thread.start()

    def _deliver(self) -> None:
        # Serial link: buckets are served in the order DDP launched them, so FIFO is exact.
        while True:
            ready, nbytes, real, result, tensor = self._queue.get()
            try:
                if isinstance(ready, torch.cuda.Event):
                    ready.synchronize()
                    ready = time.perf_counter()
                with self._lock:
                    _, done = self.model.schedule(ready, self.link_free_at, nbytes)
                    self.link_free_at = done
                with self._side_stream(tensor):
                    real.wait()
                    delay = done - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    result.set_result(tensor)
            except Exception as e:  # noqa: BLE001 - hand the failure to DDP's wait
                result.set_exception(e)

    def _side_stream(self, tensor: torch.Tensor) -> ContextManager:
        """CUDA: the delivery thread's own stream on the bucket's device (see the Note)."""
        if not tensor.is_cuda:
            return contextlib.nullcontext()
        if tensor.device not in self._streams:
            self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        return torch.cuda.stream(self._streams[tensor.device])
