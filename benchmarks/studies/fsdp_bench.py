"""The interleaved FSDP2 benchmark, run inside each torchrun rank (see Note
[Interleaved FSDP benchmark]). ``run_fsdp`` builds and measures every mode and
returns rank 0's rows; ``fsdp_compare`` is the command line around it.

Note [Interleaved FSDP benchmark]
---------------------------------
Background and the shared schedule: Note [Interleaved benchmark core] in
``benchmarks.harness.core``.

Modes (``FSDP_MODES``), all ``fsdp_opt.apply`` on the repo's GPT:

- ``eager``: FSDP2, one shard unit per block, no compile, FSDP2's implicit prefetch.
- ``per_block``: each block compiled before sharding, one unit per block, FSDP2's
  implicit prefetch (``prefetch=0``): the usual torchtitan recipe.
- ``grouped`` (ours): per-block compile, consecutive blocks grouped into shard
  units of ``shard_unit_mb`` (Note [Shard unit grouping]) and explicit prefetch.
- ``eager_bf16``, ``per_block_bf16``, ``grouped_bf16``: the same three with the
  gradients reduce-scattered in bf16 (``MixedPrecisionPolicy(reduce_dtype=bf16)``,
  what ``fsdp.reduce_dtype=bf16`` sets).
- ``replicate_eager``, ``replicate_per_block``, ``replicate_grouped`` (ours): FSDP2's
  replicate (every parameter whole, each unit's gradients all-reduced) without
  compile, per-block compiled one unit per block (torchtitan's recipe), and
  per-block compiled with blocks grouped into units of ``shard_unit_mb``.
  ``replicate_whole``: ``torch.compile`` of the whole replicated model, as a user
  would write it.

Algorithm:

1. First steps: ``first_steps`` with a fresh Inductor cache directory per compiled
   mode. The blocks of all models share code objects, so a reset also drops the
   other modes' graphs; they recompile during the warmup rounds.
2. Rounds: each round runs one training step (forward, backward with FSDP's
   all-gathers and reduce-scatters, SGD step) per mode, a barrier before each.

Measured (rank 0's clocks; losses and memory from all ranks):

- step: wall time of the step; ratio vs per_block is the median of per-round
  ratios, with the IQR.
- peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` over the mode's
  measured steps (reset before each; the first, compiling step is left out):
  ``peak_mem_mib_per_rank`` per rank, ``peak_mib`` their max. On CPU there is no
  allocator counter per mode; ``peak_mem_mib_per_rank`` carries each rank's
  process RSS high-water mark (``ru_maxrss``) at the end, the same for every
  mode of the job, and ``peak_mib`` is None.
- loss_max_abs_diff: max over ranks and steps of |loss - eager's loss|.
- fwd, bwd, opt: the step split by clock reads after forward and backward.
  Unsharded copies of the model (``compute_runners``: eager and/or per-block
  compiled, no FSDP, no communication) take their turns in the same rounds;
  after the rounds one all-gather and one reduce-scatter (per reduce dtype) of all
  the parameter bytes, and for replicate one all-reduce, are timed over the job's
  link. Every row then gets its physical limit (sharded:
  ``max(fwd + bwd, 2 ag + rs, fwd + rs) + opt``; replicate:
  ``fwd + max(bwd, all-reduce) + opt``), ``step_over_limit`` and
  ``ratio_vs_best_peer`` (the fastest of ``limit.FSDP_PEER_MODES`` that reduces the
  same way; Note [Physical limit of a step] in ``benchmarks.harness.limit``).
- device: ``cuda: <GPU name>`` or ``cpu``.

On CUDA (Note [Benchmark device] in ``benchmarks.harness.device``): each rank runs on
``cuda:(LOCAL_RANK % GPUs)`` over NCCL (gloo when ranks share a GPU), the model
is built on the CPU from the seed and moved to the GPU before sharding, the mesh
is a CUDA mesh over all ranks, batches are drawn on the CPU and moved, and the
clock reads around a step follow ``torch.cuda.synchronize()``.

Notes: the simulated link of ``benchmarks.link.shaping`` is a DDP comm hook and does not
apply here: FSDP's collectives run over plain gloo (loopback on one machine) or
NCCL.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdp_opt

from ..harness.core import FRESH, GPTJob, ModeTable, Runner, compile_seconds, first_steps, gather_rank0, job_columns, \
    loss_reference, max_loss_diff, max_peak_mib, measure_rounds, measuring, runner_measures, step_stats
from ..harness.device import clock, peak_bytes, reset_peak
from ..harness.limit import FSDP_PEER_MODES, FSDPLimitParts, LimitParts, add_limit_columns, measure_comm, measure_fsdp_comm
from ..harness.report import print0
from ..harness.stats import median

__all__ = ["FSDPMode", "FSDP_MODES", "FSDPBenchConfig", "FSDPRunner", "build_runner", "compute_runners", "run_fsdp",
           "run_fsdp_memory"]

MiB = 2**20
BASELINE = "per_block"  # the mode the ratio column (ratio_vs_per_block) divides by, round by round


@dataclass(frozen=True)
class FSDPMode:
    """One way to shard (and compile) the GPT with ``fsdp_opt.apply``."""

    name: str
    summary: str
    compiled: bool
    grouped: bool = False  # blocks grouped into shard units of shard_unit_mb, explicit prefetch
    reduce_dtype: str = "fp32"  # "bf16": gradients reduced in bf16 (MixedPrecisionPolicy.reduce_dtype)
    replicate: bool = False  # FSDP2's replicate: nothing sharded, each unit's gradients all-reduced
    whole: bool = False  # torch.compile of the whole wrapped model in place of per-block compile
    strategy: str = "per_block"  # fsdp_opt's strategy: "traced" compiles the whole model, collectives inside

    def apply_kwargs(self, cfg: FSDPBenchConfig) -> dict:
        """``fsdp_opt.apply`` keywords of this mode."""
        compile = None
        if self.compiled:
            compile = fsdp_opt.FSDPCompileConfig(backend=cfg.backend, whole_model=True) if self.whole else cfg.backend
        if self.strategy == "traced":  # its units and prefetch planned from the link (shard_unit_mb="auto")
            kwargs = dict(compile=cfg.backend, strategy="traced")
            if self.reduce_dtype == "bf16":
                kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
            return kwargs
        kwargs = dict(compile=compile, prefetch=cfg.prefetch if self.grouped else 0, replicate=self.replicate)
        if self.grouped:
            kwargs["shard_unit_mb"] = cfg.shard_unit_mb
        if self.reduce_dtype == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
        return kwargs


FSDP_MODES: ModeTable[FSDPMode] = ModeTable([
    FSDPMode("eager", "FSDP2 without compile, one shard unit per block", compiled=False),
    FSDPMode("per_block", "each block compiled, one shard unit per block, FSDP2's implicit prefetch", compiled=True),
    FSDPMode("grouped", "per-block compile, blocks grouped into shard units, explicit prefetch", compiled=True,
             grouped=True),
    FSDPMode("traced", "the whole model compiled with FSDP's all-gathers and reduce-scatters in the graph, units "
             "planned from the link (strategy='traced')", compiled=True, strategy="traced"),
    FSDPMode("eager_bf16", "eager, gradients reduce-scattered in bf16", compiled=False, reduce_dtype="bf16"),
    FSDPMode("per_block_bf16", "per_block, gradients reduce-scattered in bf16", compiled=True, reduce_dtype="bf16"),
    FSDPMode("grouped_bf16", "grouped, gradients reduce-scattered in bf16", compiled=True, grouped=True,
             reduce_dtype="bf16"),
    FSDPMode("replicate_eager", "FSDP2's replicate without compile, one unit per block", compiled=False,
             replicate=True),
    FSDPMode("replicate_per_block", "replicate, each block compiled, one unit per block (torchtitan's recipe)",
             compiled=True, replicate=True),
    FSDPMode("replicate_whole", "replicate, then torch.compile of the whole replicated model", compiled=True,
             replicate=True, whole=True),
    FSDPMode("replicate_grouped", "replicate, per-block compile, blocks grouped into units of shard_unit_mb",
             compiled=True, grouped=True, replicate=True),
], default=("eager", "per_block", "grouped"))


@dataclass(frozen=True)
class FSDPBenchConfig(GPTJob):
    """What one FSDP benchmark job measures: the repo's GPT, 8 blocks of width 128
    (~0.76 MiB of float32 parameters each), grouped into ~2 MiB units, unless told otherwise."""

    warmup: int = 2
    layers: int = 8
    embd: int = 128
    modes: tuple[str, ...] = FSDP_MODES.default
    shard_unit_mb: float = 2.0
    prefetch: int = 1

    def __post_init__(self) -> None:
        FSDP_MODES.check(self.modes)
        super().__post_init__()
        if not self.shard_unit_mb > 0 or self.prefetch < 0:
            raise ValueError(
                f"--shard-unit-mb must be > 0 and --prefetch >= 0, got {self.shard_unit_mb} and {self.prefetch}: "
                "a shard unit needs a positive size and prefetch counts units ahead. Pass --shard-unit-mb 2 "
                "--prefetch 1 (the defaults), or --prefetch 0 for FSDP2's implicit prefetch."
            )


@dataclass(kw_only=True)
class FSDPRunner(Runner):
    """One mode's sharded model, optimizer, plan and measurements."""

    mode: FSDPMode
    model: nn.Module
    plan: fsdp_opt.FSDPPlan | None  # None: an unsharded compute reference (``compute_runners``)
    fwd_s: list[float] = field(default_factory=list)  # per measured round: forward,
    bwd_s: list[float] = field(default_factory=list)  # backward (FSDP's collectives included)
    opt_s: list[float] = field(default_factory=list)  # and the optimizer step


