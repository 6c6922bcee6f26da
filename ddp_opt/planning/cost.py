"""Measurements and estimates for the cost-model bucket plan (Note [Cost-model
bucket plan] in ``ddp_opt.planning.solver``): the link (latency, bandwidth), this device's
compute rates, and each graph node's backward seconds.

Note [Cost measurement]

Background
    The DP needs an all-reduce's time for n bytes on the path the gradients travel, each
    part of backward's time, and a graph break's cost. All ranks must plan alike, so
    every measured number is rank 0's, broadcast.

Algorithm
    - Link: after ``warmup`` all-reduces, time ``reps`` of each of a few sizes through
      ``probe`` (``dist.all_reduce`` on DDP's group, or the benchmark's simulated link),
      take the median per size and fit ``t = alpha + n / beta`` by least squares.
    - Device rates: a matmul (FLOP/s), a copy (bytes/s) and a one-element add (seconds
      per operator), timed once on the parameters' device.
    - Backward per node: FLOPs on meta copies under ``FlopCounterMode``, backward taken as
      2x forward; nodes without FLOPs are memory-bound (2x output bytes over the copy
      rate); each non-view node adds 2 per-operator costs, which dominate small models on
      CPU. Only the ranking of plans must be right, not the seconds.
    - ``gamma``, one graph break, is a setting: a partition call and an autograd node,
      not a measurable amount of work.

Notes
    A node whose FLOP count fails counts as memory-bound (logged). Explicit numbers
    (``LinkEstimate``, ``DeviceRates``) skip measuring and are not broadcast: different
    numbers on different ranks are caught by Note [Plan agreement].
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import fx

from compiler.ranks import LinkEstimate, best_seconds, broadcast_floats, fit_link, time_sizes

from .._torch_internals import AUTOCAST_ENTER, AUTOCAST_EXIT, SET_GRAD_ENABLED, is_view, node_example, size_hint
from .solver import NO_HOOK_COMPUTE, HookCompute

log = logging.getLogger(__name__)

__all__ = [
    "DeviceRates", "CostModel", "best_seconds", "broadcast_floats", "fit_link", "measure_link", "measure_rates",
    "node_backward_costs", "DEFAULT_PROBE_SIZES", "MIN_BUCKET_BYTES",
]

DEFAULT_PROBE_SIZES = (64 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
MIN_BUCKET_BYTES = 1 << 20  # the auto plan's smallest bucket but the last (Note [Cost-model bucket plan])
Probe = Callable[[torch.Tensor], Any]  # (tensor) -> Future / Work / anything with .wait()


@dataclass(frozen=True)
class DeviceRates:
    """Compute rates of this device: ``flops`` per second (matmul), ``bytes`` per second (copy),
    ``op_s`` seconds of fixed cost per operator (dispatch / launch)."""

    flops: float
    bytes: float
    op_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.flops > 0 and self.bytes > 0 and self.op_s >= 0):
            raise ValueError(f"DeviceRates(flops={self.flops!r}, bytes={self.bytes!r}, op_s={self.op_s!r}): both "
                             "rates must be > 0 and the per-operator cost >= 0.")


@dataclass(frozen=True)
class CostModel:
    """Everything the DP needs besides the graph.

    Attributes:
        link: the measured or given link.
        rates: the measured or given device rates.
        gamma_s: seconds one extra partition (graph break) costs.
        contention_s_per_byte: backward seconds a byte in flight takes (0 unless calibrated).
        hook: what the comm hook computes per bucket while backward runs (PowerSGD's power
            iteration under a reducer strategy; none otherwise).
        min_bucket_bytes: the smallest bucket the plan makes but the last (``solve_table``),
            1 MiB by default; 0 plans over single units (Note [Cost-model bucket plan]).
    """

    link: LinkEstimate
    rates: DeviceRates
    gamma_s: float = 5e-4
    contention_s_per_byte: float = 0.0
    min_bucket_bytes: int = MIN_BUCKET_BYTES
    hook: HookCompute = NO_HOOK_COMPUTE

    def __post_init__(self) -> None:
        if isinstance(self.min_bucket_bytes, bool) or not isinstance(self.min_bucket_bytes, int) \
                or self.min_bucket_bytes < 0:
            raise ValueError(
                f"CostModel(min_bucket_bytes={self.min_bucket_bytes!r}): expected a whole number of bytes >= 0, "
                "the smallest bucket the auto plan may make but the last; the default is 1 MiB (1 << 20), "
                "0 lets it plan over single units."
            )


# --- measuring -------------------------------------------------------------------


def _wait(handle: Any) -> None:
    if handle is not None and hasattr(handle, "wait"):
        handle.wait()


def measure_link(probe: Probe | None = None, *, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu", sizes: Sequence[int] = DEFAULT_PROBE_SIZES, reps: int = 3,
                 warmup: int = 2) -> LinkEstimate:
    """Time an all-reduce sweep and fit the link; every rank returns rank 0's fit.

    Args:
        probe: ``probe(tensor)`` starts an all-reduce of ``tensor`` and returns
            something with ``wait()``; default ``dist.all_reduce(..., async_op=True)``
            on ``group``. All ranks must call this together.
        group: the process group (DDP's), also used to broadcast the result.
        device: where the probe buffers live (the gradients' device).
        sizes: buffer sizes in bytes; reps: timed repetitions per size;
        warmup: untimed all-reduces of the smallest size first.
    """
    device = torch.device(device)
    if probe is None:
        def probe(t: torch.Tensor):  # noqa: E306
            return dist.all_reduce(t, group=group, async_op=True)
    bufs = {s: torch.zeros(max(1, s // 4), dtype=torch.float32, device=device) for s in sizes}
    xs = list(sizes)
    ys = time_sizes(lambda s: _wait(probe(bufs[s])), xs, device, reps=reps, warmup=warmup)
    fit = fit_link(xs, ys)
    alpha, bandwidth = broadcast_floats([fit.alpha_s, fit.bandwidth], group)
    est = LinkEstimate(alpha, bandwidth, "measured")
    log.info("ddp_opt measured the link: %.3f ms + %.4g MB/s (rank 0's fit of %s)", alpha * 1e3, bandwidth / 1e6,
             ", ".join(f"{x // 1024} KiB {y * 1e3:.2f} ms" for x, y in zip(xs, ys)))
    return est


def measure_rates(device: torch.device | str = "cpu", *, group: dist.ProcessGroup | None = None,
                  n: int = 256, copy_bytes: int = 32 * 2**20, reps: int = 5) -> DeviceRates:
    """Matmul FLOP/s and copy bytes/s on ``device`` (best of ``reps``); rank 0's on every rank."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device)
    src = torch.empty(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)

    def best(fn: Callable[[], Any]) -> float:
        return best_seconds(fn, device, reps)

    tiny = torch.zeros(1, device=device)

    def hundred_tiny_ops() -> None:
        for _ in range(100):
            tiny.add_(1.0)

    with torch.no_grad():
        flops = 2 * n**3 / best(lambda: a @ a)
        nbytes = 2 * copy_bytes / best(lambda: dst.copy_(src))
        op_s = best(hundred_tiny_ops) / 100
    flops, nbytes, op_s = broadcast_floats([flops, nbytes, op_s], group)
    log.info("ddp_opt measured the device: %.3g GFLOP/s matmul, %.3g GB/s copy, %.2g us per operator",
             flops / 1e9, nbytes / 1e9, op_s * 1e6)
    return DeviceRates(flops, nbytes, op_s)


# --- estimating backward time ----------------------------------------------------


def _fake(node_or_value: Any) -> Any:
    return node_example(node_or_value) if isinstance(node_or_value, fx.Node) else node_or_value


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        if is_view(value):
            return 0
        return size_hint(value.numel()) * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _meta(value: Any) -> Any:
    """A meta tensor shaped like a (fake) tensor value: ops run on it for FLOP counting
    without the fake mode dynamo traced with (placeholders and nodes may carry values
    of different fake modes)."""
    if isinstance(value, torch.Tensor):
        size = [size_hint(s) for s in value.shape]  # dynamic shapes: the example size, no guard added
        return torch.empty(size, dtype=value.dtype, device="meta", requires_grad=False)
    if isinstance(value, torch.SymInt):  # a symbolic size passed as an argument (view, reshape, ...)
        return size_hint(value)
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        raise TypeError("symbolic float/bool argument")  # not worth a guard: counted as memory-bound
    return value


def _forward_flops(node: fx.Node) -> int | None:
    """FLOPs of ``node`` on meta copies of its example values; None when it cannot be run."""
    from torch.utils.flop_counter import FlopCounterMode

    if node.op not in ("call_function", "call_method"):
        return 0
    try:
        args = fx.node.map_aggregate(node.args, lambda a: _meta(_fake(a)))
        kwargs = fx.node.map_aggregate(node.kwargs, lambda a: _meta(_fake(a)))
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            if node.op == "call_method":
                getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that cannot run on meta values: count it as memory-bound
        return None
    return int(counter.get_total_flops())


_SKIP = {AUTOCAST_ENTER, AUTOCAST_EXIT, SET_GRAD_ENABLED}


def node_backward_costs(gm: fx.GraphModule, rates: DeviceRates) -> dict[fx.Node, float]:
    """Estimated backward seconds of every node (see Note [Cost measurement])."""
    costs: dict[fx.Node, float] = {}
    failed = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or node.target in _SKIP:
            costs[node] = 0.0
            continue
        flops = _forward_flops(node)
        if flops is None:
            failed += 1
        nbytes = _tensor_bytes(_fake(node))
        overhead = 2 * rates.op_s if nbytes else 0.0  # views: no backward kernel of their own
        if flops:
            costs[node] = 2 * flops / rates.flops + overhead
        else:
            costs[node] = 2 * nbytes / rates.bytes + overhead
    if failed:
        log.debug("ddp_opt cost model: %d node(s) could not run on meta values; counted as memory-bound", failed)
    return costs
