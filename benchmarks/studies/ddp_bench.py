"""The interleaved DDP benchmark, run inside each torchrun rank (see Note [Interleaved
DDP benchmark]). ``run_cap`` measures every mode at one bucket cap and returns
rank 0's rows; ``benchmarks.studies.sweep`` measures every (mode, cap) pair at once;
``ddp_compare`` is the command line around both.

Note [Interleaved DDP benchmark]
--------------------------------
Background and the shared schedule: Note [Interleaved benchmark core] in
``benchmarks.harness.core``.

Modes (``benchmarks.studies.modes_ddp``): ``eager``, ``builtin`` (PyTorch's splitter),
``nosplit`` (``strategy="whole"``), ``ours`` (split at DDP's real buckets) and
``regional`` (Note [Regional compile]); every DDP model gets the simulated-link comm
hook (Note [Simulated link]).

Algorithm, per bucket cap:

1. Cold compile: ``first_steps`` with a fresh Inductor cache directory per mode.
2. Warm compile: ``first_steps`` again after one reset, each mode in its cold
   directory: what a restarted job with a warm on-disk cache pays.
3. Rounds: for every mode in turn (the order rotates), one synchronised step and one
   ``no_sync`` step, a barrier before each timed step.

Measured (rank 0's clocks; losses from all ranks):

- step: the synchronised step; ratios are medians of per-round ratios with IQR.
- compute: forward + backward under ``no_sync``; exposed comm = median of (sync
  forward + backward - compute), the pair back to back so drifts cancel.
- comm: the link's modelled time for the buckets reduced; overlap =
  ``(comm - exposed) / min(compute, comm)``.
- fwd, bwd, opt and one all-reduce of all gradient bytes give the physical limit,
  ``step_over_limit`` and ``ratio_vs_best_peer`` (Note [Physical limit of a step]).
- loss_max_abs_diff against eager; recompiles after the warm step; peak_mib (CUDA only)
  over a synchronised step; device.

On CUDA (Note [Benchmark device]) the model is built on the CPU from the seed and moved
to the rank's GPU before DDP wraps it, and every clock read follows a synchronize.

Notes: ``no_sync`` steps leave the weights alone, so all modes stay in lockstep. The
compile steps are not measured for memory: their peak holds the compiler's own.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from .._torch_internals import graphs_compiled
from ..harness.core import FRESH, SAME, GPTJob, compile_seconds, first_steps, gather_rank0, job_columns, loss_reference, \
    max_loss_diff, max_peak_mib, measure_rounds, measuring, runner_measures, step_stats
from ..harness.device import clock, peak_bytes, reset_peak
from ..harness.limit import (WIRE_BYTES, add_limit_columns, limit_parts, measure_comm, measure_powersgd_compute,
                             measure_powersgd_in_backward, powersgd_shapes, wire_kind, wire_numel)
from ..link.shaping import LinkModel, SimulatedLink
from .modes_ddp import DDP_MODES, DDPRunner, build_runner
from ..harness.report import cap_label, nan_to_none, print0
from ..harness.stats import median, overlap_efficiency

__all__ = ["BenchConfig", "Timed", "run_cap", "run_step", "run_round", "row_for", "link_comm_s", "compress_s",
           "finish_rows"]


@dataclass(frozen=True)
class BenchConfig(GPTJob):
    """What one DDP benchmark job measures. The model is the repo's GPT at width 256 (~12.6 MiB of
    gradients) unless told otherwise."""

    modes: tuple[str, ...] = DDP_MODES.default
    link: LinkModel = field(default_factory=LinkModel)
    net: str = "local"  # the network the ranks talk over (--net): local, or shaped:RATE between two namespaces
    caps: tuple[float | str, ...] = (1.0, 4.0, 25.0)  # "auto": ours with compile_ddp(bucket_cap_mb="auto")
    cache_root: str | None = None
    sweep: bool = False  # one interleaved phase over all (mode, cap) pairs (benchmarks.studies.sweep)
    # The mode whose per-round steps the ratio column divides by; None: builtin when it runs.
    baseline: str | None = None
    # Zero the gradients in place between steps (zero_grad(set_to_none=False), as launch does with a
    # compiled optimizer; --keep-grads): every backward then adds to existing gradients, as the
    # synchronised step of gradient accumulation does. False: freed, each backward makes them anew.
    keep_grads: bool = False

    def __post_init__(self) -> None:
        DDP_MODES.check(self.modes)
        if self.baseline is not None and self.baseline not in self.modes:
            raise ValueError(
                f"--baseline {self.baseline} is not among --modes {','.join(self.modes)}: the ratio column divides "
                f"each mode's step time by the baseline's, round by round, so the baseline must run too. Add "
                f"{self.baseline} to --modes or pick --baseline from them."
            )
        if self.sweep and "regional" in self.modes:
            raise ValueError(
                "--sweep does not take the regional mode: a sweep varies the bucket cap, and regional compile's "
                "buckets are whole blocks. Run regional without --sweep (python -m benchmarks.studies.ddp_compare "
                "--modes nosplit,ours,regional --baseline nosplit --layers 8)."
            )
        if "auto" in self.caps and not self.sweep:
            raise ValueError(
                "--caps auto needs --sweep: the auto plan is compared with fixed caps inside one interleaved phase "
                "(ours@auto next to ours@1, builtin@1, ...). Add --sweep, or drop auto from --caps."
            )
        unhooked = [m for m in self.modes if not DDP_MODES[m].takes_hook]
        if unhooked and self.link.enabled:
            raise ValueError(
                f"mode(s) {', '.join(unhooked)} with --link {self.link.label}: their all-reduces are traced into the "
                "compiled backward or go through a hook of their own (bf16, PowerSGD), and never reach DDP's comm hook, so the "
                "simulated link would charge every mode but them. Measure them over a real link (--net shaped:RATE, "
                "e.g. shaped:800mbit) or with --link none."
            )
        numeric = [c for c in self.caps if c != "auto"]
        if {"builtin", "builtin_bf16"} & set(self.modes) and numeric and min(numeric) < 1:
            raise ValueError(
                f"--caps {','.join(cap_label(c) for c in self.caps)} has a cap below 1 MiB, which PyTorch's splitter "
                "rejects (its first bucket is 1 MiB and must not exceed the cap). Use caps >= 1, or drop "
                "builtin from --modes to sweep smaller caps."
            )
        super().__post_init__()


class Timed(NamedTuple):
    """What ``run_step`` measured of one step."""

    step_s: float
    fb_s: float  # forward + backward
    fwd_s: float  # forward alone (the first part of fb_s)
    link: object  # the link's stats of the step (``SimulatedLink.take_step_stats``)
    peak_bytes: int | None  # CUDA, synchronised steps: peak allocated during the step; None otherwise


def run_step(r: DDPRunner, cfg: BenchConfig, link: SimulatedLink, *, sync: bool = True) -> Timed:
    """One timed step. ``sync=False`` is the ``no_sync`` compute step: no all-reduce, no SGD step.

    On CUDA every clock read waits for the GPU (``device.clock``), and a synchronised
    step runs in a fresh peak-memory window.
    """
    x, y = cfg.batch_at(r.step)
    device = x.device
    dist.barrier()
    link.take_step_stats()
    graphs0 = graphs_compiled()
    with r.mode.during_step(r):
        t0 = clock(device)
        if sync:
            reset_peak(device)
        with contextlib.nullcontext() if sync else r.ddp.no_sync():
            _, loss = r.fn(x, y)
            tf = clock(device)
            loss.backward()
        t1 = clock(device)
        if sync:
            r.opt.step()
        t2 = clock(device)
    peak = peak_bytes(device) if sync else None
    r.opt.zero_grad(set_to_none=not cfg.keep_grads)
    stats = link.take_step_stats()
    r.compiles.append(graphs_compiled() - graphs0)
    if sync:
        r.losses.append(float(loss.detach()))
        r.step += 1
    return Timed(t2 - t0, t1 - t0, tf - t0, stats, peak)


def run_round(r: DDPRunner, cfg: BenchConfig, link: SimulatedLink, measured: bool) -> float:
    """A synchronised step and a ``no_sync`` step, recorded when ``measured``; the step's seconds."""
    step_s, sync_fb, _, stats, peak = run_step(r, cfg, link, sync=True)
    _, nosync_fb, nosync_fwd, _, _ = run_step(r, cfg, link, sync=False)
    if measured:
        r.step_s.append(step_s)
        r.opt_s.append(step_s - sync_fb)
        r.nosync_fwd_s.append(nosync_fwd)
        if peak is not None:
            r.peak_bytes.append(peak)
        r.sync_fb_s.append(sync_fb)
        r.nosync_fb_s.append(nosync_fb)
        r.link_s.append(stats.link_s)
        r.buckets_per_step.append(stats.buckets)
        r.bucket_bytes = list(stats.sizes)
    return step_s


