"""The interleaved FSDP2 benchmark, run inside each torchrun rank (see Note
[Interleaved FSDP benchmark]). ``run_fsdp`` builds and measures every mode and
returns rank 0's rows; ``fsdp_compare`` is the command line around it.

Note [Interleaved FSDP benchmark]
---------------------------------
Background: the same reasoning as Note [Interleaved DDP benchmark] in
``benchmarks.harness``: on a shared machine absolute times drift between runs, so
every mode is built in one job and the modes take turns, step by step.

Modes (same seed, so same initial weights; same batches, step by step), all
``fsdp_opt.apply`` on the repo's GPT:

- ``eager``: FSDP2, one shard unit per block, no compile, FSDP2's implicit prefetch.
- ``per_block``: each block compiled before sharding, one unit per block, FSDP2's
  implicit prefetch (``prefetch=0``): the usual torchtitan recipe.
- ``grouped`` (ours): per-block compile, consecutive blocks grouped into shard
  units of ``shard_unit_mb`` (Note [Shard unit grouping]) and explicit prefetch.

Algorithm:

1. Cold compile: for each mode in turn, ``torch._dynamo.reset()``, clear
   inductor's in-process caches, point ``TORCHINDUCTOR_CACHE_DIR`` at a fresh
   directory, and time step 0 (compile + one step): without that, the second
   compiled mode would hit the on-disk caches the first one filled (the blocks
   are the same code). The blocks of all models share code objects, so a reset
   also drops the other modes' graphs; they recompile during the warmup rounds.
2. Rounds: each round runs one training step (forward, backward with FSDP's
   all-gathers and reduce-scatters, SGD step) per mode, the order rotating each
   round, a barrier before each. The first ``warmup`` rounds are dropped.

Measured (rank 0's clocks; losses and memory from all ranks):

- step: wall time of the step; ratio vs per_block is the median of per-round
  ratios, with the IQR.
- peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` over the mode's
  measured steps (reset before each). On CPU there is no allocator counter per
  mode; the rows carry each rank's process RSS high-water mark
  (``ru_maxrss``) at the end, the same for every mode of the job.
- loss_max_abs_diff: max over ranks and steps of |loss - eager's loss|.

Notes: the simulated link of ``benchmarks.link`` is a DDP comm hook and does not
apply here: FSDP's collectives run over plain gloo (loopback on one machine) or
NCCL.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import fsdp_opt
from models import GPT, GPTConfig

from .rounds import interleaved_rounds
from .stats import iqr, median, ratio_summary

__all__ = ["FSDP_MODES", "FSDPBenchConfig", "FSDPRunner", "build_fsdp_mode", "run_fsdp", "print0"]

FSDP_MODES = ("eager", "per_block", "grouped")
COMPILED = ("per_block", "grouped")
MiB = 2**20


@dataclass(frozen=True)
class FSDPBenchConfig:
    """What one FSDP benchmark job measures: the repo's GPT, 8 blocks of width 128
    (~0.76 MiB of float32 parameters each), grouped into ~2 MiB units, unless told otherwise."""

    modes: tuple[str, ...] = FSDP_MODES
    backend: str = "inductor"
    shard_unit_mb: float = 2.0
    prefetch: int = 1
    warmup: int = 2
    rounds: int = 10
    batch: int = 8
    seq: int = 64
    vocab: int = 512
    layers: int = 8
    embd: int = 128
    heads: int = 4
    lr: float = 1e-2
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in FSDP_MODES]
        if bad or not self.modes:
            raise ValueError(
                f"--modes {','.join(self.modes)!s} has unknown or no modes {bad}: valid modes are "
                f"{', '.join(FSDP_MODES)}. Leave --modes out to run all three."
            )
        if self.rounds < 1 or self.warmup < 0:
            raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {self.rounds} and {self.warmup}.")
        if not self.shard_unit_mb > 0 or self.prefetch < 0:
            raise ValueError(
                f"--shard-unit-mb must be > 0 and --prefetch >= 0, got {self.shard_unit_mb} and {self.prefetch}."
            )

    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab, block_size=self.seq, n_layer=self.layers, n_head=self.heads, n_embd=self.embd)

    def apply_kwargs(self, mode: str) -> dict:
        """``fsdp_opt.apply`` keywords of a mode."""
        if mode == "eager":
            return dict(compile=None, prefetch=0)
        if mode == "per_block":
            return dict(compile=self.backend, prefetch=0)
        return dict(compile=self.backend, prefetch=self.prefetch, shard_unit_mb=self.shard_unit_mb)


def print0(*args, **kwargs) -> None:
    """Progress on rank 0 only, to stderr so stdout keeps just the table."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, file=sys.stderr, flush=True, **kwargs)


@dataclass
class FSDPRunner:
    """One mode's sharded model, optimizer, plan and measurements."""

    mode: str
    model: nn.Module
    opt: torch.optim.Optimizer
    plan: fsdp_opt.FSDPPlan
    step: int = 0
    losses: list[float] = field(default_factory=list)
    first_step_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)  # CUDA only


def build_fsdp_mode(mode: str, cfg: FSDPBenchConfig) -> FSDPRunner:
    """Same seed for every mode, so every mode starts from the same weights."""
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if _on_cuda() else torch.device("cpu")
    model = GPT(cfg.model_config()).to(device)
    plan = fsdp_opt.apply(model, **cfg.apply_kwargs(mode))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    return FSDPRunner(mode, model, opt, plan)


def _on_cuda() -> bool:
    return torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower()


