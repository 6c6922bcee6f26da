"""The ranks' side of ``benchmarks.studies.optimizer_in_backward``: each strategy compiled with
and without ``optimizer=``, measured in interleaved rounds on one link, rank 0's rows written
to a file (Note [Optimizer in backward study] in that module)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from compiler import SettingError, resolve_backend
from ddp_opt import compile_ddp

from ..harness.core import GPTJob, Runner, first_steps, gather_rank0, job_columns, max_loss_diff, max_peak_mib, \
    measure_rounds, measuring, step_stats
from ..harness.device import clock
from ..harness.heap_peak import HeapWindow
from ..harness.limit import measure_comm
from ..harness.report import print0
from ..harness.stats import median

log = logging.getLogger(__name__)

__all__ = ["InBackwardJob", "InBackwardMode", "InBackwardRunner", "HeapWindow", "LazyBucketsPeer", "lazy_peer_missing",
           "run_job", "run_memory_job"]

MiB = 2**20


@dataclass(frozen=True)
class InBackwardJob(GPTJob):
    """One link's job: the strategies, each with and without the optimizer in backward."""

    strategies: tuple[str, ...] = ("split", "traced")
    link: str = "none"  # the row's link label: none, 200mbit, 800mbit
    lr: float = 1e-3  # AdamW's


@dataclass(frozen=True)
class InBackwardMode:
    """``compile_ddp(ddp, strategy=..., bucket_cap_mb="auto", optimizer=opt or None)``."""

    strategy: str
    in_backward: bool
    compiled = True

    @property
    def name(self) -> str:
        return f"{self.strategy}{'+opt_in_bwd' if self.in_backward else ''}"

    @property
    def summary(self) -> str:
        opt = ", optimizer=opt" if self.in_backward else ""
        return f"compile_ddp(ddp, strategy={self.strategy!r}, bucket_cap_mb='auto'{opt})"

    def compile(self, ddp: DDP, opt: torch.optim.Optimizer, backend: str) -> Any:
        # A backend object of its own under traced, as benchmarks.studies.modes_ddp's traced modes: no runner runs
        # another's compiled backward.
        chosen = functools.partial(resolve_backend(backend)) if self.strategy == "traced" else backend
        return compile_ddp(ddp, backend=chosen, strategy=self.strategy, bucket_cap_mb="auto",
                           optimizer=opt if self.in_backward else None)

    def during_step(self, r: InBackwardRunner) -> ContextManager:
        return r.fn.backward_context()


def lazy_peer_missing() -> str | None:
    """Why this torch has no :class:`LazyBucketsPeer` row, or None."""
    if "lazy_bucket_allocation" in inspect.signature(DDP.__init__).parameters:
        return None
    return (f"torch {torch.__version__}'s DistributedDataParallel has no lazy_bucket_allocation (torch 2.15 added "
            "it)")


@dataclass(frozen=True)
class LazyBucketsPeer:
    """The peer a torch 2.15 user compares against: eager DDP (no compile, DDP's own caps) built with
    ``lazy_bucket_allocation=True``, which allocates each bucket as its gradients arrive and gives the
    buckets back after backward; ``optimizer.step()`` after backward."""

    strategy = "eager"
    in_backward = False
    compiled = False
    name = "eager+lazy_buckets"
    summary = "DistributedDataParallel(model, lazy_bucket_allocation=True), optimizer.step() after backward"
    ddp_kwargs = {"lazy_bucket_allocation": True}

    def compile(self, ddp: DDP, opt: torch.optim.Optimizer, backend: str) -> Any:
        return ddp

    def during_step(self, r: InBackwardRunner) -> ContextManager:
        return contextlib.nullcontext()


