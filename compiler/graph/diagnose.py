"""Diagnostics: what the compiler did to a model, and what to change.

Note [Diagnosis]

Background
    Graph breaks and recompiles silently eat the gain of ``torch.compile``. Dynamo
    knows about both, but tells it in scattered log lines.

Algorithm
    - :class:`Diagnoser` wraps the backend. Dynamo hands every captured graph to
      it with ``gm.compile_subgraph_reason``: when the graph ended in a break, the
      reason and the user frame where it happened. That is a graph break, an
      *accidental* split. Splits made by a partitioner inside one graph (DDP
      bucket boundaries) are *intended* and are reported apart, from the
      partition records the caller passes in.
    - Recompiles come from dynamo's compilation metrics recorded while the
      diagnoser was active: the frame and the guard that failed.
    - :func:`advise` turns what was seen into short advice lines whose fixes
      are code or ``torch.compile`` changes (``mark_dynamic``, padding,
      ``fullgraph=True``). Advice that names a setting of this toolkit lives
      where the setting lives (``ddp_opt.advice`` for ``compile_ddp`` and DDP,
      ``launch.doctor`` for the launcher's overrides); callers hand it in as
      ``extra_advice``.

Notes
    - Nothing global is changed: the diagnoser only wraps the backend it is given
      and reads the metrics dynamo keeps anyway.
    - Dynamo's metrics and guard texts are read in ``compiler._torch_internals``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import fx

from .. import _torch_internals as _ti
from .._torch_internals import size_guard
from .backends import BackendFn
from .partition import PartitionRecord

__all__ = ["Diagnoser", "GraphBreak", "GraphInfo", "Recompile", "Report", "advise", "compile_seconds", "size_guard"]


@dataclass
class GraphBreak:
    """An accidental split: dynamo could not trace past ``file:line``."""

    reason: str
    file: str
    line: int
    code: str = ""


@dataclass
class Recompile:
    """A frame compiled again because a guard failed."""

    function: str
    file: str
    line: int
    guard: str
    input: str | None = None
    axis: int | None = None


@dataclass
class GraphInfo:
    index: int
    nodes: int
    ops: int
    compile_s: float
    input_shapes: list[list[Any]] = field(default_factory=list)


@dataclass
class Report:
    graphs: list[GraphInfo]
    breaks: list[GraphBreak]
    recompiles: list[Recompile]
    partitions: list[PartitionRecord]
    advice: list[str]
    recompile_limit: int
    alignment: float | None = None
    exposed_comm_ms: float | None = None
    compute_ms: float | None = None
    # The lowest and highest of the timing rounds compute_ms is the median of.
    compute_range_ms: list[float] | None = None
    # Said beside the timings (how busy the machine was).
    timing_notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)

    def format(self) -> str:
        """The terminal report: tables and short advice lines."""
        from tabulate import tabulate

        out = [f"graphs captured: {len(self.graphs)}; accidental graph breaks: {len(self.breaks)}; "
               f"recompiles: {len(self.recompiles)} (limit {self.recompile_limit} per frame)"]
        if self.breaks:
            out += ["", "graph breaks (accidental):", tabulate(
                [(f"{b.file}:{b.line}", b.code, _short(b.reason)) for b in self.breaks],
                headers=("where", "code", "reason"), tablefmt="simple")]
        if self.recompiles:
            out += ["", "recompilations:", tabulate(
                [(r.function, f"{r.file}:{r.line}", r.guard) for r in self.recompiles],
                headers=("function", "where", "failed guard"), tablefmt="simple")]
        if self.alignment is not None:
            out += [f"alignment of DDP's runtime buckets with the partitions: {self.alignment:.2f}"]
        if self.exposed_comm_ms is not None and self.compute_ms is not None:
            spread = (f"; median of rounds from {self.compute_range_ms[0]:.1f} to {self.compute_range_ms[1]:.1f} ms"
                      if self.compute_range_ms else "")
            out += [f"communication left exposed: {self.exposed_comm_ms:.1f} ms per step "
                    f"(forward+backward {self.compute_ms:.1f} ms without gradient sync{spread})"]
            out += [f"note: {n}" for n in self.timing_notes]
        if self.partitions:
            out += ["", "partitions (intended splits at DDP bucket boundaries):", tabulate(
                [(p.index, p.name, p.status, f"{p.compile_s:.2f}", _short(p.error or "")) for p in self.partitions],
                headers=("#", "partition", "status", "compile s", "error"), tablefmt="simple")]
        out += ["", "advice:"] + [f"  - {a}" for a in self.advice or ["nothing to change: one graph, no recompiles."]]
        return "\n".join(out)


def _short(text: str, n: int = 110) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first if len(first) <= n else first[: n - 3] + "..."


class Diagnoser:
    """Collects graphs, graph breaks and recompiles while it wraps a backend.

    Example::

        diag = Diagnoser()
        model = torch.compile(model, backend=diag.wrap(resolve_backend("aot_eager")))
        with diag:
            for batch in batches: model(batch)
        print(diag.report().format())
    """

    def __init__(self) -> None:
        self.graphs: list[GraphInfo] = []
        self.breaks: list[GraphBreak] = []
        self._metrics_mark: Any = None
        self._metrics: list[Any] = []

    def wrap(self, backend: BackendFn) -> BackendFn:
        def diagnosing_backend(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
            found = _ti.graph_break_frame(gm)
            if found is not None:
                reason, frame = found
                self.breaks.append(GraphBreak(reason, frame.filename, frame.lineno or 0, (frame.line or "").strip()))
            t0 = time.perf_counter()
            compiled = backend(gm, example_inputs, **kwargs)
            self.graphs.append(GraphInfo(
                index=len(self.graphs),
                nodes=len(gm.graph.nodes),
                ops=sum(n.op.startswith("call") for n in gm.graph.nodes),
                compile_s=time.perf_counter() - t0,
                input_shapes=[list(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)],
            ))
            return compiled

        diagnosing_backend.__name__ = f"diagnosed_{getattr(backend, '__name__', type(backend).__name__)}"
        return diagnosing_backend

    def __enter__(self) -> "Diagnoser":
        # Dynamo keeps its compilation metrics in a bounded deque (64 entries), so a
        # count taken now would point at the wrong entry once old ones are evicted:
        # remember the newest entry itself and take what follows it.
        metrics = _ti.compilation_metrics()
        self._metrics_mark = metrics[-1] if metrics else None
        return self

    def __exit__(self, *exc: Any) -> None:
        metrics = _ti.compilation_metrics()
        start = 0
        for i in range(len(metrics) - 1, -1, -1):
            if metrics[i] is self._metrics_mark:
                start = i + 1
                break
        self._metrics = metrics[start:]

    def recompiles(self) -> list[Recompile]:
        found = []
        for m in self._metrics:
            reason = getattr(m, "recompile_reason", None)
            if not reason:
                continue
            guard = _ti.failed_guard(reason)
            size = size_guard(guard)
            found.append(Recompile(
                function=m.co_name or "?", file=m.co_filename or "?", line=m.co_firstlineno or 0, guard=guard,
                input=size[0] if size else None, axis=size[1] if size else None,
            ))
        return found

    def report(self, partitions: list[PartitionRecord] | None = None, *, alignment: float | None = None,
               exposed_comm_ms: float | None = None, compute_ms: float | None = None,
               compute_range_ms: Sequence[float] | None = None, timing_notes: Sequence[str] = (),
               extra_advice: Sequence[str] = ()) -> Report:
        """Everything seen so far, with advice.

        Args:
            partitions: the partition records of a splitting backend (intended splits).
            alignment: the fraction of gradient bytes whose runtime bucket is one
                partition (``ddp_opt.measure_alignment``), if measured.
            exposed_comm_ms: a step with gradient sync minus the same without
                (DDP's ``no_sync``): communication that backward did not hide.
            compute_ms: forward+backward without gradient sync (a median of rounds).
            compute_range_ms: the lowest and highest round of ``compute_ms``.
            timing_notes: said beside the timings (how busy the machine was).
            extra_advice: advice lines from the caller that name its own settings
                (``ddp_opt.ddp_advice``), listed first.
        """
        recompiles = self.recompiles()
        partitions = list(partitions or [])
        limit = _ti.recompile_limit()
        advice = list(extra_advice) + advise(self.graphs, self.breaks, recompiles, partitions, limit)
        return Report(self.graphs, self.breaks, recompiles, partitions, advice, limit, alignment,
                      exposed_comm_ms, compute_ms, list(compute_range_ms) if compute_range_ms else None,
                      list(timing_notes))

    def compile_seconds(self, partitions: Sequence[PartitionRecord] = ()) -> float:
        """Compile time seen so far (see :func:`compile_seconds`)."""
        return compile_seconds(self.graphs, partitions)


def compile_seconds(graphs: Sequence[GraphInfo], partitions: Sequence[PartitionRecord] = ()) -> float:
    """Seconds spent compiling. A graph's compile time already includes its
    partitions' (the splitter runs inside the wrapped backend); partitions alone
    count only without graphs."""
    return sum(g.compile_s for g in graphs) if graphs else sum(p.compile_s for p in partitions)


def advise(
    graphs: list[GraphInfo],
    breaks: list[GraphBreak],
    recompiles: list[Recompile],
    partitions: list[PartitionRecord],
    recompile_limit: int,
) -> list[str]:
    """Advice lines tied to what was seen; each fix is a code or torch.compile change."""
    advice = []
    for b in breaks:
        advice.append(f"graph break at {b.file}:{b.line} ({b.code or _short(b.reason, 60)}): {_fix_for_break(b.reason)}")
    for r in recompiles:
        if r.input is not None:
            advice.append(
                f"{r.function} recompiled because axis {r.axis} of '{r.input}' changed: call "
                f"torch._dynamo.mark_dynamic(<{r.input}>, {r.axis}) on that input before the first call, or pad "
                "it to a few fixed sizes."
            )
        elif re.search(r"%\s*8|Mod\(.*8\)", r.guard):
            advice.append(f"{r.function}: a guard tests divisibility by 8 ({r.guard}); pad that size to a multiple of 8.")
        else:
            advice.append(f"{r.function} recompiled: guard '{_short(r.guard, 80)}' failed; keep that value stable.")
    per_frame: dict[tuple[str, str], int] = {}
    for r in recompiles:
        per_frame[(r.function, r.file)] = per_frame.get((r.function, r.file), 0) + 1
    for (fn, _), n in per_frame.items():
        if n + 1 >= recompile_limit // 2:
            advice.append(
                f"{fn} has compiled {n + 1} times of at most {recompile_limit} (torch._dynamo.config.recompile_limit): "
                "past it, the frame falls back to eager. Make the changing input dynamic."
            )
    for p in partitions:
        if p.status == "eager":
            advice.append(f"partition {p.index} ({p.name}) runs eagerly because its compile failed: {_short(p.error or '', 90)}")
    if graphs and not breaks:
        advice.append("no graph breaks: pass fullgraph=True so that a future break fails loudly instead of slowing you down.")
    return advice


def _fix_for_break(reason: str) -> str:
    low = reason.lower()
    if "print" in low or "logging" in low:
        return "remove the print, or guard it with `if not torch.compiler.is_compiling():`."
    if "data-dependent" in low or "data dependent" in low or "generic_jump" in low or "tensor.item" in low:
        return "replace the Python branch on a tensor value with torch.where or torch.cond."
    return "see the reason; TORCH_LOGS=graph_breaks shows the full trace."