def _batch(cfg: FSDPBenchConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + dist.get_rank() * 10_007 + step)
    idx = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    if _on_cuda():
        idx = idx.cuda()
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def run_step(r: FSDPRunner, cfg: FSDPBenchConfig) -> float:
    """One timed training step (forward, backward, SGD step); returns its seconds."""
    x, y = _batch(cfg, r.step)
    cuda = _on_cuda()
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    _, loss = r.model(x, y)
    loss.backward()
    r.opt.step()
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    r.opt.zero_grad(set_to_none=True)
    if cuda:
        r.peak_bytes.append(torch.cuda.max_memory_allocated())
    r.losses.append(float(loss.detach()))
    r.step += 1
    return dt


@contextlib.contextmanager
def _fresh_inductor_cache(mode: str):
    """A new, empty inductor cache dir (and cleared in-process caches) for one compile."""
    from torch._inductor.utils import clear_caches

    clear_caches()
    cache_dir = tempfile.mkdtemp(prefix=f"fsdpbench-{mode}-rank{dist.get_rank()}-")
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
        shutil.rmtree(cache_dir, ignore_errors=True)


def _compile_phase(runners: list[FSDPRunner], cfg: FSDPBenchConfig) -> None:
    for r in runners:
        compiled = r.mode in COMPILED
        if compiled:
            torch._dynamo.reset()
        print0(f"first step: {r.mode}{' (compiling, fresh cache...)' if compiled else ''}", end=" ")
        with _fresh_inductor_cache(r.mode) if compiled else contextlib.nullcontext():
            r.first_step_s = run_step(r, cfg)
        print0(f"{r.first_step_s:.1f} s")


def _measure(runners: list[FSDPRunner], cfg: FSDPBenchConfig) -> None:
    for order, measured, label in interleaved_rounds(runners, cfg.warmup, cfg.rounds):
        line = []
        for r in order:
            peaks = len(r.peak_bytes)
            step_s = run_step(r, cfg)
            line.append(f"{r.mode} {step_s * 1e3:.0f}ms")
            if measured:
                r.step_s.append(step_s)
            else:
                del r.peak_bytes[peaks:]
        print0(f"{label}: " + ", ".join(line))


def _rss_hwm_mib() -> float:
    """This process's resident-set high-water mark (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rows(runners: list[FSDPRunner], cfg: FSDPBenchConfig, gathered: list[dict]) -> list[dict]:
    by_mode = {r.mode: r for r in runners}
    base = by_mode.get("per_block")
    cuda = _on_cuda()
    rows = []
    for order, r in enumerate(runners):
        step = median(r.step_s)
        q1, q3 = iqr(r.step_s)
        ratio = ratio_summary(r.step_s, base.step_s) if base is not None else (None, None, None)
        loss_diff = None
        if "eager" in by_mode:
            loss_diff = max(abs(a - b) for g in gathered for a, b in zip(g["losses"][r.mode], g["losses"]["eager"]))
        compiled = r.mode in COMPILED
        peak = [g["peak_mib"][r.mode] for g in gathered] if cuda else None
        rows.append({
            "mode": r.mode,
            "backend": cfg.backend if compiled else "eager",
            "transport": str(dist.get_backend()),  # no simulated link: FSDP's collectives as they are
            "step_ms_median": step * 1e3,
            "ratio_vs_per_block": _nan_to_none(ratio[0]),
            "peak_mem_mib_per_rank": peak if cuda else [g["rss_hwm_mib"] for g in gathered],
            "peak_mem_kind": "cuda max_memory_allocated" if cuda else "process RSS high-water mark (all modes)",
            "loss_max_abs_diff": loss_diff,
            "units": len(r.plan.units),
            # extras
            "unit_mib": [round(u.size / MiB, 3) for u in r.plan.units],
            "root_mib": round(r.plan.root_bytes / MiB, 3),
            "prefetch": r.plan.config.prefetch,
            "shard_unit_mb": r.plan.config.shard_unit_mb,
            "compile_s": max(r.first_step_s - step, 0.0) if compiled else 0.0,
            "first_step_s": r.first_step_s,
            "mode_order": order,
            "step_ms_q1": q1 * 1e3,
            "step_ms_q3": q3 * 1e3,
            "ratio_q1": _nan_to_none(ratio[1]),
            "ratio_q3": _nan_to_none(ratio[2]),
            "world_size": dist.get_world_size(),
            "rounds": cfg.rounds,
            "warmup": cfg.warmup,
            "model": f"GPT(layers={cfg.layers}, embd={cfg.embd}, heads={cfg.heads}, vocab={cfg.vocab}, seq={cfg.seq}), batch {cfg.batch}/rank",
            "param_mib": sum(u.size for u in r.plan.units) / MiB + r.plan.root_bytes / MiB,
        })
    return rows


def _nan_to_none(x: float | None) -> float | None:
    return None if x is None or x != x else x


def run_fsdp(cfg: FSDPBenchConfig) -> list[dict]:
    """Build, compile and measure every mode; rank 0 gets the rows, other ranks []."""
    torch._dynamo.reset()
    runners = [build_fsdp_mode(m, cfg) for m in cfg.modes]
    # Several compiled copies of GPT's block share its code objects; leave room for them all.
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024):
        _compile_phase(runners, cfg)
        _measure(runners, cfg)
    mine = {
        "losses": {r.mode: r.losses for r in runners},
        "peak_mib": {r.mode: max(r.peak_bytes, default=0) / MiB for r in runners},
        "rss_hwm_mib": _rss_hwm_mib(),
    }
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine)
    return _rows(runners, cfg, gathered) if dist.get_rank() == 0 else []

