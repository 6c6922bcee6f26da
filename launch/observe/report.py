"""What the training loop measures, and the lines and metrics it ends with.

:class:`Tally` collects each step's loss, time and tokens (summed over ranks);
:meth:`Tally.summary` turns it into the compile and token accounting of
``metrics.json``; :func:`summary_lines` are the lines rank 0 prints at the end.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..runtime.dist import print0
from ..runtime.guard import NonFinite
from ..runtime.preempt import Preempted
from ..runtime.recompiles import CompileCounts
from .load import MachineLoad, spread_line

__all__ = ["Tally", "curve_name", "summary_lines", "format_shapes", "step_line", "write_json"]


@dataclass
class Tally:
    """One run's measurements. Token counts are summed over ranks; ``timed_*``
    leave out the first step, which pays for compiles.

    Every field that is a list of ``(step, number)`` pairs is a per-step curve
    (:meth:`curves`): TensorBoard and the curves picture (``launch.observe.tensorboard``)
    show each of them, whatever it is, under :func:`curve_name` of the field."""

    losses: list[tuple[int, float]] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # the steps after the first
    first_step_s: float | None = None
    checkpoints: list[str] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # steps whose update was skipped (non-finite loss)
    shapes_seen: dict[tuple[int, ...], int] = field(default_factory=dict)
    real_tokens: float = 0.0
    padded_tokens: float = 0.0
    timed_real_tokens: float = 0.0
    timed_padded_tokens: float = 0.0
    warmup_s: float | None = None
    warmup_counts: CompileCounts | None = None
    step_s: list[tuple[int, float]] = field(default_factory=list)  # every step's seconds, the first included
    tokens_per_s: list[tuple[int, float]] = field(default_factory=list)  # every step's tokens/s (with padding)
    lrs: list[tuple[int, float]] = field(default_factory=list)  # each step's lr (launch.step.schedule)
    grad_norms: list[tuple[int, float]] = field(default_factory=list)  # before clipping (train.max_grad_norm)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # held-out (train.eval_every)
    compile_stats: dict | None = None  # launch.runtime.compile_stats, after the first step

    def add_shape(self, shape: tuple[int, ...]) -> None:
        self.shapes_seen[shape] = self.shapes_seen.get(shape, 0) + 1

    def add_step(self, step: int, loss: float, real_tokens: float, padded_tokens: float, seconds: float,
                 first: bool) -> None:
        self.losses.append((step, loss))
        self.step_s.append((step, seconds))
        self.tokens_per_s.append((step, padded_tokens / seconds if seconds > 0 else 0.0))
        self.real_tokens += real_tokens
        self.padded_tokens += padded_tokens
        if first:
            self.first_step_s = seconds
        else:
            self.step_ms.append(seconds * 1e3)
            self.timed_real_tokens += real_tokens
            self.timed_padded_tokens += padded_tokens

    def eta_s(self, step: int, steps: int) -> float | None:
        """The time the steps after ``step`` will take at the median timed step so far; None
        before a step is timed (the first pays for compiles) and after the last."""
        if not self.step_ms or step >= steps:
            return None
        return statistics.median(self.step_ms) / 1e3 * (steps - step)

    def curves(self) -> dict[str, list[tuple[int, float]]]:
        """The per-step curves by :func:`curve_name`: every field holding ``(step, number)`` pairs."""
        out = {}
        for name, value in vars(self).items():
            if isinstance(value, list) and value and _is_point(value[0]) and _is_point(value[-1]):
                out[curve_name(name)] = value
        return out

    def curves_at(self, step: int) -> dict[str, float]:
        """Each curve's value at ``step``, for the curves that have one (the latest point)."""
        return {name: float(points[-1][1]) for name, points in self.curves().items() if points[-1][0] == step}

    def add_curves(self, step: int, lr: float, grad_norm: float | None, eval_loss: float | None) -> None:
        self.lrs.append((step, lr))
        if grad_norm is not None:
            self.grad_norms.append((step, grad_norm))
        if eval_loss is not None:
            self.eval_losses.append((step, eval_loss))

    @property
    def median_step_ms(self) -> float:
        """The median step after the first; the first step's time when there is no other."""
        return statistics.median(self.step_ms) if self.step_ms else (self.first_step_s or 0.0) * 1e3

    def summary(self, end: CompileCounts | None) -> dict[str, Any]:
        """The run's compile and token accounting for metrics.json and the summary lines.

        ``graphs``/``recompiles`` count the whole run (warm-up included) and are None
        when nothing was counted (eager, or fsdp); token rates are over the timed
        steps (all steps when there was only one)."""
        warmup = self.warmup_counts
        timed_s = sum(self.step_ms) / 1e3 if self.step_ms else (self.first_step_s or 0.0)
        real, padded = self.real_tokens, self.padded_tokens
        timed_real, timed_padded = ((self.timed_real_tokens, self.timed_padded_tokens) if self.step_ms
                                    else (real, padded))
        return {
            "warmup_s": self.warmup_s,
            "warmup_graphs": warmup.graphs if warmup is not None else None,
            "graphs": end.graphs if end is not None else None,
            "recompiles": end.recompiles if end is not None else None,
            "recompiles_after_warmup": (end.recompiles - warmup.recompiles
                                        if end is not None and warmup is not None else None),
            "shapes_seen": [[list(s), n] for s, n in sorted(self.shapes_seen.items())],
            "real_tokens": real,
            "padded_tokens": padded,
            "padding_waste": 1.0 - real / padded if padded else 0.0,
            "tokens_per_s": timed_padded / timed_s if timed_s else None,
            "real_tokens_per_s": timed_real / timed_s if timed_s else None,
            "lrs": self.lrs,
            "grad_norms": self.grad_norms,
            "eval_losses": self.eval_losses,
        }