@dataclass(kw_only=True)
class InBackwardRunner(Runner):
    """One mode's DDP model, its AdamW and what was measured of it."""

    mode: InBackwardMode
    ddp: DDP
    fn: Any
    sync_fb_s: list[float] = field(default_factory=list)
    nosync_fb_s: list[float] = field(default_factory=list)
    nosync_fwd_s: list[float] = field(default_factory=list)
    opt_s: list[float] = field(default_factory=list)  # optimizer.step() + zero_grad() after the synchronised backward
    start_bytes: list[int] = field(default_factory=list)  # live bytes when each measured peak window opened
    forward_bytes: list[int] = field(default_factory=list)  # live bytes when each measured forward ended
    end_bytes: list[int] = field(default_factory=list)  # live bytes when each measured backward ended
    heap_peak_bytes: list[int] = field(default_factory=list)  # CPU: each window's peak of the whole heap

    @property
    def label(self) -> str:
        return self.mode.name

    @property
    def grad_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.ddp.module.parameters() if p.requires_grad)

    def last_bucket_bytes(self) -> int | None:
        """Bytes of the bucket reduced last (the first in forward order), where the plan is known."""
        if self.mode.strategy == "eager":
            return None
        if self.mode.strategy == "split":
            buckets = self.fn.buckets
            return buckets[0].size if buckets else None
        fused = self.fn.traced.fused if self.fn.traced is not None else None
        return fused[0][-1] if fused and fused[0] else None

    def bucket_mib(self) -> list[float] | None:
        """The plan's buckets in reduction order, MiB."""
        if self.mode.strategy == "eager":
            return None
        if self.mode.strategy == "split":
            return [round(b.size / MiB, 3) for b in reversed(self.fn.buckets)] or None
        fused = self.fn.traced.fused if self.fn.traced is not None else None
        return [round(b / MiB, 3) for b in fused[0]] if fused else None


def _step(r: InBackwardRunner, cfg: InBackwardJob, heap: HeapWindow, *, sync: bool = True
          ) -> tuple[float, float, float, tuple[int, int, int, int, int | None] | None]:
    """One timed step (``sync=False``: under ``no_sync``, no optimizer step). A synchronised step's
    peak window covers forward, backward, ``optimizer.step()`` and ``zero_grad()``. Returns the step,
    forward + backward and forward seconds, and the bytes live at the window's start, when forward
    ended, when backward ended, the window's peak (None where not measured) and its heap peak (CPU)."""
    x, y = cfg.batch_at(r.step)
    device = x.device
    dist.barrier()
    start = forward = end = peak = heap_peak = None
    with r.mode.during_step(r):
        if sync:
            start = heap.open()
        t0 = clock(device)
        with contextlib.nullcontext() if sync else r.ddp.no_sync():
            _, loss = r.fn(x, y)
            tf = clock(device)
            if sync:
                forward = heap.live()
            loss.backward()
        t1 = clock(device)
        if sync:
            end = heap.live()
            r.opt.step()
        r.opt.zero_grad(set_to_none=True)
        t2 = clock(device)
        if sync:
            peak, heap_peak = heap.peak(), heap.heap_peak()
    if sync:
        r.losses.append(float(loss.detach()))
        r.step += 1
    return t2 - t0, t1 - t0, tf - t0, (start, forward, end, peak, heap_peak) if peak is not None else None


def _round(r: InBackwardRunner, cfg: InBackwardJob, heap: HeapWindow, measured: bool) -> float:
    step_s, sync_fb, _, memory = _step(r, cfg, heap, sync=True)
    _, nosync_fb, nosync_fwd, _ = _step(r, cfg, heap, sync=False)
    if measured:
        r.step_s.append(step_s)
        r.sync_fb_s.append(sync_fb)
        r.opt_s.append(step_s - sync_fb)
        r.nosync_fb_s.append(nosync_fb)
        r.nosync_fwd_s.append(nosync_fwd)
        if memory is not None:
            r.start_bytes.append(memory[0])
            r.forward_bytes.append(memory[1])
            r.end_bytes.append(memory[2])
            r.peak_bytes.append(memory[3])
            if memory[4] is not None:
                r.heap_peak_bytes.append(memory[4])
    return step_s


def _build(cfg: InBackwardJob, mode: InBackwardMode | LazyBucketsPeer) -> InBackwardRunner:
    model = cfg.new_model()
    device = next(model.parameters()).device
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **getattr(mode, "ddp_kwargs", {}))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    r = InBackwardRunner(mode=mode, ddp=ddp, fn=ddp, opt=opt)
    r.fn = mode.compile(ddp, opt, cfg.backend)
    return r