def compute_runners(cfg: FSDPBenchConfig) -> list[FSDPRunner]:
    """The unsharded copies of the model whose forward and backward, with no communication at
    all, are the compute of the physical limit (Note [Physical limit of a step] in
    ``benchmarks.harness.limit``): eager when an uncompiled mode runs, per-block compiled when a
    compiled one does."""
    out = []
    for compiled in sorted({FSDP_MODES[m].compiled for m in cfg.modes}):
        model = cfg.new_model()
        if compiled:
            for block in model.blocks:
                block.compile(backend=cfg.backend)
        mode = FSDPMode(f"unsharded_{'per_block' if compiled else 'eager'}", "no FSDP: the limit's compute", compiled)
        out.append(FSDPRunner(mode=mode, model=model, plan=None, opt=torch.optim.SGD(model.parameters(), lr=cfg.lr)))
    return out


def build_runner(name: str, cfg: FSDPBenchConfig) -> FSDPRunner:
    """Mode ``name`` on a new GPT (same seed for every mode, so the same weights) on this rank's device."""
    mode = FSDP_MODES[name]
    model = cfg.new_model()
    # The mesh's device is where FSDP2 keeps the shards: the job's, also when gloo carries the
    # collectives of ranks sharing a GPU (fsdp_opt's default mesh is CUDA only over NCCL).
    mesh = init_device_mesh("cuda", (dist.get_world_size(),)) if cfg.device == "cuda" else None
    plan = fsdp_opt.apply(model, mesh=mesh, **mode.apply_kwargs(cfg))
    return FSDPRunner(mode=mode, model=model, plan=plan, opt=torch.optim.SGD(model.parameters(), lr=cfg.lr))