def curve_name(field_name: str) -> str:
    """A curve's name from its Tally field: plurals made singular (``losses`` -> ``loss``,
    ``lrs`` -> ``lr``), names ending in a unit (``step_s``, ``tokens_per_s``) kept."""
    if field_name.endswith("_s"):
        return field_name
    if field_name.endswith("sses"):
        return field_name[:-2]
    return field_name[:-1] if field_name.endswith("s") else field_name


def _is_point(p: object) -> bool:
    return (isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], int)
            and isinstance(p[1], (int, float)) and not isinstance(p[1], bool))


def step_line(step: int, steps: int, loss: float, seconds: float, padded_tokens: float, lr: float | None = None,
              grad_norm: float | None = None, eval_loss: float | None = None, eta_s: float | None = None) -> str:
    """The line rank 0 prints after a step: the lr when it varies (a schedule; a constant lr is
    in the banner), the gradient norm with train.max_grad_norm, the held-out loss after an
    evaluation, and the time left once steps are timed (``Tally.eta_s``)."""
    return (f"step {step:>5}/{steps}  loss {loss:.4f}  step {seconds * 1e3:8.1f} ms  "
            f"tokens/s {padded_tokens / seconds:10,.0f}"
            + (f"  lr {lr:.3e}" if lr is not None else "")
            + (f"  grad_norm {grad_norm:.4f}" if grad_norm is not None else "")
            + (f"  eval_loss {eval_loss:.4f}" if eval_loss is not None else "")
            + (f"  eta {format_duration(eta_s)}" if eta_s is not None else ""))


def format_duration(seconds: float) -> str:
    """``<0.1s``, ``0.4s``, ``42s``, ``3m05s``, ``2h07m``: tenths under ten seconds."""
    if seconds < 0.05:
        return "<0.1s"
    if seconds < 9.95:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_shapes(shapes_seen: dict[tuple[int, ...], int], most: int = 8) -> str:
    items = sorted(shapes_seen.items())
    text = ", ".join(f"{tuple(s)} x{n}" for s, n in items[:most])
    return text + (f", ... ({len(items)} shapes)" if len(items) > most else "")