def build_runners(cfg: InBackwardJob) -> tuple[list[InBackwardRunner], dict[str, str]]:
    """The runners, without and with the optimizer in backward per strategy, then the peer (eager DDP with
    ``lazy_bucket_allocation``) where this torch has it; and, per strategy that ``compile_ddp`` refuses with
    ``optimizer=``, its message (that strategy is left out)."""
    runners, refused = [], {}
    for strategy in cfg.strategies:
        try:
            with_opt = _build(cfg, InBackwardMode(strategy, True))
        except SettingError as e:  # refused before any collective, the same on every rank
            refused[strategy] = str(e)
            print0(f"{strategy}: compile_ddp refused optimizer=, so both {strategy} rows are skipped: {e}")
            continue
        runners += [_build(cfg, InBackwardMode(strategy, False)), with_opt]
    if lazy_peer_missing() is None:
        runners.append(_build(cfg, LazyBucketsPeer()))
    return runners, refused


def _runner_row(r: InBackwardRunner, cfg: InBackwardJob, base: InBackwardRunner | None, gathered: list[dict]
                ) -> dict:
    """``base``: the same strategy without the optimizer in backward (None for the peer: no ratio)."""
    steps = step_stats(r.step_s, base.step_s if base is not None else None)
    starts = [g["start_mib"][r.label] for g in gathered if g["start_mib"].get(r.label) is not None]
    peak = max_peak_mib(gathered, r.label)
    last = r.last_bucket_bytes()
    return {
        "mode": r.mode.strategy, "bucket_cap_mb": "auto" if r.mode.compiled else None,
        "optimizer_in_backward": r.mode.in_backward,
        "lazy_bucket_allocation": bool(getattr(r.ddp, "lazy_bucket_allocation", False)),
        "link": cfg.link, "peak_mib": peak, "grad_mib": r.grad_bytes / MiB, "step_ms_median": steps.median_s * 1e3,
        "ratio_vs_without": steps.ratio, "ratio_vs_without_q1": steps.ratio_q1, "ratio_vs_without_q3": steps.ratio_q3,
        "skipped": None, "batch": cfg.batch, "runner": r.label, "backend": cfg.backend,
        "optimizer": type(r.opt).__name__,
        # the peak window opened with these bytes live (weights, optimizer states, every runner's): the step's own
        # peak is the difference (max over ranks of each rank's max over steps)
        "start_mib": max(starts) if starts else None,
        "peak_above_start_mib": _most(gathered, "above_mib", r.label),
        # what forward left live for backward (its activations), and what backward left live: the gradients,
        # unless the updates freed them
        "forward_end_mib": _most(gathered, "forward_mib", r.label),
        "backward_end_mib": _most(gathered, "end_mib", r.label),
        "step_ms_q1": steps.q1_s * 1e3, "step_ms_q3": steps.q3_s * 1e3,
        "step_ms_rounds": [t * 1e3 for t in r.step_s],
        "fwd_ms": median(r.nosync_fwd_s) * 1e3,
        "bwd_ms": median([fb - f for fb, f in zip(r.nosync_fb_s, r.nosync_fwd_s)]) * 1e3,
        "opt_ms": median(r.opt_s) * 1e3, "sync_fb_ms": median(r.sync_fb_s) * 1e3,
        "exposed_comm_ms": median([s - c for s, c in zip(r.sync_fb_s, r.nosync_fb_s)]) * 1e3,
        "bucket_mib": r.bucket_mib(), "last_bucket_mib": last / MiB if last is not None else None,
        "loss_max_abs_diff_vs_without": max_loss_diff(gathered, r.label, base.label if base is not None else None),
        **job_columns(cfg),
    }


def _most(gathered: list[dict], key: str, label: str) -> float | None:
    values = [g[key][label] for g in gathered if g[key].get(label) is not None]
    return max(values) if values else None


def _measures(runners: list[InBackwardRunner]) -> dict:
    return {"losses": {r.label: r.losses for r in runners},
            "peak_mib": {r.label: max(r.peak_bytes) / MiB if r.peak_bytes else None for r in runners},
            "heap_peak_mib": {r.label: max(r.heap_peak_bytes) / MiB if r.heap_peak_bytes else None for r in runners},
            "start_mib": {r.label: median(r.start_bytes) / MiB if r.start_bytes else None for r in runners},
            "above_mib": {r.label: max(p - s for p, s in zip(r.peak_bytes, r.start_bytes)) / MiB
                          if r.peak_bytes else None for r in runners},
            "forward_mib": {r.label: median([f - s for f, s in zip(r.forward_bytes, r.start_bytes)]) / MiB
                            if r.forward_bytes else None for r in runners},
            "end_mib": {r.label: median([e - s for e, s in zip(r.end_bytes, r.start_bytes)]) / MiB
                        if r.end_bytes else None for r in runners}}


