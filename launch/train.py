"""The main job: train a compiled DDP (or FSDP, or plain) model.

    torchrun --standalone --nproc-per-node 2 -m launch.train [overrides]
    python -m launch.train [overrides]                       # one process

``main`` is a thin Hydra shell: compose, convert to :class:`JobConfig`, call
:func:`run`, turn a :class:`ConfigError` into one message on stderr and exit
code 2. Tests call :func:`run` directly.
"""

from __future__ import annotations

import contextlib
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
from .parallel import Wrapped, apply_parallel, build_model
from compiler.diagnose import Diagnoser

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
    t = cfg.train
    print0(f"distcompile main job: {env.world_size} rank(s), {env.device.type} + {env.backend}")
    print0(describe(cfg))

    torch.manual_seed(t.seed)  # same initial weights on every rank
    model = build_model(cfg.model).to(env.device)
    n_params = sum(p.numel() for p in model.parameters())
    print0(f"model: {n_params / 1e6:.2f}M parameters")
    diagnoser = Diagnoser() if cfg.diagnose else None
    wrapped = apply_parallel(model, cfg, env, wrap_backend=diagnoser.wrap if diagnoser else None)
    optimizer = torch.optim.AdamW(wrapped.module.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    data = build_data(cfg.data, seed=t.seed, vocab_size=cfg.model.vocab_size)

    start = 0
    if t.resume or _restarted_by_torchrun():
        info = latest_checkpoint(t.checkpoint_dir)
        if info is not None:
            start = load_checkpoint(info, wrapped.module, optimizer)
            print0(f"resumed from {info.path} at step {start}")

    local_bs = t.batch_size // env.world_size
    tokens_per_step = t.batch_size * t.seq_len
    losses: list[tuple[int, float]] = []
    step_ms: list[float] = []
    checkpoints: list[str] = []
    first_step_s = None
    if diagnoser is not None:
        diagnoser.__enter__()
    for step in range(start + 1, t.steps + 1):
        _maybe_inject_fault(step, env.rank)
        torch.manual_seed(stream_seed(t.seed, env.rank, step))  # dropout etc.: a function of the step
        x, y = (v.to(env.device) for v in data.batch(step, env.rank, env.world_size, local_bs, t.seq_len))
        t0 = time.perf_counter()
        loss = _train_step(wrapped, optimizer, x, y)
        dist.all_reduce(loss)  # the logged loss: mean over ranks (also a sync point for timing)
        loss_value = loss.item() / env.world_size
        dt = time.perf_counter() - t0
        losses.append((step, loss_value))
        if step == start + 1:
            first_step_s = dt
            print0(f"first step took {dt:.1f}s" + (" (includes compile)" if cfg.compile.backend != "eager" else ""))
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
    alignment = _alignment(wrapped)
    if alignment is not None:
        print0(f"alignment: {alignment.fraction:.2f} of gradient bytes are in DDP buckets that hold exactly one "
               f"partition ({sum(alignment.aligned)} of {len(alignment.aligned)} runtime buckets)")
    diagnosis = None
    if diagnoser is not None:
        diagnoser.__exit__(None, None, None)
        sizes = [b.size / 2**20 for b in reversed(_buckets(wrapped)) if b.size]
        exposed_ms, compute_ms = _probe_exposed_comm(wrapped, data, cfg, env, local_bs)
        report = diagnoser.report(partitions=_records(wrapped), step_s=median_ms / 1e3,
                                  alignment=alignment.fraction if alignment is not None else None,
                                  partition_mib=sizes or None, exposed_comm_ms=exposed_ms, compute_ms=compute_ms,
                                  bucket_cap_mb=cfg.ddp.bucket_cap_mb)
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
        "tokens_per_s": tokens_per_step / (median_ms / 1e3) if median_ms else None,
        "wall_s": time.perf_counter() - t_start,
        "partitions": _partition_records(wrapped),
        "buckets": [{"size": b.size, "cap": b.cap, "params": list(b.params)} for b in _buckets(wrapped)],
        "checkpoints": checkpoints,
        "diagnosis": diagnosis,
        "alignment": alignment.fraction if alignment is not None else None,
        "config": asdict(cfg),
    }
    print0(
        f"done: steps {start + 1}..{t.steps}, final loss {metrics['final_loss']:.4f}, "
        f"median step {median_ms:.1f} ms, {metrics['tokens_per_s'] or 0:,.0f} tokens/s, "
        f"first step {first_step_s or 0:.1f}s, wall {metrics['wall_s']:.1f}s"
    )
    return metrics


def _train_step(wrapped: Wrapped, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _, loss = wrapped.forward(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().clone()


def _buckets(wrapped: Wrapped) -> list:
    return list(wrapped.compiled_ddp.buckets) if wrapped.compiled_ddp is not None else []


def _probe_exposed_comm(wrapped: Wrapped, data: Any, cfg: JobConfig, env: DistEnv, local_bs: int,
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
                                                      local_bs, cfg.train.seq_len))
        for sync, times in ((True, synced), (False, unsynced)):
            dist.barrier()
            t0 = time.perf_counter()
            with contextlib.nullcontext() if sync else ddp.no_sync():
                wrapped.forward(x, y)[1].backward()
            times.append((time.perf_counter() - t0) * 1e3)
            ddp.zero_grad(set_to_none=True)
    sync_ms, nosync_ms = statistics.median(synced), statistics.median(unsynced)
    return max(sync_ms - nosync_ms, 0.0), nosync_ms


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
