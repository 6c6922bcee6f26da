"""The main job: train a compiled DDP (or FSDP, or plain) model.

    torchrun --standalone --nproc-per-node 2 -m launch.train [overrides]
    python -m launch.train [overrides]                       # one process

``main`` is a thin Hydra shell: compose, convert to :class:`JobConfig`, call
:func:`run`, turn a :class:`ConfigError` into one message on stderr and exit
code 2. Tests call :func:`run` directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import ConfigError, JobConfig, _restarted_by_torchrun, describe, register_configs, validate
from .data import build_data, stream_seed
from .dist import DistEnv, configure_logging, exit_now, print0, process_group, world_size_from_env
from .optim import OptimizerStep, build_optimizer
from .parallel import Wrapped, apply_parallel, build_model
from .precision import autocast, grad_scaler
from .recompiles import CompileCounter
from .step import StepRunner, micro_batches
from compiler.diagnose import Diagnoser
from ddp_opt import Spelling, ddp_advice

# How the doctor's advice names a setting: as a launcher override.
OVERRIDE_SPELLING = Spelling(
    bucket_cap="ddp.bucket_cap_mb={}", bucket_cap_list="ddp.bucket_cap_mb_list={}", auto="ddp.bucket_cap_mb=auto",
    keep_aligned="Keep bucket realignment on (it is skipped for ddp.static_graph=true)",
    regional="compile.regional=true", cache_dir="compile.cache_dir=DIR",
    compare="python -m benchmarks.ddp_compare --modes eager,nosplit,ours --caps {}",
)

__all__ = ["run", "main", "to_job_config", "FAULT_ENV"]

# Testing only: "STEP[:RANK]" makes RANK (default 0) SIGKILL itself at the start of
# STEP, on the first attempt only (TORCHELASTIC_RESTART_COUNT unset or 0).
FAULT_ENV = "DISTCOMPILE_FAULT"


def to_job_config(dcfg: Any) -> JobConfig:
    """The composed DictConfig as the typed :class:`JobConfig` (Hydra stays here)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = OmegaConf.to_object(dcfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{e.full_key or 'config'}: {e.msg}. Set it on the command line, e.g. {e.full_key}=...") from None
    assert isinstance(cfg, JobConfig), type(cfg)
    return cfg


def run(cfg: JobConfig, output_dir: str | None = None) -> dict[str, Any]:
    """Validate, start the process group, train, tear down.

    Args:
        cfg: the job config.
        output_dir: where rank 0 writes ``metrics.json`` (Hydra's run directory).

    Returns:
        The metrics (every rank computes them; rank 0 writes them).

    Raises:
        ConfigError: a config value that cannot work, found before any process group starts.
    """
    validate(cfg, world_size=world_size_from_env())
    with process_group(cfg.parallel, cfg.train.timeout_s) as env:
        configure_logging(env.rank)
        metrics = _train(cfg, env)
        if env.is_main and output_dir:
            path = os.path.join(output_dir, "metrics.json")
            with open(path, "w") as f:
                json.dump(metrics, f, indent=1)
            print0(f"metrics: {path}")
        if env.is_main and metrics.get("diagnosis") is not None and (cfg.diagnose_json or output_dir):
            path = cfg.diagnose_json or os.path.join(output_dir, "diagnosis.json")
            with open(path, "w") as f:
                json.dump(metrics["diagnosis"], f, indent=1)
            print0(f"diagnosis: {path}")
    return metrics


def _train(cfg: JobConfig, env: DistEnv) -> dict[str, Any]:
    t_start = time.perf_counter()
    cfg = _compile_cfg_for_padding(cfg)  # the settings that run are the ones metrics.json records
    t = cfg.train
    print0(f"distcompile main job: {env.world_size} rank(s), {env.device.type} + {env.backend}")
    print0(describe(cfg))

    torch.manual_seed(t.seed)  # same initial weights on every rank
    model = build_model(cfg.model).to(env.device)
    n_params = sum(p.numel() for p in model.parameters())
    print0(f"model: {n_params / 1e6:.2f}M parameters")
    compiled = cfg.compile.backend != "eager"
    # The diagnoser also counts graphs and recompiles for the summary (Note [Recompile accounting]).
    diagnoser = Diagnoser() if cfg.diagnose or (compiled and cfg.parallel.name != "fsdp") else None
    counter = CompileCounter(diagnoser) if diagnoser is not None else None
    input_names = _input_names(model)
    wrapped = apply_parallel(model, cfg, env,
                             wrap_backend=diagnoser.wrap if diagnoser else None)
    optimizer = build_optimizer(wrapped.module.parameters(), t.lr, t.weight_decay, env.device)
    data = build_data(cfg.data, seed=t.seed, vocab_size=cfg.model.vocab_size)

    start = 0
    if t.resume or _restarted_by_torchrun():
        info = latest_checkpoint(t.checkpoint_dir)
        if info is not None:
            start = load_checkpoint(info, wrapped.module, optimizer)
            print0(f"resumed from {info.path} at step {start}")

    local_bs = t.batch_size // env.world_size
    d = cfg.data
    opt_backend = None
    if cfg.compile.optimizer:
        from compiler import resolve_backend

        opt_backend = resolve_backend(cfg.compile.backend, mode=cfg.compile.mode, options=cfg.compile.options or None)
    runner = StepRunner(wrapped.forward, wrapped.module,
                        OptimizerStep(optimizer, opt_backend, grad_scaler(t.precision, env.device)),
                        precision=t.precision, device=env.device, input_names=input_names,
                        no_recompile_after_warmup=t.no_recompile_after_warmup)
    losses: list[tuple[int, float]] = []
    step_ms: list[float] = []
    checkpoints: list[str] = []
    first_step_s = None
    totals = torch.zeros(2, dtype=torch.float64)  # real, padded tokens of all steps (all ranks)
    timed = torch.zeros(2, dtype=torch.float64)  # the same, of the timed steps (after the first)
    shapes_seen: dict[tuple[int, ...], int] = {}
    if counter is not None:
        counter.start()
    warmup_s, warmup_counts = None, None
    if compiled and (d.padding != "max" or t.no_recompile_after_warmup):
        t0 = time.perf_counter()
        shapes = runner.warm_up(data, rank=env.rank, world_size=env.world_size, micro_batch=local_bs // t.grad_accum,
                                seq_len=t.seq_len, padding=d.padding, pad_multiple=d.pad_multiple)
        dist.barrier()
        warmup_s = time.perf_counter() - t0
        warmup_counts = counter.snapshot() if counter is not None else None
        print0(f"warm-up: compiled {len(shapes)} input shape(s) {', '.join(map(str, shapes))} in {warmup_s:.1f}s"
               + (f" ({warmup_counts.graphs} graphs, {warmup_counts.recompiles} recompiles)" if warmup_counts else ""))
    for step in range(start + 1, t.steps + 1):
        _maybe_inject_fault(step, env.rank)
        torch.manual_seed(stream_seed(t.seed, env.rank, step))  # dropout etc.: a function of the step
        batches = micro_batches(data, step=step, rank=env.rank, world_size=env.world_size, local_batch=local_bs,
                                seq_len=t.seq_len, grad_accum=t.grad_accum, lengths=d.lengths, padding=d.padding,
                                pad_multiple=d.pad_multiple, seed=t.seed, device=env.device)
        for b in batches:
            shapes_seen[tuple(b.inputs.shape)] = shapes_seen.get(tuple(b.inputs.shape), 0) + 1
        t0 = time.perf_counter()
        loss = runner.step(batches, step)
        # The logged loss: mean over ranks; tokens: summed (also a sync point for timing).
        stats = torch.stack([loss.float(), loss.new_tensor(float(sum(b.real_tokens for b in batches))),
                             loss.new_tensor(float(sum(b.padded_tokens for b in batches)))])
        dist.all_reduce(stats)
        loss_sum, real_tokens, padded_tokens = stats.tolist()  # the step's one device-to-host copy
        loss_value = loss_sum / env.world_size
        dt = time.perf_counter() - t0
        tokens_per_step = padded_tokens
        losses.append((step, loss_value))
        step_tokens = torch.tensor([real_tokens, padded_tokens], dtype=torch.float64)
        totals += step_tokens
        if step != start + 1:
            timed += step_tokens
        if step == start + 1:
            first_step_s = dt
            print0(f"first step took {dt:.1f}s" + (" (includes compile)" if compiled and warmup_s is None else ""))
            if wrapped.compiled_ddp is not None:  # compile.cache_dir: forward and backward are compiled now
                wrapped.compiled_ddp.save_compile_cache()
            _print_partitions(wrapped)
        else:
            step_ms.append(dt * 1e3)
        if step % t.log_interval == 0 or step in (start + 1, t.steps):
            print0(f"step {step:>5}/{t.steps}  loss {loss_value:.4f}  step {dt * 1e3:8.1f} ms  "
                   f"tokens/s {tokens_per_step / dt:10,.0f}")
        if t.checkpoint_every and (step % t.checkpoint_every == 0 or step == t.steps):
            checkpoints.append(save_checkpoint(t.checkpoint_dir, step, wrapped.module, optimizer,
                                               keep_last=t.keep_last))
            print0(f"checkpoint: {checkpoints[-1]}")

    median_ms = statistics.median(step_ms) if step_ms else (first_step_s or 0.0) * 1e3
    timed_s = sum(step_ms) / 1e3 if step_ms else (first_step_s or 0.0)
    if not step_ms:
        timed = totals
    end_counts = counter.snapshot() if counter is not None else None
    summary = _step_summary(warmup_s, warmup_counts, end_counts, shapes_seen, totals, timed, timed_s)
    alignment = _alignment(wrapped)
    if alignment is not None:
        print0(f"alignment: {alignment.fraction:.2f} of gradient bytes are in DDP buckets that hold exactly one "
               f"partition ({sum(alignment.aligned)} of {len(alignment.aligned)} runtime buckets)")
    prediction = _prediction(wrapped)
    if prediction is not None:
        from ddp_opt.cost import describe as describe_plan  # launch.config's describe is used above

        print0("bucket plan (ddp.bucket_cap_mb=auto; gradient-ready order, times from the start of backward):\n"
               + describe_plan(prediction, _buckets(wrapped)))
    diagnosis = None
    if cfg.diagnose:  # the diagnoser's window was closed by counter.snapshot() above
        sizes = [b.size / 2**20 for b in reversed(_buckets(wrapped)) if b.size]
        # micro-batches: the shape training compiled for (a full local batch would recompile under grad_accum)
        exposed_ms, compute_ms = _probe_exposed_comm(wrapped, data, cfg, env, local_bs // t.grad_accum)
        fraction = alignment.fraction if alignment is not None else None
        advice = ddp_advice(alignment=fraction, partition_mib=sizes or None, exposed_comm_ms=exposed_ms,
                            compute_ms=compute_ms, compile_s=diagnoser.compile_seconds(_records(wrapped)),
                            step_s=median_ms / 1e3, spelling=OVERRIDE_SPELLING,
                            bucket_cap_mb=None if cfg.ddp.bucket_cap_mb == "auto" else cfg.ddp.bucket_cap_mb)
        report = diagnoser.report(partitions=_records(wrapped), alignment=fraction, exposed_comm_ms=exposed_ms,
                                  compute_ms=compute_ms, extra_advice=advice)
        diagnosis = json.loads(report.to_json())
        print0("\n== compile diagnosis (rank 0) ==\n" + report.format())
    metrics = {
        "world_size": env.world_size,
        "device": env.device.type,
        "dist_backend": env.backend,
        "start_step": start,
        "steps": t.steps,
        "losses": losses,
        "final_loss": losses[-1][1] if losses else None,
        "first_step_s": first_step_s,
        "median_step_ms": median_ms,
        **summary,
        "wall_s": time.perf_counter() - t_start,
        "partitions": _partition_records(wrapped),
        "buckets": [{"size": b.size, "cap": b.cap, "params": list(b.params)} for b in _buckets(wrapped)],
        "checkpoints": checkpoints,
        "diagnosis": diagnosis,
        "alignment": alignment.fraction if alignment is not None else None,
        "bucket_plan_prediction": prediction.as_dict() if prediction is not None else None,
        "config": asdict(cfg),
    }
    if summary["graphs"] is not None:
        after = summary["recompiles_after_warmup"]
        print0(f"compile: {summary['graphs']} graph(s), {summary['recompiles']} recompile(s)"
               + (f" ({after} after warm-up)" if after is not None else "")
               + f"; shapes seen: {_format_shapes(shapes_seen)}")
    print0(f"tokens: {summary['real_tokens_per_s'] or 0:,.0f} real tokens/s, {summary['tokens_per_s'] or 0:,.0f} "
           f"tokens/s with padding (padding waste {100 * summary['padding_waste']:.1f}%)")
    print0(
        f"done: steps {start + 1}..{t.steps}, final loss {metrics['final_loss']:.4f}, "
        f"median step {median_ms:.1f} ms, {metrics['real_tokens_per_s'] or 0:,.0f} real tokens/s, "
        f"recompiles {summary['recompiles'] if summary['recompiles'] is not None else 'n/a'}, "
        f"first step {first_step_s or 0:.1f}s, wall {metrics['wall_s']:.1f}s"
    )
    return metrics


def _step_summary(warmup_s: float | None, warmup: Any, end: Any, shapes_seen: dict[tuple[int, ...], int],
                  totals: torch.Tensor, timed: torch.Tensor, timed_s: float) -> dict[str, Any]:
    """The run's compile and token accounting for metrics.json and the summary lines.

    ``graphs``/``recompiles`` count the whole run (warm-up included) and are None
    when nothing was counted (eager, or fsdp); token rates are over the timed
    steps (after the first), summed over ranks."""
    real, padded = float(totals[0]), float(totals[1])
    return {
        "warmup_s": warmup_s,
        "warmup_graphs": warmup.graphs if warmup is not None else None,
        "graphs": end.graphs if end is not None else None,
        "recompiles": end.recompiles if end is not None else None,
        "recompiles_after_warmup": (end.recompiles - warmup.recompiles
                                    if end is not None and warmup is not None else None),
        "shapes_seen": [[list(s), n] for s, n in sorted(shapes_seen.items())],
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_waste": 1.0 - real / padded if padded else 0.0,
        "tokens_per_s": float(timed[1]) / timed_s if timed_s else None,
        "real_tokens_per_s": float(timed[0]) / timed_s if timed_s else None,
    }


def _format_shapes(shapes_seen: dict[tuple[int, ...], int], most: int = 8) -> str:
    items = sorted(shapes_seen.items())
    text = ", ".join(f"{tuple(s)} x{n}" for s, n in items[:most])
    return text + (f", ... ({len(items)} shapes)" if len(items) > most else "")


def _input_names(model: torch.nn.Module) -> tuple[str, str]:
    """The model's names for (inputs, targets), as dynamo's guards name them."""
    import inspect

    names = [n for n, p in inspect.signature(model.forward).parameters.items()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (names + ["inputs", "targets"])[0], (names[1:] + ["targets"])[0]


def _compile_cfg_for_padding(cfg: JobConfig) -> JobConfig:
    """``data.padding=multiple`` compiles each padded shape as a static graph:
    ``dynamic=False`` so dynamo's automatic dynamic shapes do not make the second
    shape symbolic (Note [Padding strategies] in ``launch.batching``)."""
    if cfg.data.padding != "multiple" or cfg.compile.dynamic is not None:
        return cfg
    return dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile, dynamic=False))


def _buckets(wrapped: Wrapped) -> list:
    return list(wrapped.compiled_ddp.buckets) if wrapped.compiled_ddp is not None else []


def _probe_exposed_comm(wrapped: Wrapped, data: Any, cfg: JobConfig, env: DistEnv, micro_bs: int,
                        rounds: int = 3) -> tuple[float | None, float | None]:
    """Median forward+backward with and without DDP's gradient sync, in ms, on
    batches past the end of training; gradients are zeroed and no optimizer step
    is taken, so the model is unchanged. (None, None) without DDP."""
    if wrapped.compiled_ddp is None:
        return None, None
    ddp = wrapped.compiled_ddp.ddp_model
    synced, unsynced = [], []
    for i in range(rounds):
        x, y = (v.to(env.device) for v in data.batch(cfg.train.steps + 1 + i, env.rank, env.world_size,
                                                      micro_bs, cfg.train.seq_len))
        for sync, times in ((True, synced), (False, unsynced)):
            dist.barrier()
            t0 = time.perf_counter()
            with contextlib.nullcontext() if sync else ddp.no_sync():
                with autocast(cfg.train.precision, env.device):
                    loss = wrapped.forward(x, y)[1]
                loss.backward()
            times.append((time.perf_counter() - t0) * 1e3)
            ddp.zero_grad(set_to_none=True)
    sync_ms, nosync_ms = statistics.median(synced), statistics.median(unsynced)
    return max(sync_ms - nosync_ms, 0.0), nosync_ms


def _prediction(wrapped: Wrapped):
    """The cost model's predicted timeline (ddp.bucket_cap_mb=auto), else None."""
    return getattr(wrapped.compiled_ddp, "prediction", None) if wrapped.compiled_ddp is not None else None


def _alignment(wrapped: Wrapped):
    """DDP's runtime buckets against the partitions (None without compile_ddp)."""
    if wrapped.compiled_ddp is None:
        return None
    from ddp_opt import measure_alignment

    return measure_alignment(wrapped.compiled_ddp.ddp_model, wrapped.compiled_ddp.buckets)


def _records(wrapped: Wrapped) -> list:
    """The DDP splitter's partition records (empty without one)."""
    opt = getattr(wrapped.compiled_ddp, "ddp_optimizer", None)
    return list(opt.records) if opt is not None else []


def _partition_records(wrapped: Wrapped) -> list[dict[str, Any]]:
    return [asdict(r) for r in _records(wrapped)]


def _print_partitions(wrapped: Wrapped) -> None:
    buckets = _buckets(wrapped)
    if not buckets:
        return
    from tabulate import tabulate

    from ddp_opt import format_buckets

    print0(f"DDP buckets = graph partitions ({len(buckets)}):")
    print0(format_buckets(buckets))
    records = _partition_records(wrapped)
    if records:
        rows = [(r["index"], r["name"], r["status"], f"{r['compile_s']:.2f}") for r in records]
        print0(tabulate(rows, headers=("partition", "name", "status", "compile s"), tablefmt="simple"))


def _maybe_inject_fault(step: int, rank: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec or _restarted_by_torchrun():
        return
    fault_step, _, fault_rank = spec.partition(":")
    if step == int(fault_step) and rank == int(fault_rank or 0):
        print(f"[rank {rank}] {FAULT_ENV}={spec}: killing myself at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# --- the Hydra shell -----------------------------------------------------------------

_STATE = {"started": False, "code": 0}


def _report_config_error(e: ConfigError) -> None:
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one message per machine, not one per rank
        print(f"error: {e}", file=sys.stderr, flush=True)


def _task(dcfg: Any) -> None:
    _STATE["started"] = True
    try:
        from hydra.core.hydra_config import HydraConfig

        cfg = to_job_config(dcfg)
        output_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
        run(cfg, output_dir)
        _STATE["code"] = 0
    except ConfigError as e:
        _report_config_error(e)
        _STATE["code"] = 2
    except Exception:  # noqa: BLE001 - a real failure: show where, exit 1
        traceback.print_exc()
        sys.stderr.flush()
        _STATE["code"] = 1


def _quiet_other_ranks(argv: list[str]) -> list[str]:
    """Ranks other than 0 write no Hydra run directory and no log file: the run
    directory's name comes from the clock, which ranks may read a second apart."""
    if os.environ.get("RANK", "0") == "0" or any(a in ("-m", "--multirun") for a in argv):
        return argv
    return argv + ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.run.dir=."]


def main() -> None:
    """Entry point of ``python -m launch.train``; ends the process (Note [Reliable exit])."""
    import hydra

    register_configs()
    sys.argv = [sys.argv[0]] + _quiet_other_ranks(sys.argv[1:])
    hydra_main = hydra.main(version_base="1.3", config_path="../configs", config_name="config")(_task)
    try:
        hydra_main()
        code = _STATE["code"]
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code == 1 and not _STATE["started"]:
            code = 2  # Hydra could not compose the config (it printed why): bad input
    exit_now(code)


if __name__ == "__main__":
    main()