def run_job(cfg: InBackwardJob, part: str | Path) -> None:
    """Measure every runner over this job's link; rank 0 writes the rows to ``part``."""
    torch.compiler.reset()
    heap = HeapWindow(cfg.torch_device)
    if not heap.measures:
        print0("no peak memory on this CPU: the malloc shim is not preloaded (no C compiler?); peak_mib is null")
    runners, refused = build_runners(cfg)
    with measuring(runners):
        for phase in ("compile", "second step"):  # the second: DDP's bucket rebuild and our realignment
            first_steps(runners, lambda r: _step(r, cfg, heap)[0], phase=phase, prefix=f"[{cfg.link}] ")
        measure_rounds(runners, cfg.warmup, cfg.rounds, lambda r, measured: _round(r, cfg, heap, measured),
                       prefix=f"[{cfg.link}] ")
    grad_bytes = runners[0].grad_bytes if runners else 0
    comm_s = measure_comm(grad_bytes, cfg.torch_device, lambda n: 0.0, repeats=5) if runners else None
    gathered = gather_rank0(_measures(runners))
    if gathered is None:
        return
    by_label = {r.label: r for r in runners}
    rows = [_runner_row(r, cfg, by_label.get(InBackwardMode(r.mode.strategy, False).name) if r.mode.compiled
                        else None, gathered) for r in runners]
    for row in rows:
        row["comm_ms"] = comm_s * 1e3 if comm_s is not None else None
    grad_mib = sum(p.numel() * p.element_size() for p in cfg.new_model().parameters()) / MiB
    for strategy, why in refused.items():
        rows += [{"mode": strategy, "bucket_cap_mb": "auto", "optimizer_in_backward": b, "link": cfg.link,
                  "batch": cfg.batch, "peak_mib": None, "grad_mib": grad_mib, "step_ms_median": None, "skipped": why,
                  "backend": cfg.backend,
                  **job_columns(cfg)} for b in (False, True)]
    Path(part).write_text(json.dumps(rows))


# Each row's memory comes from a job of its own mode (Note [Optimizer in backward study], step 3): the gathered
# measure -> the row's column. released_mib: what the last backward gave back (Note [Bucket buffers between steps]).
_MEMORY_COLUMNS = {"peak_mib": "peak_mib", "start_mib": "start_mib", "above_mib": "peak_above_start_mib",
                   "forward_mib": "forward_end_mib", "end_mib": "backward_end_mib", "released_mib": "released_mib",
                   "heap_peak_mib": "peak_heap_mib"}


def run_memory_job(cfg: InBackwardJob, mode_name: str, part: str | Path) -> None:
    """One mode alone in each rank's process: its peak-memory windows over ``cfg.rounds`` synchronised
    steps (each followed by a ``no_sync`` one, as in the interleaved rounds); rank 0 writes the row's
    memory columns (most over ranks) to ``part``."""
    torch.compiler.reset()
    heap = HeapWindow(cfg.torch_device)
    modes = [*(InBackwardMode(s, b) for s in cfg.strategies for b in (False, True)), LazyBucketsPeer()]
    mode = next(m for m in modes if m.name == mode_name)
    runner = _build(cfg, mode)
    with measuring([runner]):
        for phase in ("compile", "second step"):
            first_steps([runner], lambda r: _step(r, cfg, heap)[0], phase=phase, prefix=f"[{cfg.link} memory] ")
        measure_rounds([runner], cfg.warmup, cfg.rounds, lambda r, measured: _round(r, cfg, heap, measured),
                       prefix=f"[{cfg.link} memory] ")
    release = getattr(getattr(runner.fn, "in_backward", None), "release", None)
    measures = _measures([runner])
    measures["released_mib"] = {runner.label: release.released_bytes / MiB if release is not None else None}
    gathered = gather_rank0(measures)
    if gathered is not None:
        Path(part).write_text(json.dumps({column: _most(gathered, key, runner.label)
                                          for key, column in _MEMORY_COLUMNS.items()}))