# The measured rounds that calibrate the prediction: all of them. The first three alone fitted
# noise on this 2-core machine (a contention of 17.7 ms/MiB on the seq-256 model at 800 Mbit,
# its fixed caps then predicted at 2.0-2.2x their measured exposed communication).
CALIBRATION_ROUNDS: int | None = None


def _calibration_rounds(r: DDPRunner) -> tuple[float, float, int] | None:
    """Medians over the first ``CALIBRATION_ROUNDS`` measured rounds (None: all): the ``no_sync``
    backward and the exposed communication (synchronised minus ``no_sync`` forward + backward),
    and how many rounds that was."""
    bwd = [fb - f for fb, f in zip(r.nosync_fb_s, r.nosync_fwd_s)][:CALIBRATION_ROUNDS]
    exposed = [s - c for s, c in zip(r.sync_fb_s, r.nosync_fb_s)][:CALIBRATION_ROUNDS]
    return (median(bwd), median(exposed), len(bwd)) if bwd else None


def fitted_contention(runners: list[DDPRunner]) -> dict[str, tuple[str, float]]:
    """Per mode, (runner, contention) fitted on the measured rounds of its ``auto`` runner
    (Note [Calibration from a measured backward] in ``ddp_opt.planning.calibrate``); every runner of
    that mode is then predicted with it, so the fixed caps' predictions are out of sample."""
    from ddp_opt.planning.calibrate import calibrate

    out = {}
    for r in runners:
        pred, first = r.mode.prediction(r), _calibration_rounds(r)
        if getattr(r, "cap", None) == "auto" and pred is not None and pred.units and first:
            out[r.mode.name] = (r.label, calibrate(pred, first[0], first[1]).current.contention_s_per_byte)
    return out


