"""The physical limit of a DDP step and every row's distance from it, plus each row's
ratio to the best peer (see Note [Physical limit of a step]).

Note [Physical limit of a step]
-------------------------------
Background: overlap efficiency ``(compute + comm - step) / min(compute, comm)`` has
a ceiling below 1 whenever communication outlasts backward, so it cannot say how
far a mode is from the best step the model and the link allow. The limit can.

Derivation: a synchronised DDP step must (1) run forward, (2) run backward, which
makes every gradient, (3) carry every gradient byte over the link, and (4) step
the optimizer on the reduced gradients. No gradient exists before forward ends,
so neither (2) nor (3) starts before it; the optimizer step (one step over the
whole model after DDP's backward returns, as every mode here runs it) starts
only once backward has ended and the last byte has arrived. (2) and (3) may
overlap completely, but neither takes less than it takes alone. So

    step >= fwd + max(bwd, comm) + opt  =:  limit

and ``step_over_limit = step / limit`` is >= 1, 1.0 being a perfect step.

Parts, all measured in the same job as the modes:

- fwd, bwd: medians over measured rounds of each mode's ``no_sync`` step (no
  all-reduce), split by a clock read between forward and backward (on CUDA after
  a synchronize). The limit takes the smallest median over the modes: the
  fastest compute any mode reached, so the bound holds for every mode.
- opt: the median optimizer step of synchronised steps, smallest over the modes.
- comm: the median time of one all-reduce of one flat float32 tensor holding
  all the gradient bytes, over the job's link, a barrier before each: on a
  shaped network (``--net shaped:RATE``) the real link; on the simulated link
  ``max(real all-reduce, alpha + bytes / bandwidth)``, what its comm hook would
  charge one bucket of all the bytes; with neither, loopback. One message pays
  one latency: no bucketing can carry the bytes faster.

Why not tighter: the last gradient backward makes (the first layer's) can only
leave after backward ends, and nothing leaves before the first gradient exists;
adding those terms needs per-parameter ready times that are not measured, so
they are left out: the bound stays valid, only less tight. What the limit does
not charge, and the step pays: on a CPU the link's and gloo's threads compete
with compute for the same cores. And the limit assumes the optimizer runs after
the last bucket: an optimizer applied bucket by bucket as buckets arrive could
beat it by at most ``opt``.

Best peer: among the peers' rows (eager DDP, PyTorch's splitter, compiled
autograd's reducer, every cap each), the one with the least median step;
``ratio_vs_best_peer`` is the median of per-round ratios to it (with IQR), as
every ratio here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .stats import median, ratio_summary

__all__ = ["LimitParts", "limit_parts", "add_limit_columns", "measure_comm", "PEER_MODES"]

PEER_MODES = ("eager", "builtin", "compiled_autograd")  # what users run today (the modes we must beat)


@dataclass(frozen=True)
class LimitParts:
    """Seconds of each part of the limit (Note [Physical limit of a step])."""

    fwd_s: float
    bwd_s: float
    opt_s: float
    comm_s: float

    @property
    def limit_s(self) -> float:
        return self.fwd_s + max(self.bwd_s, self.comm_s) + self.opt_s

    def columns(self) -> dict:
        return {"limit_ms": self.limit_s * 1e3, "limit_fwd_ms": self.fwd_s * 1e3, "limit_bwd_ms": self.bwd_s * 1e3,
                "limit_opt_ms": self.opt_s * 1e3, "limit_comm_ms": self.comm_s * 1e3,
                "link_bound": self.comm_s > self.bwd_s}


def limit_parts(rows: Sequence[dict], comm_s: float) -> LimitParts:
    """The limit of the rows' job: the fastest forward, backward and optimizer step of any
    row (their ``fwd_ms``, ``bwd_ms``, ``opt_ms`` medians) and the measured ``comm_s``."""
    if not rows:
        raise ValueError("limit_parts needs the rows of at least one mode: the limit takes their fastest compute.")
    return LimitParts(fwd_s=min(r["fwd_ms"] for r in rows) / 1e3, bwd_s=min(r["bwd_ms"] for r in rows) / 1e3,
                      opt_s=min(r["opt_ms"] for r in rows) / 1e3, comm_s=comm_s)


def _best_peer(rows: Sequence[dict], peers: Sequence[str]) -> dict | None:
    candidates = [r for r in rows if r["mode"] in peers and r.get("step_ms_rounds")]
    return min(candidates, key=lambda r: r["step_ms_median"]) if candidates else None


def add_limit_columns(rows: list[dict], comm_s: float, peers: Sequence[str] = PEER_MODES) -> LimitParts:
    """Give every row ``limit_ms`` (and its parts), ``step_over_limit``, ``best_peer`` and
    ``ratio_vs_best_peer`` with its IQR (None where no peer ran); returns the limit."""
    parts = limit_parts(rows, comm_s)
    best = _best_peer(rows, peers)
    for r in rows:
        r.update(parts.columns())
        r["step_over_limit"] = r["step_ms_median"] / (parts.limit_s * 1e3)
        r["best_peer"] = best.get("runner", best["mode"]) if best is not None else None
        ratio = ratio_summary(r["step_ms_rounds"], best["step_ms_rounds"]) if best is not None else (None,) * 3
        r["ratio_vs_best_peer"], r["ratio_vs_best_peer_q1"], r["ratio_vs_best_peer_q3"] = ratio
    return parts


def measure_comm(nbytes: int, device, transfer_s, repeats: int) -> float:
    """Median seconds (rank 0's clock) of ``repeats`` all-reduces of one flat float32 tensor of
    ``nbytes`` on the default group, each after a barrier; each time at least
    ``transfer_s(nbytes)`` (a simulated link's charge; ``lambda n: 0.0`` for a real link)."""
    import torch
    import torch.distributed as dist

    from .device import clock

    flat = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    times = []
    for _ in range(max(repeats, 1)):
        dist.barrier()
        t0 = clock(flat.device)
        dist.all_reduce(flat)
        times.append(max(clock(flat.device) - t0, transfer_s(nbytes)))
    return median(times)
