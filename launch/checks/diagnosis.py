"""The launcher's side of the compile diagnosis (``diagnose=true``, ``python -m
launch.doctor``): a probe of the communication backward left exposed, the DDP
advice in the launcher's spelling, and the report of ``compiler.Diagnoser``.

``compiler.graph.diagnose`` reports what the compiler did; the DDP advice comes from
``ddp_opt.ddp_advice``, which writes each setting as :data:`OVERRIDE_SPELLING`
says: as an override of this job (``ddp.bucket_cap_mb=2``). It lives here rather
than in ``launch.doctor`` because the training loop's report phase uses it and
``launch.doctor`` imports the training loop.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from compiler import Diagnoser
from ddp_opt import ddp_advice

from ..config.schema import JobConfig
from ..observe.load import MachineLoad
from ..data.source import TokenSource
from ..runtime.dist import DistEnv, print0
from ..runtime.parallel import OVERRIDE_SPELLING, Wrapped
from ..runtime.precision import autocast

__all__ = ["OVERRIDE_SPELLING", "PROBE_ROUNDS", "Probe", "diagnose", "probe_exposed_comm"]

PROBE_ROUNDS = 5  # forward+backward with and without gradient sync, in turns: the median and the spread



def diagnose(diagnoser: Diagnoser, wrapped: Wrapped, data: TokenSource, cfg: JobConfig, env: DistEnv,
             median_step_ms: float, alignment: float | None) -> dict[str, Any]:
    """Print the diagnosis on rank 0 and return it as JSON-ready data.

    The diagnoser's window must be closed (``CompileCounter.snapshot``) first."""
    sizes = [b.size / 2**20 for b in reversed(wrapped.buckets()) if b.size]
    # micro-batches: the shape training compiled for (a full local batch would recompile under grad_accum)
    micro_batch = cfg.train.batch_size // env.world_size // cfg.train.grad_accum
    probe = probe_exposed_comm(wrapped, data, cfg, env, micro_batch)
    records = wrapped.partition_records()
    advice = ddp_advice(alignment=alignment, partition_mib=sizes or None, exposed_comm_ms=probe.exposed_ms,
                        compute_ms=probe.compute_ms, compile_s=diagnoser.compile_seconds(records),
                        step_s=median_step_ms / 1e3, spelling=OVERRIDE_SPELLING,
                        bucket_cap_mb=None if cfg.ddp.bucket_cap_mb == "auto" else cfg.ddp.bucket_cap_mb)
    note = MachineLoad.now().note()
    report = diagnoser.report(partitions=records, alignment=alignment, exposed_comm_ms=probe.exposed_ms,
                              compute_ms=probe.compute_ms, compute_range_ms=probe.compute_range_ms,
                              timing_notes=[note] if note else [], extra_advice=advice)
    print0("\n== compile diagnosis (rank 0) ==\n" + report.format())
    return json.loads(report.to_json())


@dataclass(frozen=True)
class Probe:
    """:func:`probe_exposed_comm`'s figures in ms: the medians, and the lowest and highest
    round of forward+backward without gradient sync; None without DDP."""

    exposed_ms: float | None = None
    compute_ms: float | None = None
    compute_range_ms: tuple[float, float] | None = None


def probe_exposed_comm(wrapped: Wrapped, data: TokenSource, cfg: JobConfig, env: DistEnv, micro_bs: int,
                       rounds: int = PROBE_ROUNDS) -> Probe:
    """Median forward+backward with and without DDP's gradient sync, in ms, on
    batches past the end of training, over ``rounds`` rounds (taken in turns, so that
    a busy moment weighs on both); gradients are zeroed and no optimizer step is
    taken, so the model is unchanged."""
    if wrapped.compiled_ddp is None:
        return Probe()
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
                with wrapped.backward_context():
                    loss.backward()
            times.append((time.perf_counter() - t0) * 1e3)
            ddp.zero_grad(set_to_none=True)
    sync_ms, nosync_ms = statistics.median(synced), statistics.median(unsynced)
    return Probe(max(sync_ms - nosync_ms, 0.0), nosync_ms, (min(unsynced), max(unsynced)))
