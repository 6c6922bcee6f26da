"""The fits of ``benchmarks.studies.lightning_compare`` inside each torchrun rank (Note [Lightning on
a shaped link] in ``benchmarks.studies.lightning_compare``): a LightningModule around the repository's
GPT per mode, one ``Trainer.fit`` per mode and round timed by a Callback, the compute probe that
takes its turn in the same rounds, and rank 0's rows. Imports torch and Lightning; the command
line and the docs block do not."""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import lightning
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.compile import to_uncompiled

from .._torch_internals import BuiltinBuckets, inductor_cache_at, room_for_compiled_copies
from ..harness.cli import process_group
from ..harness.core import GPTJob, gather_rank0
from ..harness.limit import measure_comm
from ..harness.report import print0, write_json
from ..harness.rounds import interleaved_rounds
from ..harness.stats import median
from .lightning_modes import COMMAND_ENV, MODES, LightningMode, format_table, mode_rows

log = logging.getLogger(__name__)

__all__ = ["run_job"]


class LitGPT(pl.LightningModule):
    """The repository's GPT as a LightningModule, built from the job's seed (the same weights in every mode)."""

    def __init__(self, job: GPTJob):
        super().__init__()
        self.model, self.lr = job.new_model(), job.lr

    def forward(self, idx, targets):  # what CompiledDDPStrategy compiles: training_step calls self(...)
        return self.model(idx, targets)

    def training_step(self, batch, batch_idx):
        _, loss = self(*batch)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class StepClock(pl.Callback):
    """Times every step of a fit after the first ``skip``, on this rank's clock, with no barrier:
    (step, fwd, bwd, opt) seconds, split at ``on_before_backward`` and ``on_after_backward``."""

    def __init__(self, skip: int):
        self.skip, self.t, self.steps, self.losses = skip, {}, [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.t = {"start": time.perf_counter()}

    def on_before_backward(self, trainer, module, loss):
        self.t["fwd"] = time.perf_counter()

    def on_after_backward(self, trainer, module):
        self.t["bwd"] = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        end, t = time.perf_counter(), self.t
        self.losses.append(float(outputs["loss"]))
        if batch_idx >= self.skip:
            self.steps.append((end - t["start"], t["fwd"] - t["start"], t["bwd"] - t["fwd"], end - t["bwd"]))


@dataclass(frozen=True)
class _Job:
    gpt: GPTJob  # the model and the batches
    world: int
    local: int  # ranks per node (torchrun's LOCAL_WORLD_SIZE): the Trainer's devices


@dataclass
class _Runner:
    mode: LightningMode
    module: LitGPT
    step: int = 0  # steps taken: the next batch index
    fits: list = field(default_factory=list)  # per measured round: the fit's (step, fwd, bwd, opt) seconds
    losses: list = field(default_factory=list)
    bucket_mib: list | None = None  # ours: the plan's buckets (compiled.buckets), MiB each
    partitions: int | None = None  # the compiled graph's partitions (ours: one per bucket)
    alignment: float | None = None

    @property
    def label(self) -> str:
        return self.mode.name


def _fit(r: _Runner, job: _Job, steps: int, skip: int, backend: str, root: str) -> None:
    """One ``Trainer.fit`` of ``steps`` steps of runner ``r``; its measures kept when ``skip < steps``."""
    if r.mode.compiled:
        torch.compiler.reset()
    clock, builtin = StepClock(skip), BuiltinBuckets()
    strategy = r.mode.strategy(backend)
    trainer = pl.Trainer(accelerator="cpu", devices=job.local, num_nodes=job.world // job.local, strategy=strategy,
                         max_steps=steps, max_epochs=1, callbacks=[clock], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         num_sanity_val_steps=0, default_root_dir=root)
    batches = [job.gpt.batch_at(r.step + i) for i in range(steps)]
    idiom = r.mode.compiled and not r.mode.ours  # Lightning's own: torch.compile(model) given to fit
    model = torch.compile(r.module, backend=backend) if idiom else r.module
    with warnings.catch_warnings(), builtin.listening():
        for noise in (".*does not have many workers.*", r".*isinstance\(treespec, LeafSpec\).*"):
            warnings.filterwarnings("ignore", message=noise)
        trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    if idiom:
        to_uncompiled(r.module)
    r.step += steps
    if skip < steps:
        r.fits.append(clock.steps)
        r.losses.extend(clock.losses)
    compiled = getattr(strategy, "compiled", None)
    if compiled is not None:
        r.bucket_mib = [round(b.size / 2**20, 3) for b in compiled.buckets]
        r.partitions = len(r.bucket_mib)
        r.alignment = compiled.realignment.fraction if compiled.realignment is not None else None
    elif builtin.counts:
        r.partitions = builtin.counts[-1]  # PyTorch's splitter, as it logged its split


@dataclass
class _ComputeProbe:
    """The eager GPT's step with no DDP and no communication at all (the compute of a step), taking
    its turn in every round like a mode: ``steps`` plain steps on every rank, timed on rank 0."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    step: int = 0
    rounds: list = field(default_factory=list)  # per measured round: (step, fwd, bwd, opt) seconds of each step

    label = "compute"

    def run(self, job: _Job, steps: int, skip: int) -> None:
        measured = []
        for i in range(steps):
            x, y = job.gpt.batch_at(self.step)
            t0 = time.perf_counter()
            _, loss = self.model(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            end = time.perf_counter()
            self.step += 1
            if i >= skip:
                measured.append((end - t0, t1 - t0, t2 - t1, end - t2))
        if measured:
            self.rounds.append(measured)

    def columns(self) -> dict:
        """``compute_ms`` (the median over rounds of each round's median step) and its parts."""
        step, fwd, bwd, opt = (median([median([s[k] for s in r]) for r in self.rounds]) * 1e3 for k in range(4))
        return {"compute_ms": step, "compute_fwd_ms": fwd, "compute_bwd_ms": bwd, "compute_opt_ms": opt}


def _machine() -> str:
    name = platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()}-core CPU ({name})"


def _rows(runners: Sequence[_Runner], extra: dict, gathered: list) -> list[dict]:
    rows = mode_rows({r.label: [[s[0] for s in fit] for fit in r.fits] for r in runners})
    eager = "eager" if any(r.label == "eager" for r in runners) else None
    for row, r in zip(rows, runners):
        phases = {k: median([s[i] for fit in r.fits for s in fit]) * 1e3 for i, k in
                  ((1, "fwd_ms"), (2, "bwd_ms"), (3, "opt_ms"))}
        row.update(bucket_cap_mb=r.mode.bucket_cap_mb, **phases, buckets=r.partitions, bucket_mib=r.bucket_mib,
                   alignment=r.alignment,
                   loss_max_abs_diff=max(abs(a - b) for g in gathered for a, b in
                                         zip(g[r.label], g[eager])) if eager else None,
                   **extra)
    return rows


def run_job(args: argparse.Namespace) -> int:
    """Every round's fits on this rank; rank 0 writes the rows to ``args.out``. Returns 0."""
    loads = [os.getloadavg()[0]]
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one Trainer per fit: keep its banners out
    gpt = GPTJob(backend=args.backend, rounds=args.rounds, warmup=1, layers=args.layers, embd=args.embd)
    root = tempfile.mkdtemp(prefix="lightning-compare-")  # private (0700): Inductor's cache and Lightning's root
    try:
        with process_group("cpu", "lightning_compare"), room_for_compiled_copies(), \
                inductor_cache_at(os.path.join(root, "inductor")):
            job = _Job(gpt, dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            runners = [_Runner(MODES[m], LitGPT(gpt)) for m in args.modes]
            model = gpt.new_model()
            probe = _ComputeProbe(model, torch.optim.SGD(model.parameters(), lr=gpt.lr))
            print0(f"lightning_compare: {job.world} ranks, link {args.link_mbit:g} Mbit/s, modes {list(args.modes)}, "
                   f"1 warm-up + {args.rounds} rounds of {args.fit_warmup} + {args.steps} steps per fit")
            for order, measured, label in interleaved_rounds([*runners, probe], 1, args.rounds):
                for r in order:
                    steps = args.fit_warmup + (args.steps if measured else 0)
                    if r is probe:
                        probe.run(job, steps, args.fit_warmup)
                    else:
                        _fit(r, job, steps, args.fit_warmup, args.backend, root)
                loads.append(os.getloadavg()[0])
                last = {r.label: (r.rounds if r is probe else r.fits)[-1] for r in order if measured}
                print0(f"{label}: " + ", ".join(f"{k} {median([s[0] for s in v]) * 1e3:.0f}ms"
                                                for k, v in last.items()))
            nbytes = sum(p.numel() * p.element_size() for p in runners[0].module.parameters())
            comm_s = measure_comm(nbytes, torch.device("cpu"), lambda n: 0.0, repeats=5)
            gathered = gather_rank0({r.label: r.losses for r in runners})
            if gathered is not None:
                extra = dict(
                    comm_ms=comm_s * 1e3, **probe.columns(),
                    grad_mib=nbytes / 2**20, backend=args.backend, link_mbit=args.link_mbit, rounds=args.rounds,
                    steps=args.steps, fit_warmup=args.fit_warmup, model=gpt.model_label(), world_size=job.world,
                    torch=torch.__version__, lightning=lightning.__version__, date=datetime.date.today().isoformat(),
                    machine=_machine(), cpus=os.cpu_count(), loadavg=[round(x, 2) for x in loads],
                    command=os.environ.get(COMMAND_ENV, "python -m benchmarks.studies.lightning_compare"))
                rows = _rows(runners, extra, gathered)
                write_json(rows, args.out)
                print(format_table(rows), flush=True)
                print0(f"wrote {args.out}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0