def run_step(r: FSDPRunner, cfg: FSDPBenchConfig) -> tuple[tuple[float, float, float], int | None]:
    """One timed training step (forward, backward, SGD step): the seconds of its three parts and,
    on CUDA, the peak bytes allocated during it (None on the CPU)."""
    x, y = cfg.batch_at(r.step)
    dist.barrier()
    t0 = clock(x.device)
    reset_peak(x.device)
    _, loss = r.model(x, y)
    t1 = clock(x.device)
    loss.backward()
    t2 = clock(x.device)
    r.opt.step()
    t3 = clock(x.device)
    peak = peak_bytes(x.device)
    r.opt.zero_grad(set_to_none=True)
    r.losses.append(float(loss.detach()))
    r.step += 1
    return (t1 - t0, t2 - t1, t3 - t2), peak


def run_round(r: FSDPRunner, cfg: FSDPBenchConfig, measured: bool) -> float:
    """One step, its time, parts (and peak memory) kept when ``measured``; the step's seconds."""
    (fwd, bwd, opt), peak = run_step(r, cfg)
    if measured:
        r.step_s.append(fwd + bwd + opt)
        r.fwd_s.append(fwd)
        r.bwd_s.append(bwd)
        r.opt_s.append(opt)
        if peak is not None:
            r.peak_bytes.append(peak)
    return fwd + bwd + opt


