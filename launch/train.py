"""The main job: train a compiled DDP (or FSDP, or plain) model.

    torchrun --standalone --nproc-per-node 2 -m launch.train [overrides]   # or distcompile-train (launch.launcher)
    python -m launch.train [overrides]                                      # one process

:func:`train` reads as its four phases: :func:`setup` builds the model, the wrapping, the
optimizer and the data; :func:`warm_up` compiles every input shape first; :func:`loop`
trains; :func:`report` prints the summary and returns the metrics. :func:`run` validates
the config and holds the process group around it. :func:`main` is the entry point, a thin
Hydra shell (``launch.config.shell``): compose, convert to :class:`JobConfig`, call
:func:`run`, turn a :class:`ConfigError` into one message and exit code 2. Tests call :func:`run`.

The loop calls each of ``step_callbacks`` at the start of every step, with the job and the
step: the hook point for what a test (or a user's entry module, as ``tests/_fault_job.py``) runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from compiler import Diagnoser
from ddp_opt.planning.auto import describe as describe_plan

from .checkpoint.lock import checkpoint_folder_lock
from .checkpoint.resume import resume
from .checkpoint.run_identity import run_identity
from .checkpoint.store import latest_checkpoint, save_checkpoint
from .checks.agree import check_same_config
from .checks.diagnosis import diagnose
from .checks.validate import validate
from .config import shell
from .config.schema import JobConfig, Padding, ParallelMode, to_job_config
from .data.build import build_data
from .data.source import TokenSource, stream_seed
from .observe.banner import ddp_lines, describe, partition_table
from .observe.observer import Observer
from .observe.report import Tally, step_line, stop_record, summary_lines, write_json, write_metrics
from .runtime.compile_stats import after_first_compile, save_compile_cache
from .runtime.dist import (DistEnv, configure_logging, exit_now, print0, process_group, restarted_by_torchrun,
                           world_size_from_env)
from .runtime.guard import NonFinite, OnNonfinite, nonfinite_loss
from .runtime.leave import leave
from .runtime.parallel import Wrapped, build_model
from .runtime.precision import grad_scaler
from .runtime.preempt import Preempted, Preemption
from .runtime.recompiles import CompileCounter
from .runtime.watchdog import PeerWatchdog
from .runtime.worker_error import keep_stderr_tail
from .step.evaluate import Evaluator, build_evaluator
from .step.optim import OptimizerStep, wrap_with_optimizer
from .step.schedule import Schedule
from .step.train_step import StepRunner, input_names, micro_batches

__all__ = ["Job", "StepCallback", "run", "train", "setup", "warm_up", "loop", "report", "main", "to_job_config"]

StepCallback = Callable[["Job", int], None]


@dataclass
class Job:
    """One run, handed from phase to phase: what :func:`setup` built and what the loop measured (``tally``)."""

    cfg: JobConfig
    env: DistEnv
    wrapped: Wrapped
    optimizer: torch.optim.Optimizer
    data: TokenSource
    runner: StepRunner
    diagnoser: Diagnoser | None  # also counts graphs and recompiles (Note [Recompile accounting])
    counter: CompileCounter | None
    start: int  # steps already taken: resumed from a checkpoint, or 0
    t_start: float
    step_callbacks: Sequence[StepCallback] = ()
    tally: Tally = field(default_factory=Tally)
    preemption: Preemption = field(default_factory=Preemption)  # installed by run(): Note [Preemption]
    observer: Observer = field(default_factory=Observer.inert)  # TensorBoard, profiler: installed by train()
    schedule: Schedule = field(default_factory=Schedule)  # the lr of each step: Note [LR schedule]
    evaluator: Evaluator | None = None  # train.eval_every: Note [Evaluation]

    @property
    def compiled(self) -> bool:
        return self.cfg.compile.backend != "eager"

    @property
    def local_batch(self) -> int:
        return self.cfg.train.batch_size // self.env.world_size


def run(cfg: JobConfig, output_dir: str | None = None, *,
        step_callbacks: Sequence[StepCallback] = (), exit_on_error: bool = False) -> dict[str, Any]:
    """Validate, start the process group, train, tear down.

    SIGTERM and SIGINT stop every rank after the same step, with a checkpoint
    (Note [Preemption] in ``launch.runtime.preempt``).

    Args:
        cfg: the job config.
        output_dir: where rank 0 writes ``metrics.json`` (Hydra's run directory).
        step_callbacks: called as ``callback(job, step)`` at the start of every step.
        exit_on_error: on an error once the process group is up, print it and end the
            process at once (``launch.runtime.leave``; the entry point's choice, Note [Exit on
            error] in ``launch.runtime.dist``) instead of raising it.

    Returns:
        The metrics (every rank computes them; rank 0 writes them).

    Raises:
        ConfigError: a config value that cannot work, found before any process group starts;
            or ranks started with different configs, found as it starts (``launch.checks.agree``).
        NonFinite: the loss or the model stopped being finite (``launch.runtime.guard``).
        Preempted: a rank got SIGTERM/SIGINT; every rank stopped after the same step.
    """
    validate(cfg, world_size=world_size_from_env())
    with Preemption() as preemption, process_group(cfg.parallel, cfg.train.timeout_s) as env:
        try:
            configure_logging(env.rank)
            with PeerWatchdog(env, cfg.train.timeout_s, exit_on_silence=exit_on_error) as watchdog:
                check_same_config(cfg)  # ranks given different configs stop here, with the keys that differ
                with checkpoint_folder_lock(cfg.train, env):  # one job per checkpoint folder
                    metrics = train(cfg, env, (watchdog.at_step, *step_callbacks), preemption, output_dir)
            if env.is_main and output_dir:
                write_metrics(output_dir, metrics)
            if env.is_main and metrics.get("diagnosis") is not None and (cfg.diagnose_json or output_dir):
                write_json(cfg.diagnose_json or os.path.join(output_dir, "diagnosis.json"), metrics["diagnosis"],
                            "diagnosis")
        except BaseException as e:
            if env.is_main and output_dir and getattr(e, "metrics", None) is not None:  # a stop all ranks agreed on
                write_metrics(output_dir, e.metrics, stopped=str(e))
            if exit_on_error:
                leave(e, env)
            raise
    return metrics


def main(step_callbacks: Sequence[StepCallback] = ()) -> None:
    """Entry point of ``python -m launch.train``: the Hydra shell (``launch.config.shell``) around :func:`run`,
    ``step_callbacks`` passed on (``tests/_fault_job.py`` installs some); ends the process with the shell's exit
    code (Note [Reliable exit] in ``launch.runtime.dist``; under torchrun, Note [A failed rank's last line])."""
    keep_stderr_tail()
    exit_now(shell.main(run, step_callbacks))


def train(cfg: JobConfig, env: DistEnv, step_callbacks: Sequence[StepCallback] = (),
          preemption: Preemption | None = None, output_dir: str | None = None) -> dict[str, Any]:
    """Train in the process group ``env``; returns the metrics."""
    job = setup(cfg, env, step_callbacks)
    if preemption is not None:
        job.preemption = preemption
    with Observer(cfg, env, output_dir) as job.observer:
        warm_up(job)
        try:
            loop(job)
        except (Preempted, NonFinite) as e:  # every rank stops at the same step: the steps so far are reported
            with contextlib.suppress(Exception):  # never in place of the reason the run stopped
                e.metrics = job.observer.finish(job.tally, report(job, stopped=e))
            raise
        save_compile_cache(job.wrapped)  # graphs compiled after the first step (a new shape) are kept too
        return job.observer.finish(job.tally, report(job))


# --- the phases ----------------------------------------------------------------------


def setup(cfg: JobConfig, env: DistEnv, step_callbacks: Sequence[StepCallback] = ()) -> Job:
    """Build the model (same initial weights on every rank), wrap and compile it, and
    make the optimizer and the data; load the latest checkpoint when resuming."""
    t_start = time.perf_counter()
    cfg = _static_shapes_for_padding(cfg)  # the settings that run are the ones metrics.json records
    t = cfg.train
    print0(f"distcompile main job: {env.world_size} rank(s), {env.device.type} + {env.backend}")
    print0(describe(cfg))

    torch.manual_seed(t.seed)
    model = build_model(cfg.model).to(env.device)
    print0(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    compiled = cfg.compile.backend != "eager"
    diagnoser = Diagnoser() if cfg.diagnose or (compiled and cfg.parallel.name != ParallelMode.FSDP) else None
    names = input_names(model)
    wrapped, optimizer = wrap_with_optimizer(model, cfg, env, diagnoser.wrap if diagnoser else None)
    data = build_data(cfg.data, seed=t.seed, vocab_size=cfg.model.vocab_size)
    schedule = Schedule.of(t)
    start = _resume(cfg, env, wrapped, optimizer, schedule)
    c = cfg.compile
    opt_backend = dataclasses.replace(c.compile_options(), dynamic=None).resolve_backend() if c.optimizer else None
    runner = StepRunner(wrapped.forward, wrapped.module,
                        OptimizerStep(optimizer, opt_backend, grad_scaler(t.precision, env.device),
                                      max_grad_norm=t.max_grad_norm, tensor_lr=schedule.varies),
                        precision=t.precision, device=env.device, input_names=names,
                        no_recompile_after_warmup=t.no_recompile_after_warmup,
                        skip_nonfinite=t.on_nonfinite == OnNonfinite.SKIP, backward_context=wrapped.backward_context,
                        update_in_backward=cfg.ddp.optimizer_in_backward)
    counter = CompileCounter(diagnoser) if diagnoser is not None else None
    if counter is not None:
        counter.start()  # graphs and recompiles are counted from here on
    return Job(cfg, env, wrapped, optimizer, data, runner, diagnoser, counter, start, t_start, step_callbacks,
               schedule=schedule, evaluator=build_evaluator(wrapped.module, data, t, env))


def warm_up(job: Job) -> None:
    """Compile every input shape training can produce before step 1 (Note [Warm-up]
    in ``launch.step.train_step``), when compiling with ``data.padding`` other than ``max`` or
    under ``train.no_recompile_after_warmup``."""
    cfg, env = job.cfg, job.env
    t, d = cfg.train, cfg.data
    if not job.compiled or (d.padding == Padding.MAX and not t.no_recompile_after_warmup):
        return
    t0 = time.perf_counter()
    shapes = job.runner.warm_up(job.data, rank=env.rank, world_size=env.world_size,
                                micro_batch=job.local_batch // t.grad_accum, seq_len=t.seq_len, padding=d.padding,
                                pad_multiple=d.pad_multiple)
    dist.barrier()
    tally = job.tally
    tally.warmup_s = time.perf_counter() - t0
    tally.warmup_counts = counts = job.counter.snapshot() if job.counter is not None else None
    print0(f"warm-up: compiled {len(shapes)} input shape(s) {', '.join(map(str, shapes))} in {tally.warmup_s:.1f}s"
           + (f" ({counts.graphs} graphs, {counts.recompiles} recompiles)" if counts else ""))


def loop(job: Job) -> None:
    """Steps ``start + 1 .. train.steps``: step callbacks, the step, its log line, the
    finite-loss guard, checkpoints, and the stop after a step when a rank was signalled."""
    t = job.cfg.train
    skipped_in_a_row = 0
    for step in range(job.start + 1, t.steps + 1):
        for callback in job.step_callbacks:
            callback(job, step)
        job.observer.before_step(step)
        loss, real_tokens, padded_tokens, seconds, signalled, grad_norm = _step(job, step)
        first = step == job.start + 1
        job.tally.add_step(step, loss, real_tokens, padded_tokens, seconds, first)
        if first:
            _after_first_step(job, seconds)
        eval_loss = job.evaluator() if job.evaluator is not None and job.evaluator.due(step) else None
        lr = job.schedule.lr_at(step)
        job.tally.add_curves(step, lr, grad_norm, eval_loss)
        if step % t.log_interval == 0 or step in (job.start + 1, t.steps) or eval_loss is not None:
            print0(step_line(step, t.steps, loss, seconds, padded_tokens, lr if job.schedule.varies else None,
                             grad_norm, eval_loss, eta_s=job.tally.eta_s(step, t.steps)))
        job.observer.after_step(job.tally, step)
        skipped_in_a_row = _check_finite(job, step, loss, skipped_in_a_row, eval_loss)
        saved = None
        if t.checkpoint_every and (step % t.checkpoint_every == 0 or step == t.steps):
            saved = _save(job, step)
        if signalled and step < t.steps:  # Note [Preemption]: every rank got the same flag
            if t.checkpoint_every and saved is None:
                saved = _save(job, step)
            raise Preempted(step, saved)


def _check_finite(job: Job, step: int, loss: float, skipped_in_a_row: int, eval_loss: float | None) -> int:
    """Note [Finite-loss guard] in ``launch.runtime.guard``: stop on a non-finite loss, or count
    a skipped update; the evaluation loss under the same policy; returns the skipped steps in a row."""
    t = job.cfg.train
    resumed = latest_checkpoint(t.checkpoint_dir) if job.start and not job.tally.checkpoints else None
    last = job.tally.checkpoints[-1] if job.tally.checkpoints else (resumed.path if resumed else None)
    if job.runner.skipped:
        job.tally.skipped.append(step)
        skipped_in_a_row += 1
        print0(f"step {step}: the loss is not finite on some rank, so its update was skipped "
               f"({skipped_in_a_row} in a row; the run stops at train.max_consecutive_skips={t.max_consecutive_skips})")
        if skipped_in_a_row >= t.max_consecutive_skips:
            raise nonfinite_loss(step, loss, skipped_in_a_row, last)
    elif not math.isfinite(loss):
        raise nonfinite_loss(step, loss, last_checkpoint=last)
    else:
        skipped_in_a_row = 0
    if eval_loss is not None and not math.isfinite(eval_loss):
        if t.on_nonfinite == OnNonfinite.STOP:
            raise nonfinite_loss(step, eval_loss, last_checkpoint=last, what="evaluation loss")
        print0(f"step {step}: the evaluation loss is {eval_loss}, not finite (train.on_nonfinite=skip: training "
               "goes on; an evaluation has no update to skip)")
    return skipped_in_a_row


def _save(job: Job, step: int) -> str:
    t = job.cfg.train
    path = save_checkpoint(t.checkpoint_dir, step, job.wrapped.module, job.optimizer, keep_last=t.keep_last,
                           identity=run_identity(job.cfg, job.env.world_size), train_state=job.schedule.state_dict(step))
    job.tally.checkpoints.append(path)
    print0(f"checkpoint: {path}")
    return path


def report(job: Job, stopped: Preempted | NonFinite | None = None) -> dict[str, Any]:
    """Print what DDP and the compiler did and the summary lines; return the metrics. A run ``stopped``
    early says where and why; a non-finite stop (mid-step) leaves out the buckets' alignment."""
    cfg, env, tally, wrapped = job.cfg, job.env, job.tally, job.wrapped
    summary = tally.summary(job.counter.snapshot() if job.counter is not None else None)
    alignment = wrapped.alignment() if not isinstance(stopped, NonFinite) else None
    for line in ddp_lines(wrapped, alignment):
        print0(line)
    prediction = wrapped.prediction()
    if prediction is not None:
        print0("bucket plan (ddp.bucket_cap_mb=auto; gradient-ready order, times from the start of backward):\n"
               + describe_plan(prediction, wrapped.buckets()))
    diagnosis = None
    if cfg.diagnose:  # the diagnoser's window was closed by counter.snapshot() above
        diagnosis = diagnose(job.diagnoser, wrapped, job.data, cfg, env, tally.median_step_ms,
                             alignment.fraction if alignment is not None else None)
    metrics = {
        "world_size": env.world_size,
        "device": env.device.type,
        "dist_backend": env.backend,
        "start_step": job.start,
        "steps": cfg.train.steps,
        "losses": tally.losses,
        "final_loss": tally.losses[-1][1] if tally.losses else None,
        "first_step_s": tally.first_step_s,
        "compile_stats": tally.compile_stats,
        "median_step_ms": tally.median_step_ms,
        **summary,
        "wall_s": time.perf_counter() - job.t_start,
        "partitions": [asdict(r) for r in wrapped.partition_records()],
        "buckets": [{"size": b.size, "cap": b.cap, "params": list(b.params)} for b in wrapped.buckets()],
        "checkpoints": tally.checkpoints,
        "skipped_steps": len(tally.skipped),  # updates skipped for a non-finite loss (train.on_nonfinite=skip)
        "skipped_at": tally.skipped,
        "diagnosis": diagnosis,
        "alignment": alignment.fraction if alignment is not None else None,
        "bucket_plan_prediction": prediction.as_dict() if prediction is not None else None,
        "config": asdict(cfg),
        "stopped_at": stop_record(stopped),
    }
    for line in summary_lines(metrics, tally):
        print0(line)
    return metrics


# --- helpers of the phases -----------------------------------------------------------


def _static_shapes_for_padding(cfg: JobConfig) -> JobConfig:
    """``data.padding=multiple`` compiles each padded shape as a static graph:
    ``dynamic=False`` so dynamo's automatic dynamic shapes do not make the second
    shape symbolic (Note [Padding strategies] in ``launch.data.batching``)."""
    if cfg.data.padding != Padding.MULTIPLE or cfg.compile.dynamic is not None:
        return cfg
    return dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile, dynamic=False))


def _resume(cfg: JobConfig, env: DistEnv, wrapped: Wrapped, optimizer: torch.optim.Optimizer, schedule: Schedule) -> int:
    """The step to continue after: the verified checkpoint ``launch.checkpoint.resume`` picks when
    resuming (asked for, or restarted by torchrun), else 0."""
    info = resume(cfg.train, run_identity(cfg, env.world_size), wrapped.module, optimizer,
                  restarted=restarted_by_torchrun(), schedule=schedule)
    if info is None:
        return 0
    print0(f"resumed from {info.path} at step {info.step}")
    return info.step


def _step(job: Job, step: int) -> tuple[float, float, float, float, bool, float | None]:
    """One step at the schedule's lr. Returns its loss (mean over ranks), real and padded tokens (summed),
    seconds, whether any rank was signalled (Note [Preemption]) and the gradient norm (train.max_grad_norm)."""
    cfg, env = job.cfg, job.env
    t, d = cfg.train, cfg.data
    torch.manual_seed(stream_seed(t.seed, env.rank, step))  # dropout etc.: a function of the step
    batches = micro_batches(job.data, step=step, rank=env.rank, world_size=env.world_size,
                            local_batch=job.local_batch, seq_len=t.seq_len, grad_accum=t.grad_accum,
                            lengths=d.lengths, padding=d.padding, pad_multiple=d.pad_multiple, seed=t.seed,
                            device=env.device)
    for b in batches:
        job.tally.add_shape(tuple(b.inputs.shape))
    job.runner.optimizer_step.set_lr(job.schedule.lr_at(step))
    t0 = time.perf_counter()
    loss = job.runner.step(batches, step)
    norm = job.runner.grad_norm  # the same on every rank: of the synchronised gradients
    # The logged loss: mean over ranks (non-finite when one rank's is: Note [Finite-loss guard]);
    # tokens: summed; signalled: > 0 when a rank got SIGTERM/SIGINT. Also a sync point for timing.
    stats = torch.stack([loss.float(), loss.new_tensor(float(sum(b.real_tokens for b in batches))),
                         loss.new_tensor(float(sum(b.padded_tokens for b in batches))),
                         loss.new_tensor(1.0 if job.preemption.requested else 0.0),
                         norm.float() if norm is not None else loss.new_zeros((), dtype=torch.float32)])
    dist.all_reduce(stats)
    loss_sum, real_tokens, padded_tokens, signalled, norm_sum = stats.tolist()  # the step's one device-to-host copy
    return (loss_sum / env.world_size, real_tokens, padded_tokens, time.perf_counter() - t0, signalled > 0,
            norm_sum / env.world_size if norm is not None else None)


def _after_first_step(job: Job, seconds: float) -> None:
    """Once the first step compiled everything: save the compile cache, print the partitions."""
    print0(f"first step took {seconds:.1f}s"
           + (" (includes compile)" if job.compiled and job.tally.warmup_s is None else ""))
    if job.compiled:  # every rank (a collective): forward and backward are compiled now
        job.tally.compile_stats = after_first_compile(job.wrapped, job.env.world_size)
    if (table := partition_table(job.wrapped, job.cfg.log.verbose)) is not None:
        print0(table)


if __name__ == "__main__":
    main()
