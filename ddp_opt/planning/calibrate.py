"""Calibrating the cost model's prediction from a measured backward, and the plan
the calibrated model would choose.

Note [Calibration from a measured backward]

Background
    The cost model predicts exposed communication from a fitted link and a backward
    estimated from FLOP counts and device rates timed once (Note [Cost measurement]).
    The link side holds up; two things do not: the backward is off by a factor that
    changes from run to run (the rates are timed once, while another rank may share the
    cores), and the collective takes CPU from backward while it runs, so a synchronised
    backward is longer than a ``no_sync`` one even where the link keeps up (measured:
    docs/benchmarks/reading.md).

Algorithm
    - Input: the running plan's ``Timeline``, a backward measured after warm-up without
      communication (a ``no_sync`` step) and, optionally, the measured exposed
      communication of the same plan.
    - Scale: ``s = (measured - (n - 1) * gamma) / sum(unit backward)``; every unit is
      multiplied by ``s``: the FLOP count keeps the shape of backward, the measurement
      its length.
    - Contention ``kappa``: the least value under which the scaled plan predicts the
      measured exposed communication, by bisection (monotone in ``kappa``); 0 when the
      plan predicts that much without it, has one bucket, or is link-bound (there the
      fit would take noise for contention).
    - The same plan simulated on the scaled table gives the calibrated prediction;
      ``solve_table`` under the plan's own rules gives the plan it would choose.

Notes
    - ``calibrated_model`` divides the rates by ``s`` and sets ``kappa``:
      ``compile_ddp(link=that model)`` in the next run plans ``best``. The running plan
      is not changed in place: its partitions or fused backward would recompile.
    - A prediction covers one captured graph; ``CompiledDDP.calibrate`` refuses a
      backward measured over several.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .solver import NO_HOOK_COMPUTE, HookCompute, LinkEstimate, Timeline, UnitCost, simulate
from .cost import CostModel
from .auto import solve_table

__all__ = ["Calibration", "calibrate", "calibrated_model", "fit_contention"]


@dataclass(frozen=True)
class Calibration:
    """A prediction calibrated to a measured backward.

    Attributes:
        scale: measured over predicted backward (graph-break costs left out).
        measured_backward_s: the measured backward it was scaled to.
        current: the running plan's timeline, backward scaled.
        best: the plan the calibrated model chooses, and its timeline.
        cost_model: from ``CompiledDDP.calibrate``, the calibrated cost model
            (``calibrated_model``): ``compile_ddp(link=cost_model)`` plans ``best``.
    """

    scale: float
    measured_backward_s: float
    current: Timeline
    best: Timeline
    cost_model: CostModel | None = None

    @property
    def changes_plan(self) -> bool:
        return self.best.counts != self.current.counts

    @property
    def gain_s(self) -> float:
        """Predicted seconds the calibrated plan saves over the running one (0 when the same)."""
        return self.current.finish_s - self.best.finish_s

    def as_dict(self) -> dict:
        return {"backward_scale": self.scale, "measured_backward_ms": self.measured_backward_s * 1e3,
                "contention_ms_per_mib": self.current.contention_s_per_byte * 2**20 * 1e3,
                "calibrated_predicted_exposed_comm_ms": self.current.exposed_s * 1e3,
                "calibrated_plan_changes": self.changes_plan, "calibrated_plan_gain_ms": self.gain_s * 1e3,
                "calibrated_plan_mib": [round(b.nbytes / 2**20, 3) for b in self.best.buckets]}


def calibrate(prediction: Timeline, measured_backward_s: float, measured_exposed_s: float | None = None,
              contention: float | None = None) -> Calibration:
    """Scale ``prediction``'s backward to ``measured_backward_s``; with ``measured_exposed_s``
    fit the contention to it (else keep ``contention``, by default the prediction's); then
    re-predict and re-plan (Note [Calibration from a measured backward])."""
    if not prediction.units:
        raise ValueError("calibrate needs a prediction made by simulate (it keeps the unit table); "
                         "this Timeline has none.")
    if not measured_backward_s > 0:
        raise ValueError(f"calibrate: the measured backward must be > 0 seconds, got {measured_backward_s!r}. "
                         "Measure it after warm-up as forward+backward minus forward of a no_sync step.")
    breaks = (len(prediction.buckets) - 1) * prediction.gamma_s
    estimated = sum(u.backward_s for u in prediction.units)
    scale = max(measured_backward_s - breaks, 1e-9) / max(estimated, 1e-12)
    table = [UnitCost(u.backward_s * scale, u.nbytes) for u in prediction.units]
    if measured_exposed_s is not None:
        contention = fit_contention(table, prediction.counts, prediction.link, prediction.gamma_s, measured_exposed_s,
                                    prediction.hook)
    elif contention is None:
        contention = prediction.contention_s_per_byte
    current = simulate(table, prediction.counts, prediction.link, prediction.gamma_s, contention, prediction.hook)
    best = solve_table(table, prediction.link, prediction.gamma_s, prediction.extra.get("min_bucket_bytes", 0),
                       contention, prediction.hook)
    return Calibration(scale, measured_backward_s, current, best)


def fit_contention(table: list[UnitCost], counts: tuple[int, ...], link: LinkEstimate, gamma_s: float,
                   measured_exposed_s: float, hook: HookCompute = NO_HOOK_COMPUTE) -> float:
    """The contention (seconds per byte) under which the plan ``counts`` predicts
    ``measured_exposed_s``; 0 when the plan predicts that much without any, has one
    bucket (nothing in flight during backward to fit it on), or keeps the link busy
    from its first bucket on (link-bound: the link never waits for backward, so only a
    contention that outruns the link would show, and noise would be fitted as one)."""
    def exposed(kappa: float) -> float:
        return simulate(table, counts, link, gamma_s, kappa, hook).exposed_s

    free = simulate(table, counts, link, gamma_s, hook=hook)
    waits = any(b.ready_s > prev.finish_s for prev, b in zip(free.buckets, free.buckets[1:]))  # the link idles
    if len(counts) < 2 or not waits or free.exposed_s >= measured_exposed_s:
        return 0.0
    lo, hi = 0.0, 1e-10
    while exposed(hi) < measured_exposed_s:  # the last bucket's ready time grows linearly in kappa
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exposed(mid) < measured_exposed_s else (lo, mid)
    return hi


def calibrated_model(model: CostModel, calibration: Calibration) -> CostModel:
    """``model`` with the device rates scaled so that every backward estimate is
    ``calibration.scale`` times its own, and the fitted contention: ``compile_ddp(link=...)`` with it plans
    ``calibration.best`` (Note [Calibration from a measured backward])."""
    s = calibration.scale
    rates = replace(model.rates, flops=model.rates.flops / s, bytes=model.rates.bytes / s, op_s=model.rates.op_s * s)
    return replace(model, rates=rates, contention_s_per_byte=calibration.current.contention_s_per_byte)
