"""The interleaved DDP benchmark, run inside each torchrun rank (see Note [Interleaved
DDP benchmark]). ``run_cap`` measures every mode at one bucket cap and returns
rank 0's rows; ``ddp_compare`` is the command line around it.

Note [Interleaved DDP benchmark]
--------------------------------
Background: on shared 2-core machines the same eager job has shown medians from
313 to 562 ms per step across runs, so absolute times from separate runs mean
nothing. Every mode is therefore built in the same job and measured in turns.

Modes (same seed, so same initial weights; same batches, step by step):

- ``eager``: DDP, no compile.
- ``builtin``: ``torch.compile(ddp)`` with PyTorch's splitter (``optimize_ddp`` at
  its default).
- ``nosplit``: ``compile_ddp(ddp, split=False)``: compiled, no splitting at all.
- ``ours``: ``compile_ddp(ddp)``: split at DDP's real buckets.
- ``regional``: ``compile_ddp(ddp, regional=True)``: each transformer block
  compiled in place (one graph, reused by every block), the rest eager, DDP's
  buckets made of whole blocks (Note [Regional compile] in ``ddp_opt.regional``).

Every DDP model gets the simulated-link comm hook (Note [Simulated link]).

Algorithm, per bucket cap:

1. Cold compile: for each mode, ``torch._dynamo.reset()``, clear inductor's
   in-process caches, point ``TORCHINDUCTOR_CACHE_DIR`` at a fresh directory of
   its own, and time step 0 (compile + one step).
2. Warm compile: ``torch._dynamo.reset()`` once, then for each mode clear the
   in-process caches again and time step 1 with the *same* cache directory as
   its cold compile: what a restarted job with a warm on-disk cache pays (FX
   graph / AOTAutograd cache hits; partitions that skip those caches recompile).
   Compile seconds = first-step seconds minus the mode's median step; the
   AOTAutograd / FX graph cache hits and misses of both compiles are recorded.
3. Rounds: each round runs, for every mode in turn (the order rotates each
   round), one synchronised step (forward, backward with all-reduce, SGD step)
   and one ``no_sync`` step (forward, backward, no all-reduce, no SGD step).
   A barrier precedes every timed step so one rank never waits on the other's
   previous step. The first ``warmup`` rounds are dropped.

Measured (rank 0's clocks; losses from all ranks):

- step: wall time of the synchronised step; ratio vs builtin (or ``--baseline``) is the median of
  per-round ratios, with the IQR.
- compute: forward + backward under ``no_sync``; sync fb: forward + backward
  with all-reduce. exposed comm = median over rounds of (sync fb - compute),
  the two steps of a pair run back to back, so slow drifts of the machine cancel.
- comm: the link's modelled seconds for the buckets actually reduced (from the
  hook). overlap = (compute + comm - step) / min(compute, comm) with
  step = compute + exposed, i.e. (comm - exposed) / min(compute, comm).
- loss_max_abs_diff: max over ranks and synchronised steps of |loss - eager's
  loss at the same step|.
- recompiles: dynamo graphs compiled after the warm step.

Notes: ``no_sync`` steps leave the weights alone, so all modes stay in lockstep;
their gradients are dropped.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from compiler import resolve_backend
from ddp_opt import compile_ddp, measure_alignment
from models import GPT, GPTConfig

from .link import LinkModel, SimulatedLink
from .rounds import interleaved_rounds
from .stats import iqr, median, overlap_efficiency, ratio_summary

log = logging.getLogger(__name__)

__all__ = ["MODES", "BenchConfig", "ModeRunner", "run_cap", "print0", "cap_label"]

MODES = ("eager", "builtin", "nosplit", "ours", "regional")
DEFAULT_MODES = ("eager", "builtin", "nosplit", "ours")  # ddp_compare's default --modes
COMPILED = ("builtin", "nosplit", "ours", "regional")
PLANNED = ("ours", "regional")  # modes whose CompiledDDP has a bucket plan (.buckets)


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark job measures. The model is the repo's GPT at width 256 (~12.6 MiB of
    gradients) unless told otherwise."""

    modes: tuple[str, ...] = DEFAULT_MODES
    backend: str = "inductor"
    link: LinkModel = field(default_factory=LinkModel)
    caps: tuple[float | str, ...] = (1.0, 4.0, 25.0)  # "auto": ours with compile_ddp(bucket_cap_mb="auto")
    warmup: int = 3
    rounds: int = 10
    batch: int = 8
    seq: int = 64
    vocab: int = 512
    layers: int = 4
    embd: int = 256
    heads: int = 4
    lr: float = 1e-2
    seed: int = 0
    cache_root: str | None = None
    sweep: bool = False  # one interleaved phase over all (mode, cap) pairs (benchmarks.sweep)
    # The mode whose per-round steps the ratio column divides by; None: builtin when it runs.
    baseline: str | None = None

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(
                f"--modes {','.join(self.modes)!s} has unknown or no modes {bad}: valid modes are "
                f"{', '.join(MODES)}. Leave --modes out to run eager,builtin,nosplit,ours."
            )
        if self.baseline is not None and self.baseline not in self.modes:
            raise ValueError(
                f"--baseline {self.baseline} is not among --modes {','.join(self.modes)}: the ratio column divides "
                f"each mode's step time by the baseline's, round by round, so the baseline must run too. Add "
                f"{self.baseline} to --modes or pick --baseline from them."
            )
        if self.sweep and "regional" in self.modes:
            raise ValueError(
                "--sweep does not take the regional mode: a sweep varies the bucket cap, and regional compile's "
                "buckets are whole blocks. Run regional without --sweep (python -m benchmarks.ddp_compare "
                "--modes nosplit,ours,regional --baseline nosplit --layers 8)."
            )
        if "auto" in self.caps and not self.sweep:
            raise ValueError(
                "--caps auto needs --sweep: the auto plan is compared with fixed caps inside one interleaved phase "
                "(ours@auto next to ours@1, builtin@1, ...). Add --sweep, or drop auto from --caps."
            )
        numeric = [c for c in self.caps if c != "auto"]
        if "builtin" in self.modes and numeric and min(numeric) < 1:
            raise ValueError(
                f"--caps {','.join(cap_label(c) for c in self.caps)} has a cap below 1 MiB, which PyTorch's splitter "
                "rejects (its first bucket is 1 MiB and must not exceed the cap). Use caps >= 1, or drop "
                "builtin from --modes to sweep smaller caps."
            )
        if self.rounds < 1 or self.warmup < 0:
            raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {self.rounds} and {self.warmup}.")

    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab, block_size=self.seq, n_layer=self.layers, n_head=self.heads, n_embd=self.embd)