def summary_lines(metrics: dict[str, Any], tally: Tally, load: MachineLoad | None = None) -> list[str]:
    """The compile, token and final lines rank 0 prints at the end of the run, and a line
    when the step times varied widely (with the machine's ``load``, read now by default)."""
    shapes_seen = tally.shapes_seen
    lines = []
    if metrics["graphs"] is not None:
        after = metrics["recompiles_after_warmup"]
        lines.append(f"compile: {metrics['graphs']} graph(s), {metrics['recompiles']} recompile(s)"
                     + (f" ({after} after warm-up)" if after is not None else "")
                     + f"; shapes seen: {format_shapes(shapes_seen)}")
    lines.append(f"tokens: {metrics['real_tokens_per_s'] or 0:,.0f} real tokens/s, {metrics['tokens_per_s'] or 0:,.0f} "
                 f"tokens/s with padding (padding waste {100 * metrics['padding_waste']:.1f}%)")
    recompiles = metrics["recompiles"] if metrics["recompiles"] is not None else "n/a"
    lines.append(
        f"{_progress(metrics)}, "
        f"median step {metrics['median_step_ms']:.1f} ms, {metrics['real_tokens_per_s'] or 0:,.0f} real tokens/s, "
        f"recompiles {recompiles}, first step {metrics['first_step_s'] or 0:.1f}s, wall {metrics['wall_s']:.1f}s"
    )
    spread = spread_line(tally.step_ms, "step times (after the first)", load)
    return lines + ([spread] if spread else [])


def stop_record(stopped: BaseException | None) -> dict[str, Any] | None:
    """Where and why the run stopped early (``launch.runtime.preempt.Preempted`` or
    ``launch.runtime.guard.NonFinite``), for the summary and metrics.json: ``after``, the step
    the run stopped after (every rank finished it), or ``at``, the step it stopped in."""
    if isinstance(stopped, Preempted):
        return {"after": stopped.step, "why": "SIGTERM/SIGINT (preemption)"}
    if isinstance(stopped, NonFinite):
        return {"at": stopped.step, "why": stopped.what or str(stopped)}
    return None


def _progress(metrics: dict[str, Any]) -> str:
    """The summary's first words: the steps run and the final loss, or where the run stopped,
    why, and the last loss that was finite (metrics["stopped_at"], :func:`stop_record`)."""
    first, last = metrics["start_step"] + 1, metrics["steps"]
    stop = metrics.get("stopped_at")
    if not stop:
        return f"done: steps {first}..{last}, final loss {metrics['final_loss']:.4f}"
    if "after" in stop:
        return (f"stopped after step {stop['after']} of {first}..{last}: {stop['why']}; final loss "
                f"{metrics['final_loss']:.4f}")
    finite = [(s, v) for s, v in metrics.get("losses") or [] if s < stop["at"] and math.isfinite(v)]
    loss = f"last finite loss {finite[-1][1]:.4f} at step {finite[-1][0]}" if finite else "no finite loss before it"
    return f"stopped at step {stop['at']} of {first}..{last}: {stop['why']}; {loss}"


def write_json(path: str, data: Any, what: str) -> None:
    """Write ``data`` to ``path`` as strict JSON and say so (rank 0's files of the run
    directory). A non-finite number (a NaN loss) is written as null, and a dict gets a
    ``nonfinite`` list of where (``losses.3.1``): a bare NaN is not JSON."""
    found: list[str] = []
    data = _strict(data, "", found)
    if found and isinstance(data, dict):
        data["nonfinite"] = found
    with open(path, "w") as f:
        json.dump(data, f, indent=1, allow_nan=False)
    print0(f"{what}: {path}")


def _strict(value: Any, where: str, found: list[str]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        found.append(where or "(top)")
        return None
    if isinstance(value, dict):
        return {k: _strict(v, f"{where}.{k}" if where else str(k), found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v, f"{where}.{i}" if where else str(i), found) for i, v in enumerate(value)]
    return value


def write_metrics(output_dir: str, metrics: dict[str, Any], stopped: str | None = None) -> None:
    """Rank 0's ``metrics.json``, also for a run stopped on purpose (``stopped``: why: preempted,
    non-finite), with its ``attempt`` (torchrun's restart count). A ``metrics.json`` already in
    the run directory from an earlier attempt of the same torchrun run goes into
    ``earlier_attempts``, so the file covers every attempt's steps."""
    path = os.path.join(output_dir, "metrics.json")
    metrics = {**metrics, "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0), "stopped": stopped}
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    try:
        with open(path) as f:
            before = json.load(f)
    except (OSError, ValueError):
        before = None
    if isinstance(before, dict) and run_id is not None and before.get("run_id") == run_id \
            and before.get("attempt", 0) < metrics["attempt"]:
        earlier = before.pop("earlier_attempts", [])
        metrics["earlier_attempts"] = [*earlier, before]
    metrics["run_id"] = run_id
    write_json(path, metrics, "metrics")