def _prediction(r: DDPRunner, fitted: dict[str, tuple[str, float]]) -> dict:
    """The cost model's prediction (ours with a cost model), flattened for the row, and the same
    prediction calibrated: backward scaled to this runner's measured ``no_sync`` backward,
    the contention fitted on its mode's ``auto`` runner (``fitted_contention``)."""
    pred = r.mode.prediction(r)
    if pred is None:
        return {"predicted_backward_ms": None, "predicted_exposed_comm_ms": None, "predicted_comm_ms": None,
                "predicted_link": None}
    out = {
        "predicted_backward_ms": pred.backward_s * 1e3,
        "predicted_exposed_comm_ms": pred.exposed_s * 1e3,
        "predicted_comm_ms": sum(pred.link.transfer_s(b.nbytes) for b in pred.buckets) * 1e3,
        "predicted_link": f"{pred.link.alpha_s * 1e3:.3g}ms,{pred.link.bandwidth / 1e6:.4g}MB/s",
    }
    first = _calibration_rounds(r)
    if first and pred.units:
        from ddp_opt.planning.calibrate import calibrate

        source, contention = fitted.get(r.mode.name, (None, None))
        out.update(calibrate(pred, first[0], contention=contention).as_dict(), contention_fitted_on=source,
                   calibration_rounds=first[2])
    return out