def cap_label(cap: float | str | None) -> str:
    """``4`` for 4.0 MiB, ``auto`` for the cost-model plan."""
    return str(cap) if isinstance(cap, str) or cap is None else f"{cap:g}"


def print0(*args, **kwargs) -> None:
    """Progress on rank 0 only, to stderr so stdout keeps just the table."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, file=sys.stderr, flush=True, **kwargs)


def _graphs_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


_CACHE_COUNTERS = {
    "aot_hit": ("aot_autograd", "autograd_cache_hit"),
    "aot_miss": ("aot_autograd", "autograd_cache_miss"),
    "aot_bypass": ("aot_autograd", "autograd_cache_bypass"),
    "fx_hit": ("inductor", "fxgraph_cache_hit"),
    "fx_miss": ("inductor", "fxgraph_cache_miss"),
    "fx_bypass": ("inductor", "fxgraph_cache_bypass"),
}


def _cache_counts() -> dict[str, int]:
    """AOTAutograd and FX graph cache outcomes so far (dynamo's global counters)."""
    counters = torch._dynamo.utils.counters
    return {k: int(counters[group][name]) for k, (group, name) in _CACHE_COUNTERS.items()}


class _BuiltinBuckets(logging.Handler):
    """Reads the bucket count PyTorch's DDPOptimizer logs at INFO when it splits."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "DDPOptimizer used bucket cap" in str(record.msg) and len(record.args or ()) >= 2:
            self.counts.append(int(record.args[1]))

    @contextlib.contextmanager
    def listening(self):
        logger = logging.getLogger("torch._dynamo.backends.distributed")
        old_level, old_handlers, old_propagate = logger.level, logger.handlers, logger.propagate
        # Only this handler, for this call: keeps the INFO line off torch's console handler.
        logger.handlers, logger.propagate = [self], False
        logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            logger.handlers, logger.propagate = old_handlers, old_propagate
            logger.setLevel(old_level)


@dataclass
class ModeRunner:
    """One mode's model, DDP wrapper, compiled callable, optimizer and measurements."""

    mode: str
    ddp: DDP
    fn: Callable
    opt: torch.optim.Optimizer
    cache_dir: str | None = None
    step: int = 0
    losses: list[float] = field(default_factory=list)
    first_step_s: list[float] = field(default_factory=list)  # [cold, warm]
    cache_events: list[dict] = field(default_factory=list)  # [cold, warm]: compile-cache outcomes
    step_s: list[float] = field(default_factory=list)  # sync step, per measured round
    sync_fb_s: list[float] = field(default_factory=list)
    nosync_fb_s: list[float] = field(default_factory=list)
    link_s: list[float] = field(default_factory=list)
    buckets_per_step: list[int] = field(default_factory=list)
    bucket_bytes: list[int] = field(default_factory=list)  # DDP's buckets in launch order, last sync step
    compiles: list[int] = field(default_factory=list)  # dynamo graphs compiled, per step
    builtin_log: _BuiltinBuckets | None = None
    cap: float | str | None = None  # set in a sweep, where one mode runs at several caps

    @property
    def label(self) -> str:
        """``ours@4``, ``ours@auto`` in a sweep; the mode alone otherwise."""
        return self.mode if self.cap is None else f"{self.mode}@{cap_label(self.cap)}"

    @property
    def partitions(self) -> int | None:
        if self.mode == "eager":
            return None
        if self.mode == "nosplit":
            return 1
        if self.mode == "ours":
            return len(self.fn.buckets) or 1
        if self.mode == "regional":
            return 1  # one block graph, compiled once, run by every block
        counts = self.builtin_log.counts if self.builtin_log else []
        return counts[-1] if counts else 1  # PyTorch logs nothing when it does not split


def build_mode(mode: str, cfg: BenchConfig, cap_mb: float | str, link: SimulatedLink,
               cost_model: object | None = None) -> ModeRunner:
    """Same seed for every mode, so every mode starts from the same weights. ``cost_model``
    (a ``ddp_opt.CostModel``): ours plans with it at cap auto and predicts with it at fixed caps."""
    auto = cap_mb == "auto"
    if auto and mode != "ours":
        raise ValueError(f"cap 'auto' is compile_ddp's cost-model plan; mode {mode!r} has no such option")
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config())
    ddp = DDP(model, bucket_cap_mb=None if auto else cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    runner = ModeRunner(mode, ddp, ddp, opt)
    if mode in PLANNED:
        # compile_ddp re-creates DDP's reducer to align its buckets with the
        # partitions; a hook registered through it survives that. With auto, the
        # link is measured through the same simulated link the gradients take.
        backend, more = cfg.backend, {}
        if mode == "regional":
            # A backend object of its own, as for builtin below: the blocks never run
            # another runner's compiled code.
            backend, more = functools.partial(resolve_backend(cfg.backend)), dict(regional=True)
        elif auto or cost_model is not None:
            more = dict(bucket_cap_mb="auto" if auto else None, link=cost_model if cost_model is not None else link.probe)
        runner.fn = compile_ddp(ddp, backend=backend, **more)
        runner.fn.register_comm_hook(link, SimulatedLink.hook)
        return runner
    ddp.register_comm_hook(link, SimulatedLink.hook)
    if mode == "builtin":
        # A backend object of its own: dynamo shares compiled code between model
        # instances (parameters are graph inputs) whenever the backends compare
        # equal, and torch's backend wrappers compare by settings. Without this a
        # second builtin runner at another cap would silently run the first one's
        # split graph (partitions planned for the first runner's cap).
        runner.fn = torch.compile(ddp, backend=functools.partial(resolve_backend(cfg.backend)))
        runner.builtin_log = _BuiltinBuckets()
    elif mode == "nosplit":
        runner.fn = compile_ddp(ddp, backend=cfg.backend, split=False)
    return runner


def _batch(cfg: BenchConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + dist.get_rank() * 10_007 + step)
    idx = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def run_step(r: ModeRunner, cfg: BenchConfig, link: SimulatedLink, *, sync: bool = True) -> tuple[float, float, object]:
    """One timed step: (step seconds, forward+backward seconds, link stats).

    ``sync=False`` is the ``no_sync`` compute step: no all-reduce, no SGD step.
    """
    x, y = _batch(cfg, r.step)
    dist.barrier()
    link.take_step_stats()
    graphs0 = _graphs_compiled()
    listen = r.builtin_log.listening() if r.builtin_log else contextlib.nullcontext()
    with listen:
        t0 = time.perf_counter()
        with contextlib.nullcontext() if sync else r.ddp.no_sync():
            _, loss = r.fn(x, y)
            loss.backward()
        t1 = time.perf_counter()
        if sync:
            r.opt.step()
        t2 = time.perf_counter()
    r.opt.zero_grad(set_to_none=True)
    stats = link.take_step_stats()
    r.compiles.append(_graphs_compiled() - graphs0)
    if sync:
        r.losses.append(float(loss.detach()))
        r.step += 1
    return t2 - t0, t1 - t0, stats


def _fresh_inductor_cache(r: ModeRunner, cfg: BenchConfig, cap_mb: float) -> None:
    root = cfg.cache_root or tempfile.gettempdir()
    os.makedirs(root, exist_ok=True)
    r.cache_dir = tempfile.mkdtemp(prefix=f"ddpbench-{r.mode}-cap{cap_mb:g}-rank{dist.get_rank()}-", dir=root)


@contextlib.contextmanager
def _inductor_cache(r: ModeRunner):
    """Point inductor at the mode's cache dir, with in-process caches cleared."""
    from torch._inductor.utils import clear_caches

    clear_caches()
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = r.cache_dir
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def _compile_phase(runners: list[ModeRunner], cfg: BenchConfig, link: SimulatedLink, cap_mb: float, kind: str) -> None:
    if kind == "warm":
        torch._dynamo.reset()
    for r in runners:
        compiled = r.mode in COMPILED
        if compiled and kind == "cold":
            torch._dynamo.reset()
            _fresh_inductor_cache(r, cfg, cap_mb)
        print0(f"[cap {cap_mb:g} MiB] {kind} compile: {r.mode}{' (compiling...)' if compiled else ''}", end=" ")
        ctx = _inductor_cache(r) if compiled else contextlib.nullcontext()
        before = _cache_counts()
        with ctx:
            r.first_step_s.append(run_step(r, cfg, link)[0])
        after = _cache_counts()
        r.cache_events.append({k: after[k] - before[k] for k in after})
        hits = " ".join(f"{k}={v}" for k, v in r.cache_events[-1].items() if v)
        print0(f"{r.first_step_s[-1]:.1f} s" + (f" (cache: {hits})" if hits else ""))


def _measure(runners: list[ModeRunner], cfg: BenchConfig, link: SimulatedLink, cap_mb: float) -> None:
    for order, measured, label in interleaved_rounds(runners, cfg.warmup, cfg.rounds):
        line = []
        for r in order:
            step_s, sync_fb, stats = run_step(r, cfg, link, sync=True)
            _, nosync_fb, _ = run_step(r, cfg, link, sync=False)
            line.append(f"{r.label} {step_s * 1e3:.0f}ms")
            if measured:
                r.step_s.append(step_s)
                r.sync_fb_s.append(sync_fb)
                r.nosync_fb_s.append(nosync_fb)
                r.link_s.append(stats.link_s)
                r.buckets_per_step.append(stats.buckets)
                r.bucket_bytes = list(stats.sizes)
        prefix = "[sweep]" if cap_mb == "sweep" else f"[cap {cap_label(cap_mb)} MiB]"
        print0(f"{prefix} {label}: " + ", ".join(line))


def _nan_to_none(x: float | None) -> float | None:
    return None if x is None or x != x else x


def _alignment(r: ModeRunner) -> float | None:
    """Fraction of gradient bytes whose runtime DDP bucket is exactly one partition
    (ours: its plan; nosplit: the whole graph). None for eager (no partitions) and
    builtin (PyTorch's splitter keeps its plan to itself)."""
    if r.mode not in ("ours", "nosplit", "regional"):
        return None
    measured = measure_alignment(r.ddp, r.fn.buckets if r.mode in PLANNED else None)
    return measured.fraction if measured is not None else None


def _rows(runners: list[ModeRunner], cfg: BenchConfig, cap_mb: float, all_losses: list[dict]) -> list[dict]:
    by_mode = {r.mode: r for r in runners}
    eager = "eager" if "eager" in by_mode else None
    return [row_for(r, cfg, cap_mb, order, by_mode.get(cfg.baseline or "builtin"), all_losses, eager)
            for order, r in enumerate(runners)]


def _prediction(r: ModeRunner) -> dict:
    """The cost model's prediction (ours with cap auto), flattened for the row."""
    pred = getattr(r.fn, "prediction", None) if r.mode == "ours" else None
    if pred is None:
        return {"predicted_backward_ms": None, "predicted_exposed_comm_ms": None, "predicted_comm_ms": None,
                "predicted_link": None}
    return {
        "predicted_backward_ms": pred.backward_s * 1e3,
        "predicted_exposed_comm_ms": pred.exposed_s * 1e3,
        "predicted_comm_ms": sum(pred.link.transfer_s(b.nbytes) for b in pred.buckets) * 1e3,
        "predicted_link": f"{pred.link.alpha_s * 1e3:.3g}ms,{pred.link.bandwidth / 1e6:.4g}MB/s",
    }


def row_for(r: ModeRunner, cfg: BenchConfig, cap_mb: float | str, order: int, base: ModeRunner | None,
            all_losses: list[dict], eager_key: str | None) -> dict:
    """One result row. ``all_losses``: per rank, losses keyed by runner label; ``base``: the runner
    whose per-round steps the ratio is taken against (None: no ratio)."""
    step = median(r.step_s)
    q1, q3 = iqr(r.step_s)
    ratio = ratio_summary(r.step_s, base.step_s) if base is not None else (None, None, None)
    compute, sync_fb, comm = median(r.nosync_fb_s), median(r.sync_fb_s), median(r.link_s)
    exposed = median([s - c for s, c in zip(r.sync_fb_s, r.nosync_fb_s)])
    loss_diff = None
    if eager_key is not None:
        loss_diff = max(abs(a - b) for losses in all_losses for a, b in zip(losses[r.label], losses[eager_key]))
    compiled = r.mode in COMPILED
    first = r.first_step_s + [None] * (2 - len(r.first_step_s))
    cold = max(first[0] - step, 0.0) if compiled and first[0] is not None else (0.0 if not compiled else None)
    warm = max(first[1] - step, 0.0) if compiled and first[1] is not None else (0.0 if not compiled else None)
    events = r.cache_events + [None] * (2 - len(r.cache_events))
    return {
        "mode": r.mode,
        "backend": cfg.backend if compiled else "eager",
        "link": cfg.link.label,
        "bucket_cap_mb": cap_mb,
        "step_ms_median": step * 1e3,
        "ratio_vs_builtin": _nan_to_none(ratio[0]),
        "overlap": _nan_to_none(overlap_efficiency(compute, comm, compute + exposed)) if cfg.link.enabled else None,
        "compile_s": cold,
        "partitions": r.partitions,
        "loss_max_abs_diff": loss_diff,
        "alignment": _alignment(r),
        # extras
        "runner": r.label,
        "ratio_baseline": base.label if base is not None else None,
        "mode_order": order,
        "step_ms_q1": q1 * 1e3,
        "step_ms_q3": q3 * 1e3,
        "step_ms_rounds": [t * 1e3 for t in r.step_s],
        "ratio_q1": _nan_to_none(ratio[1]),
        "ratio_q3": _nan_to_none(ratio[2]),
        "compile_cold_s": cold,
        "compile_warm_s": warm,
        "first_step_cold_s": first[0],
        "first_step_warm_s": first[1],
        "compute_ms": compute * 1e3,
        "sync_fb_ms": sync_fb * 1e3,
        "comm_ms": comm * 1e3,
        "exposed_comm_ms": exposed * 1e3,
        **_prediction(r),
        "ddp_buckets": int(median(r.buckets_per_step)),
        "recompiles": sum(r.compiles[len(r.first_step_s):]),  # after the compile step(s)
        "cold_cache": events[0],
        "warm_cache": events[1],
        "ddp_bucket_mib": [round(b / 2**20, 3) for b in r.bucket_bytes],
        "plan_bucket_mib": [round(b.size / 2**20, 3) for b in reversed(r.fn.buckets)] if r.mode in PLANNED else None,
        "world_size": dist.get_world_size(),
        "rounds": cfg.rounds,
        "warmup": cfg.warmup,
        "model": f"GPT(layers={cfg.layers}, embd={cfg.embd}, heads={cfg.heads}, vocab={cfg.vocab}, seq={cfg.seq}), batch {cfg.batch}/rank",
        "grad_mib": sum(p.numel() * p.element_size() for p in r.ddp.module.parameters()) / 2**20,
    }


def run_cap(cfg: BenchConfig, cap_mb: float, link: SimulatedLink) -> list[dict]:
    """Build, compile and measure every mode at one bucket cap; rank 0 gets the rows."""
    torch._dynamo.reset()
    runners = [build_mode(m, cfg, cap_mb, link) for m in cfg.modes]
    try:
        # Several compiled copies of GPT share its code objects; leave room for them all.
        with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024):
            _compile_phase(runners, cfg, link, cap_mb, "cold")
            _compile_phase(runners, cfg, link, cap_mb, "warm")
            _measure(runners, cfg, link, cap_mb)
        losses = {r.label: r.losses for r in runners}
        gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(gathered, losses)
        return _rows(runners, cfg, cap_mb, gathered) if dist.get_rank() == 0 else []
    finally:
        for r in runners:
            if r.cache_dir:
                shutil.rmtree(r.cache_dir, ignore_errors=True)
