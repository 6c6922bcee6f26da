"""A picture of overlap: one profiled step of a Chrome trace (``launch.observe.profile``) as
a timeline, each backward partition and each gradient all-reduce on its own row.

Note [Overlap timeline]

What is read
    From the trace rank 0 wrote, the events inside the ``record_function("step N")``
    range of the step drawn:
    - ``partition i forward`` / ``partition i backward``: the compiled partitions
      (Note [Partition labels] in ``compiler.graph.partition``). Without them (compile=eager,
      parallel=fsdp) the autograd engine's ``autograd::engine::evaluate_function:``
      events make one ``backward`` row.
    - the collectives: the process group's own events, ``gloo:all_reduce`` on gloo's
      worker threads (``nccl:all_reduce`` on NCCL), that start between the start of
      backward and the optimizer step (``Optimizer.step#...``): DDP's bucket
      all-reduces, in the order they were issued. The job's own all-reduce of the
      step's loss and token counts comes after the optimizer step and is left out.
    - ``Optimizer.step#...``.

Exposed communication
    Communication that continues after the last backward compute ends: from the end
    of the last backward event to the end of the last all-reduce, or to DDP's first
    ``copy_bucket_to_grad`` after backward when that comes earlier (DDP copies the
    reduced buckets back only once every all-reduce is done, so by then the
    communication is over; a collective's span on gloo's worker thread can end later
    when that thread waits for a core).

Notes
    - The trace is rank 0's. On CUDA the rows show when the CPU ran the partitions,
      not the GPU kernels; the NCCL events are the CPU-side ones.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TIMELINE_PNG", "StepTimeline", "read_step", "split_at", "write_timeline"]

TIMELINE_PNG = "timeline.png"

_PARTITION = re.compile(r"^partition (\d+) (forward|backward)$")
_COLLECTIVE = re.compile(r"^(gloo|nccl):(\w+)$")


@dataclass
class StepTimeline:
    """One step's spans in ms from the step's start: ``rows`` is (row name, [(start, end)]),
    top to bottom; ``kinds`` says what each row is (forward, backward, comm, optimizer)."""

    step: int
    step_ms: float
    rows: list[tuple[str, list[tuple[float, float]]]] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    backward_end_ms: float | None = None
    comm_end_ms: float | None = None  # when the communication is over (Exposed communication)

    @property
    def exposed_comm_ms(self) -> float | None:
        if self.backward_end_ms is None or self.comm_end_ms is None:
            return None
        return max(0.0, self.comm_end_ms - self.backward_end_ms)

    def add(self, name: str, kind: str, spans: list[tuple[float, float]]) -> None:
        self.rows.append((name, spans))
        self.kinds.append(kind)


def read_step(trace: dict[str, Any], step: int, buckets: list[dict[str, Any]] = ()) -> StepTimeline:
    """The timeline of profiled ``step`` in a Chrome ``trace`` (Note [Overlap timeline]).

    Args:
        trace: the trace JSON, as loaded.
        step: the step to draw (one of those profiled).
        buckets: the metrics' DDP buckets, in forward order, to name the all-reduces by size.
    """
    from .profile import step_label

    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    whole = [e for e in events if e["name"] == step_label(step)]
    if not whole:
        raise ValueError(f"the trace has no {step_label(step)!r} range: step {step} was not profiled")
    t0, t1 = whole[0]["ts"], whole[0]["ts"] + whole[0]["dur"]
    inside = sorted((e for e in events if t0 <= e["ts"] <= t1), key=lambda e: e["ts"])

    def ms(e: dict[str, Any]) -> tuple[float, float]:
        return (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3

    tl = StepTimeline(step, (t1 - t0) / 1e3)
    forward = [ms(e) for e in inside if (m := _PARTITION.match(e["name"])) and m[2] == "forward"]
    backward = {}
    for e in inside:
        m = _PARTITION.match(e["name"])
        if m and m[2] == "backward":
            backward.setdefault(int(m[1]), []).append(ms(e))
    if not backward:  # no labelled partitions: the autograd engine's work as one row
        spans = [ms(e) for e in inside if e["name"].startswith("autograd::engine::evaluate_function:")]
        if spans:
            backward = {-1: spans}
    opt = [ms(e) for e in inside if e["name"].startswith("Optimizer.step")]
    bwd_start = min((s for spans in backward.values() for s, _ in spans), default=0.0)
    opt_start = min((s for s, _ in opt), default=tl.step_ms)
    comm = [(m[2], ms(e)) for e in inside if (m := _COLLECTIVE.match(e["name"])) and bwd_start <= ms(e)[0] < opt_start]

    if forward:
        tl.add("forward (partitions)", "forward", forward)
    for index in sorted(backward, key=lambda i: min(s for s, _ in backward[i])):  # in the order they ran
        tl.add(f"partition {index} backward" if index >= 0 else "backward", "backward", backward[index])
    names = _comm_names(comm, buckets)
    for name, (_, span) in zip(names, comm):
        tl.add(name, "comm", [span])
    if opt:
        tl.add("optimizer step", "optimizer", opt)

    if backward and comm:
        tl.backward_end_ms = max(e for spans in backward.values() for _, e in spans)
        comm_end = max(e for _, (_, e) in comm)
        copies = [ms(e)[0] for e in inside if "copy_bucket_to_grad" in e["name"] and ms(e)[0] >= tl.backward_end_ms]
        tl.comm_end_ms = min([comm_end] + copies[:1])
    return tl


def _comm_names(comm: list[tuple[str, tuple[float, float]]], buckets: list[dict[str, Any]]) -> list[str]:
    """Row names of the collectives. DDP all-reduces its buckets in gradient-ready order,
    the reverse of forward order: with one all-reduce per bucket, each is named by its bucket."""
    if len(comm) == len(buckets) and all(kind == "all_reduce" for kind, _ in comm):
        n = len(buckets)
        return [f"all-reduce bucket {n - 1 - k} ({buckets[n - 1 - k]['size'] / 2**20:.2f} MiB)" for k in range(n)]
    return [f"{kind.replace('_', '-')} #{k}" for k, (kind, _) in enumerate(comm)]


def split_at(spans: list[tuple[float, float]], t: float) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """``spans`` cut at ``t``: the parts before it and the parts after it. An all-reduce's bar
    is drawn solid up to the end of the communication (Exposed communication) and hatched
    after it, so the picture's bars and its exposed time agree."""
    before = [(s, min(e, t)) for s, e in spans if s < t]
    after = [(max(s, t), e) for s, e in spans if e > t]
    return before, after