def row_for(r: DDPRunner, cfg: BenchConfig, cap_mb: float | str, order: int, base: DDPRunner | None,
            gathered: list[dict], reference: str | None, fitted: dict[str, tuple[str, float]] | None = None) -> dict:
    """One result row. ``gathered``: per rank, ``core.runner_measures`` of its runners; ``base``: the
    runner whose per-round steps the ratio is taken against (None: no ratio); ``reference``: the label
    whose losses the others are compared with (None: no comparison)."""
    steps = step_stats(r.step_s, base.step_s if base is not None else None)
    compute, sync_fb, comm = median(r.nosync_fb_s), median(r.sync_fb_s), median(r.link_s)
    exposed = median([s - c for s, c in zip(r.sync_fb_s, r.nosync_fb_s)])
    compiled = r.mode.compiled
    first = r.first_step_s + [None] * (2 - len(r.first_step_s))
    cold = compile_seconds(first[0], steps.median_s, compiled)
    events = r.cache_events + [None] * (2 - len(r.cache_events))
    plan, fused = r.mode.plan(r), r.mode.fused_bytes(r)
    return {
        "mode": r.mode.name,
        "backend": cfg.backend if compiled else "eager",
        "net": cfg.net,
        "link": cfg.link.label,
        "bucket_cap_mb": cap_mb,
        "step_ms_median": steps.median_s * 1e3,
        "ratio_vs_builtin": steps.ratio,
        "overlap": nan_to_none(overlap_efficiency(compute, comm, compute + exposed)) if cfg.link.enabled else None,
        "compile_s": cold,
        "partitions": r.mode.partitions(r),
        "loss_max_abs_diff": max_loss_diff(gathered, r.label, reference),
        "alignment": r.mode.alignment(r),
        "peak_mib": max_peak_mib(gathered, r.label),
        # extras
        "runner": r.label,
        "ratio_baseline": base.label if base is not None else None,
        "mode_order": order,
        "step_ms_q1": steps.q1_s * 1e3,
        "step_ms_q3": steps.q3_s * 1e3,
        "step_ms_rounds": [t * 1e3 for t in r.step_s],
        "ratio_q1": steps.ratio_q1,
        "ratio_q3": steps.ratio_q3,
        "compile_cold_s": cold,
        "compile_warm_s": compile_seconds(first[1], steps.median_s, compiled),
        "first_step_cold_s": first[0],
        "first_step_warm_s": first[1],
        "compute_ms": compute * 1e3,
        # the parts of the physical limit (benchmarks.harness.limit)
        "fwd_ms": median(r.nosync_fwd_s) * 1e3,
        "bwd_ms": median([fb - f for fb, f in zip(r.nosync_fb_s, r.nosync_fwd_s)]) * 1e3,
        "opt_ms": median(r.opt_s) * 1e3,
        "optimizer_in_backward": r.mode.in_backward,  # its opt_ms is the empty step after backward
        "sync_fb_ms": sync_fb * 1e3,
        "comm_ms": comm * 1e3 if cfg.link.enabled else None,  # the simulated link's charge; None without one
        "exposed_comm_ms": exposed * 1e3,
        **_prediction(r, fitted or {}),
        "ddp_buckets": int(median(r.buckets_per_step)),
        "recompiles": sum(r.compiles[len(r.first_step_s):]),  # after the compile step(s)
        "cold_cache": events[0],
        "warm_cache": events[1],
        "ddp_bucket_mib": [round(b / 2**20, 3) for b in r.bucket_bytes],
        "plan_bucket_mib": [round(b.size / 2**20, 3) for b in reversed(plan)] if plan is not None else None,
        "fused_mib": [round(b / 2**20, 3) for b in fused] if fused is not None else None,
        **job_columns(cfg),
        "keep_grads": cfg.keep_grads,
        "grad_mib": sum(p.numel() * p.element_size() for p in r.ddp.module.parameters()) / 2**20,
        # what crosses the link: the gradients in the mode's reduce dtype
        "reduce_dtype": r.mode.reduce_dtype,
        "compression": r.mode.compression,
        "wire_mib": _wire_bytes(r) / 2**20,
    }


def link_comm_s(cfg: BenchConfig, runners: list[DDPRunner], link: SimulatedLink, prefix: str = "") -> dict[str, float]:
    """The link time of all gradient bytes in one message (the ``comm`` of Note [Physical limit of
    a step] in ``benchmarks.harness.limit``), measured on every rank, per reduce dtype the runners use (a
    bf16 mode's limit counts bf16 bytes); rank 0 says what it measured."""
    comm = {}
    kinds = {wire_kind({"reduce_dtype": r.mode.reduce_dtype, "compression": r.mode.compression}): r for r in runners}
    for kind, r in sorted(kinds.items(), key=lambda item: -_wire_bytes(item[1])):
        nbytes = _wire_bytes(r)
        comm[kind] = measure_comm(nbytes, cfg.torch_device, link.model.transfer_s,
                                  repeats=max(3, min(cfg.rounds, 5)), dtype=r.mode.reduce_dtype)
        print0(f"{prefix}link: {nbytes / 2**20:.1f} MiB of {kind} gradients in one all-reduce took "
               f"{comm[kind] * 1e3:.1f} ms (median; the comm part of the physical limit)")
    return comm


