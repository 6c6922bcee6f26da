"""``profile.steps=[a,b]``: steps a..b under torch.profiler, a Chrome trace of them
and a timeline picture of the last one (``launch.observe.timeline``).

Every rank profiles (so that each pays the same overhead and the ranks stay in
step); rank 0 writes ``trace.json`` into the run directory, which Perfetto
(https://ui.perfetto.dev) and ``chrome://tracing`` open. Each profiled step is
one ``record_function("step N")`` range; the compiled partitions label their
forward and backward (Note [Partition labels] in ``compiler.graph.partition``); the
gradient all-reduces are the profiler's own events of the collectives.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..config.schema import ConfigError, JobConfig
from ..runtime.dist import print0

log = logging.getLogger(__name__)

__all__ = ["TRACE_FILE", "StepProfiler", "check_profile", "step_label"]

TRACE_FILE = "trace.json"


def step_label(step: int) -> str:
    """The ``record_function`` name around profiled step ``step``."""
    return f"step {step}"


def check_profile(cfg: JobConfig) -> None:
    """``profile.steps``: null, or ``[first, last]`` with 1 <= first <= last <= train.steps."""
    steps, total = cfg.profile.steps, cfg.train.steps
    if steps is None:
        return
    fix = (f"Give an inclusive range of steps, e.g. profile.steps=[{min(2, total)},{min(3, total)}] (a step or two "
           "after the first, which compiles), or profile.steps=null to switch profiling off.")
    values = list(steps) if isinstance(steps, (list, tuple)) else None
    if values is None or len(values) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"profile.steps={steps!r} is not valid: it must be two integers [first, last], the "
                          f"steps to profile. {fix}")
    first, last = values
    if not 1 <= first <= last <= total:
        raise ConfigError(f"profile.steps=[{first},{last}] is not within the run: it needs 1 <= first <= last <= "
                          f"train.steps={total}, since steps are counted from 1 and only those steps run. {fix}")


class StepProfiler:
    """torch.profiler around steps ``first..last`` (a resumed run profiles those it runs).

    Attributes:
        path: the Chrome trace rank 0 wrote, once the last step is done (None before, and on other ranks).
    """

    def __init__(self, first: int, last: int, folder: str, is_main: bool) -> None:
        self.first, self.last, self.folder, self.is_main = first, last, folder, is_main
        self.path: str | None = None
        self.profiled: list[int] = []
        self._prof: Any = None
        self._span: Any = None

    def before_step(self, step: int) -> None:
        if not self.first <= step <= self.last:
            return
        if self._prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        self._span = record_function(step_label(step))
        self._span.__enter__()

    def after_step(self, step: int) -> None:
        if self._span is None:
            return
        self._span.__exit__(None, None, None)
        self._span = None
        self.profiled.append(step)
        if step == self.last:
            self._finish()

    def close(self) -> None:
        """Stop a profiler still running (the loop ended early); nothing is written."""
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        if self.is_main:
            self.path = os.path.join(self.folder, TRACE_FILE)
            prof.export_chrome_trace(self.path)
            print0(f"profile: steps {self.profiled[0]}..{self.profiled[-1]} traced to {self.path} "
                   "(open it in https://ui.perfetto.dev or chrome://tracing)")