def _rss_hwm_mib() -> float:
    """This process's resident-set high-water mark (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _row(r: FSDPRunner, cfg: FSDPBenchConfig, order: int, base: FSDPRunner | None, gathered: list[dict],
         reference: str | None) -> dict:
    steps = step_stats(r.step_s, base.step_s if base is not None else None)
    cuda = cfg.device == "cuda"
    peak = [g["peak_mib"][r.label] for g in gathered] if cuda else [g["rss_hwm_mib"] for g in gathered]
    return {
        "mode": r.mode.name,
        "backend": cfg.backend if r.mode.compiled else "eager",
        "reduce_dtype": r.mode.reduce_dtype,
        "replicate": r.mode.replicate,
        "transport": str(dist.get_backend()),  # no simulated link: FSDP's collectives as they are
        "step_ms_median": steps.median_s * 1e3,
        "ratio_vs_per_block": steps.ratio,
        "peak_mem_mib_per_rank": peak,
        "peak_mem_kind": "cuda max_memory_allocated" if cuda else "process RSS high-water mark (all modes)",
        "peak_mib": max_peak_mib(gathered, r.label),
        "loss_max_abs_diff": max_loss_diff(gathered, r.label, reference),
        **_unit_columns(r.plan),
        "compile_s": compile_seconds(r.first_step_s[0], steps.median_s, r.mode.compiled),
        "first_step_s": r.first_step_s[0],
        "mode_order": order,
        "fwd_ms": median(r.fwd_s) * 1e3,
        "bwd_ms": median(r.bwd_s) * 1e3,
        "opt_ms": median(r.opt_s) * 1e3,
        "step_ms_rounds": [t * 1e3 for t in r.step_s],
        "step_ms_q1": steps.q1_s * 1e3,
        "step_ms_q3": steps.q3_s * 1e3,
        "ratio_q1": steps.ratio_q1,
        "ratio_q3": steps.ratio_q3,
        **job_columns(cfg),
        "param_mib": sum(u.size for u in r.plan.units) / MiB + r.plan.root_bytes / MiB,
    }


def _unit_columns(plan: fsdp_opt.FSDPPlan) -> dict:
    """The units a mode ran with: FSDP2's shard units, or traced FSDP's planned units (the root apart),
    with the units kept gathered from forward to backward."""
    traced = plan.traced
    if traced is None:
        return {"units": len(plan.units), "unit_mib": [round(u.size / MiB, 3) for u in plan.units],
                "root_mib": round(plan.root_bytes / MiB, 3), "prefetch": plan.config.prefetch,
                "shard_unit_mb": plan.config.shard_unit_mb}
    blocks = traced.units[1:]
    return {"units": len(blocks), "unit_mib": [round(u.nbytes / MiB, 3) for u in blocks],
            "root_mib": round(traced.units[0].nbytes / MiB, 3), "prefetch": traced.prefetch,
            "shard_unit_mb": plan.config.shard_unit_mb, "kept_units": [u.name for u in blocks if not u.resharded],
            "plan_predicted_ms": traced.predicted_s * 1e3 if traced.predicted_s is not None else None,
            "plan": traced.table()}


def run_fsdp(cfg: FSDPBenchConfig) -> list[dict]:
    """Build, compile and measure every mode; rank 0 gets the rows, other ranks []."""
    torch.compiler.reset()
    runners = [build_runner(m, cfg) for m in cfg.modes]
    reference = compute_runners(cfg)
    with measuring(runners + reference):
        first_steps(runners + reference, lambda r: sum(run_step(r, cfg)[0]), phase="first step", cache=FRESH, tag="fsdpbench")
        measure_rounds(runners + reference, cfg.warmup, cfg.rounds, lambda r, measured: run_round(r, cfg, measured))
    nbytes = sum(p.numel() * p.element_size() for p in reference[0].model.parameters())
    comm = _measure_links(cfg, nbytes)  # on every rank, before the rows exist only on rank 0
    gathered = gather_rank0({**runner_measures(runners), "rss_hwm_mib": _rss_hwm_mib()})
    if gathered is None:
        return []
    base, losses = next((r for r in runners if r.label == BASELINE), None), loss_reference(runners)
    rows = [_row(r, cfg, order, base, gathered, losses) for order, r in enumerate(runners)]
    fwd_s, bwd_s = min(median(r.fwd_s) for r in reference), min(median(r.bwd_s) for r in reference)
    for replicated in (False, True):
        mine = [r for r in runners if r.mode.replicate == replicated]
        if not mine:
            continue
        opt_s = min(median(r.opt_s) for r in mine)
        if replicated:
            parts = LimitParts(fwd_s=fwd_s, bwd_s=bwd_s, opt_s=opt_s, comm_s=comm["all_reduce"])
            print0(f"physical limit, replicate {parts.limit_s * 1e3:.1f} ms = fwd {fwd_s * 1e3:.1f} + max(bwd "
                   f"{bwd_s * 1e3:.1f}, all-reduce {parts.comm_s * 1e3:.1f}) + opt {opt_s * 1e3:.1f}")
        else:
            parts = {dtype: FSDPLimitParts(fwd_s=fwd_s, bwd_s=bwd_s, opt_s=opt_s, ag_s=comm["all_gather"], rs_s=rs_s,
                                           rs_via=comm["reduce_scatter_via"][dtype])
                     for dtype, rs_s in comm["reduce_scatter"].items()}
            for dtype, p in parts.items():
                print0(f"physical limit, {dtype} {p.limit_s * 1e3:.1f} ms = max(fwd {fwd_s * 1e3:.1f} + bwd "
                       f"{bwd_s * 1e3:.1f}, 2 x all-gather {p.ag_s * 1e3:.1f} + reduce-scatter {p.rs_s * 1e3:.1f}, "
                       f"fwd + reduce-scatter) + opt {opt_s * 1e3:.1f} ({nbytes / MiB:.1f} MiB of parameters)")
        add_limit_columns([row for row in rows if row["replicate"] == replicated], parts, FSDP_PEER_MODES)
    return rows


def run_fsdp_memory(cfg: FSDPBenchConfig, mode: str) -> dict | None:
    """Mode ``mode`` alone in each rank's process: the most live tensor bytes over each of ``cfg.rounds``
    steps (forward, backward, optimizer step, zero_grad) after its compiling step and ``cfg.warmup``
    steps (Note [Interleaved FSDP benchmark]); rank 0 gets the columns, the most over ranks and steps."""
    from ..harness.heap_peak import HeapWindow

    torch.compiler.reset()
    heap = HeapWindow(cfg.torch_device)
    runner = build_runner(mode, cfg)
    peaks, heap_peaks = [], []
    for step in range(1 + cfg.warmup + cfg.rounds):
        heap.open()
        run_step(runner, cfg)
        if step > cfg.warmup and heap.measures:
            peaks.append(heap.peak())
            heap_peaks.append(heap.heap_peak())
    mine = {"peak_mib": max(peaks) / MiB if peaks else None,
            "heap_mib": max(h for h in heap_peaks) / MiB if heap_peaks and None not in heap_peaks else None}
    gathered = gather_rank0(mine)
    if gathered is None:
        return None
    per_rank = [g["peak_mib"] for g in gathered]
    return {"peak_mib": max(per_rank) if None not in per_rank else None, "peak_mem_mib_per_rank": per_rank,
            "peak_heap_mib": max((g["heap_mib"] for g in gathered if g["heap_mib"] is not None), default=None),
            "peak_mem_kind": ("cuda max_memory_allocated" if cfg.device == "cuda" else "live tensor bytes")
            + f", the mode alone in its process, {cfg.rounds} steps", "memory_rounds": cfg.rounds}


def _measure_links(cfg: FSDPBenchConfig, nbytes: int) -> dict:
    """The collectives of the limits the job's modes need, over the job's link (Note [Physical
    limit of a step]): one all-gather and one reduce-scatter per reduce dtype of the sharded
    modes, one all-reduce when a replicate mode ran; each of all ``nbytes``."""
    modes = [FSDP_MODES[m] for m in cfg.modes]
    repeats = max(3, min(cfg.rounds, 5))
    dtypes = sorted({m.reduce_dtype for m in modes if not m.replicate}, reverse=True)  # fp32 first
    out = {}
    if dtypes:
        out["all_gather"], out["reduce_scatter"], out["reduce_scatter_via"] = measure_fsdp_comm(
            nbytes, cfg.torch_device, repeats, dtypes)
    if any(m.replicate for m in modes):
        out["all_reduce"] = measure_comm(nbytes, cfg.torch_device, lambda n: 0.0, repeats)
    return out