def compress_s(cfg: BenchConfig, runners: list[DDPRunner], prefix: str = "") -> dict[str, tuple[float, float]]:
    """Per compression the runners use, the power iteration's compute: timed inside a backward that
    runs it on its own core, every rank at once (the ``compress`` of Note [Physical limit of a step]),
    and timed alone; no collective; rank 0 says what it measured."""
    out = {}
    repeats = max(3, min(cfg.rounds, 5))
    for r in runners:
        kind = r.mode.compression
        if kind is None or kind in out:
            continue
        shapes = powersgd_shapes(list(r.ddp.module.parameters()), kind)
        alone = measure_powersgd_compute(shapes, cfg.torch_device, repeats=repeats)
        inside = measure_powersgd_in_backward(cfg.new_model(), cfg.batch_at(0), kind, cfg.torch_device,
                                              repeats=max(5, min(cfg.rounds, 10)))
        out[kind] = (inside, alone)
        print0(f"{prefix}compute: {kind}'s power iteration over {len(shapes)} matrices took {inside * 1e3:.1f} ms "
               f"inside an eager backward, on every rank at once (median; added to backward in the physical "
               f"limit), {alone * 1e3:.1f} ms alone")
    return out


def _wire_bytes(r: DDPRunner) -> int:
    """Bytes of gradients one rank sends per step in ``r``'s mode."""
    return wire_numel(r.ddp.module.parameters(), r.mode.compression) * WIRE_BYTES[r.mode.reduce_dtype]


def finish_rows(rows: list[dict], comm_s: dict[str, float], prefix: str = "",
                compress: dict[str, tuple[float, float]] | None = None) -> list[dict]:
    """The rows with the physical limit (each row's from the bytes it sends, and for compressed rows
    the power iteration's compute in ``compress``, by kind), ``step_over_limit`` and the ratio to the best
    peer; over a real link (no simulated one) also ``comm_ms`` and ``overlap`` from the measured link time."""
    if rows:
        parts = {dtype: limit_parts(rows, seconds, *(compress or {}).get(dtype, (0.0, 0.0)))
                 for dtype, seconds in comm_s.items()}
        add_limit_columns(rows, parts)
        for r in rows:
            if r["comm_ms"] is None and r["net"] != "local":
                r["comm_ms"] = comm_s[wire_kind(r)] * 1e3
                r["overlap"] = nan_to_none(overlap_efficiency(r["compute_ms"], r["comm_ms"],
                                                              r["compute_ms"] + r["exposed_comm_ms"]))
        for dtype, part in parts.items():
            compute = f" + compress {part.compress_s * 1e3:.1f}" if part.compress_s else ""
            print0(f"{prefix}physical limit ({dtype} gradients) {part.limit_s * 1e3:.1f} ms = fwd "
                   f"{part.fwd_s * 1e3:.1f} + max(bwd {part.bwd_s * 1e3:.1f}{compute}, comm {part.comm_s * 1e3:.1f}) "
                   f"+ opt {part.opt_s * 1e3:.1f}")
    return rows


def run_cap(cfg: BenchConfig, cap_mb: float, link: SimulatedLink) -> list[dict]:
    """Build, compile and measure every mode at one bucket cap; rank 0 gets the rows."""
    torch.compiler.reset()
    runners = [build_runner(m, cfg, cap_mb, link) for m in cfg.modes]
    prefix = f"[cap {cap_label(cap_mb)} MiB] "
    with measuring(runners):
        for phase, cache in (("cold compile", FRESH), ("warm compile", SAME)):
            first_steps(runners, lambda r: run_step(r, cfg, link)[0], phase=phase, prefix=prefix, cache=cache,
                        tag=f"ddpbench-cap{cap_label(cap_mb)}", cache_root=cfg.cache_root)
        measure_rounds(runners, cfg.warmup, cfg.rounds, lambda r, measured: run_round(r, cfg, link, measured), prefix)
    comm_s, compress = link_comm_s(cfg, runners, link, prefix), compress_s(cfg, runners, prefix)
    gathered = gather_rank0(runner_measures(runners))
    if gathered is None:
        return []
    by_label = {r.label: r for r in runners}
    base, reference = by_label.get(cfg.baseline or "builtin"), loss_reference(runners)
    return finish_rows([row_for(r, cfg, cap_mb, order, base, gathered, reference)
                        for order, r in enumerate(runners)], comm_s, prefix, compress)
