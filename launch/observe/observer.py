"""What the loop shows of itself besides its log lines: TensorBoard (``log.*``,
``launch.observe.tensorboard``), the profiler (``profile.*``, ``launch.observe.profile``)
and, on rank 0, a line at least every 10 s while the first step compiles
(``compiler.graph.progress``).

The loop calls :meth:`Observer.before_step` and :meth:`Observer.after_step` around
each step; :meth:`Observer.finish` adds what was found to the metrics at the end;
leaving the ``with`` block closes the writer and stops a profiler still running
when the loop ended early (a non-finite loss, a preemption).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from compiler.graph import ProgressTicker, compiling

from ..config.schema import JobConfig
from ..runtime.dist import DistEnv, print0
from .profile import StepProfiler
from .report import Tally
from .tensorboard import RunLog
from .timeline import write_timeline

__all__ = ["COMPILE_PROGRESS_EVERY_S", "Observer"]

COMPILE_PROGRESS_EVERY_S = 10.0  # the longest silence while the first step compiles


class Observer:
    """TensorBoard and profiling for one run; inert when neither is asked for.

    Args:
        cfg: the job config.
        env: this rank's process group (rank 0 writes).
        output_dir: the run directory; None: the current directory.
    """

    def __init__(self, cfg: JobConfig, env: DistEnv, output_dir: str | None) -> None:
        folder = output_dir or os.getcwd()
        self.log = RunLog(folder) if cfg.log.tensorboard and env.is_main else None
        steps = cfg.profile.steps
        self.profiler = StepProfiler(steps[0], steps[1], folder, env.is_main) if steps else None
        self.ticker = ProgressTicker(print0, every_s=COMPILE_PROGRESS_EVERY_S) if env.is_main else None
        self._first = contextlib.ExitStack()  # the first step's compile mark, until it ends
        self._stepped = False

    @classmethod
    def inert(cls) -> Observer:
        """An observer that does nothing (a Job built outside :func:`launch.train.train`)."""
        self = cls.__new__(cls)
        self.log, self.profiler, self.ticker = None, None, None
        self._first, self._stepped = contextlib.ExitStack(), False
        return self

    def __enter__(self) -> Observer:
        if self.ticker is not None:
            self.ticker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._first.close()
        if self.ticker is not None:
            self.ticker.__exit__(*exc)
        if self.profiler is not None:
            self.profiler.close()
        if self.log is not None:
            self.log.close()

    def before_step(self, step: int) -> None:
        if not self._stepped:  # its graphs compile as it runs (the forward's, then the backward's)
            self._first.enter_context(compiling(f"step {step}, the first"))
        if self.profiler is not None:
            self.profiler.before_step(step)

    def after_step(self, tally: Tally, step: int) -> None:
        self._stepped = True
        self._first.close()
        if self.profiler is not None:
            self.profiler.after_step(step)
        if self.log is not None:
            self.log.step(tally, step)

    def finish(self, tally: Tally, metrics: dict[str, Any]) -> dict[str, Any]:
        """Draw the timeline, add ``metrics["profile"]``, write the summary scalars; returns ``metrics``."""
        p = self.profiler
        if p is not None:
            metrics["profile"] = {"steps": p.profiled, "trace": p.path}
            if p.path is not None:
                metrics["profile"].update(write_timeline(p.path, p.profiled[-1], metrics.get("buckets") or []))
            elif not p.profiled:
                print0(f"profile: no step of profile.steps=[{p.first},{p.last}] ran (resumed after them)")
        if metrics.get("diagnosis") is not None:  # the doctor's report links the pictures
            _link_in_diagnosis(metrics)
        if self.log is not None:
            self.log.finish(tally, metrics)
        return metrics


def _link_in_diagnosis(metrics: dict[str, Any]) -> None:
    """``diagnosis["profile"]``: the trace and the timeline, or how to get them."""
    p = metrics.get("profile") or {}
    if p.get("trace"):
        metrics["diagnosis"]["profile"] = {k: p.get(k) for k in ("trace", "timeline", "step", "exposed_comm_ms")}
        exposed = p.get("exposed_comm_ms")
        print0(f"overlap picture (rank 0, step {p.get('step')}): trace {p['trace']} (https://ui.perfetto.dev), "
               f"timeline {p.get('timeline') or '(not drawn: no matplotlib)'}"
               + (f"; exposed communication {exposed:.1f} ms" if exposed is not None else ""))
    else:
        metrics["diagnosis"]["profile"] = None
        print0("overlap picture: add profile.steps=[FIRST,LAST] (e.g. the last two steps) for a Chrome trace and a "
               "timeline of each partition's backward and each bucket's all-reduce")