def draw(tl: StepTimeline, path: str) -> str | None:
    """Draw ``tl`` into ``path`` (PNG); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    colors = {"forward": "#9bb8d9", "backward": "#2f6db5", "comm": "#e08a1e", "optimizer": "#7a7a7a"}
    n = len(tl.rows)
    fig, ax = plt.subplots(figsize=(10, 0.45 * n + 2.2))
    over = tl.comm_end_ms  # a collective's span past it is its thread's, not a wait (Exposed communication)
    for i, ((name, spans), kind) in enumerate(zip(tl.rows, tl.kinds)):
        y = (n - 1 - i - 0.35, 0.7)
        if kind == "comm" and over is not None:
            solid, tails = split_at(spans, over)
            ax.broken_barh([(s, max(e - s, 1e-3)) for s, e in solid], y, color=colors[kind])
            ax.broken_barh([(s, e - s) for s, e in tails], y, facecolor="none", edgecolor=colors[kind], hatch="///",
                           linewidth=0.5)
        else:
            ax.broken_barh([(s, max(e - s, 1e-3)) for s, e in spans], y, color=colors[kind])
    ax.set_yticks(range(n))
    ax.set_yticklabels([name for name, _ in reversed(tl.rows)])
    ax.set_xlim(0, tl.step_ms)
    ax.set_xlabel(f"ms from the start of step {tl.step} (rank 0)")
    legend = [Patch(color=colors[k], label=label) for k, label in (
        ("forward", "forward"), ("backward", "backward compute"), ("comm", "all-reduce"), ("optimizer", "optimizer"))
        if k in tl.kinds]
    title = f"step {tl.step}: {tl.step_ms:.1f} ms"
    if tl.exposed_comm_ms is not None:
        ax.axvline(tl.backward_end_ms, color="black", linestyle="--", linewidth=1)
        ax.axvspan(tl.backward_end_ms, max(tl.comm_end_ms, tl.backward_end_ms), color="#d62728", alpha=0.18)
        title += f"; exposed communication {tl.exposed_comm_ms:.1f} ms (shaded)"
        legend += [Line2D([], [], color="black", linestyle="--", label="last backward compute ends"),
                   Patch(color="#d62728", alpha=0.18, label="exposed: waiting for all-reduces after it, until DDP "
                                                            "copies the reduced gradients back"),
                   Patch(facecolor="none", edgecolor=colors["comm"], hatch="///",
                         label="all-reduce thread's span after its result was in use (no wait)")]
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.6 / (0.45 * n + 0.5)), ncol=2, fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_timeline(trace_path: str, step: int, buckets: list[dict[str, Any]]) -> dict[str, Any]:
    """Read ``step`` from the trace, draw ``timeline.png`` next to it; returns what goes into
    ``metrics["profile"]``: the picture's path (None without matplotlib), the step's time,
    the exposed communication and the rows drawn."""
    from ..runtime.dist import print0

    with open(trace_path) as f:
        tl = read_step(json.load(f), step, buckets)
    png = draw(tl, os.path.join(os.path.dirname(trace_path), TIMELINE_PNG))
    if png is None:
        print0(f"warning: {TIMELINE_PNG} skipped: matplotlib does not import. Install it with "
               "`pip install -e .[bench]`; the trace is written either way.")
    exposed = tl.exposed_comm_ms
    print0(f"timeline: {png or '(not drawn)'}: step {step}, {len(tl.rows)} rows"
           + (f", exposed communication {exposed:.1f} ms" if exposed is not None else ""))
    return {"timeline": png, "step": step, "step_ms": tl.step_ms, "exposed_comm_ms": exposed,
            "rows": [name for name, _ in tl.rows]}
