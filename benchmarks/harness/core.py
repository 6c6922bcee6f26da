"""The measuring core the interleaved DDP and FSDP benchmarks share (see Note
[Interleaved benchmark core]): the job's model and schedule, the mode table, the
runner every mode is measured through, the compile phase, the rounds, and the parts
of a result row that mean the same in both.

Note [Interleaved benchmark core]
---------------------------------
Background: on shared machines the same job's step time drifts widely between runs
(measured: docs/benchmarks/index.md), so absolute times from separate runs mean
nothing. Every mode is therefore built in the same job (same seed, so the same
initial weights; the same batches, step by step) and measured in turns.

Algorithm:

1. Build one runner per mode from a ``ModeTable`` (a mode is an object with a
   name, whether it compiles, and its own build; no ``if mode == ...``).
2. First steps (``first_steps``): time step 0 of every runner, compile included.
   ``cache=FRESH``: before each compiled runner, ``torch.compiler.reset()``, clear
   Inductor's in-process caches and point ``TORCHINDUCTOR_CACHE_DIR`` at a new
   directory of its own (a cold compile: without it the second compiled mode would
   hit the on-disk caches the first one filled, the blocks being the same code).
   ``cache=SAME``: one reset, then each compiled runner in its own directory again
   (what a restarted job with a warm on-disk cache pays). ``cache=None``: no
   reset, no directory. AOTAutograd / FX graph cache outcomes are counted per step.
3. Rounds (``measure_rounds``): ``warmup + rounds`` rounds over ``benchmarks.harness.rounds``;
   each round every runner in turn, the order rotating; the family's
   ``run_round`` times its steps. The first ``warmup`` rounds are dropped.
4. Rows: rank 0's clocks; losses and peak memory (and anything else per rank)
   gathered from all ranks (``runner_measures``). Ratios are medians of per-round
   ratios to a baseline runner, with the IQR; loss diff = max over ranks and steps
   of |loss - the uncompiled runner's|; compile seconds = first step minus the
   median step; peak MiB (CUDA only) = max over ranks and measured steps.

Notes: the job runs on its ``device`` (Note [Benchmark device] in
``benchmarks.harness.device``): on CUDA every mode's model is built on the CPU from the
seed and moved to the rank's GPU, batches are drawn on the CPU and moved, and the
families' clocks wait for the GPU (``device.clock``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

from launch.models import GPT, GPTConfig

from .._torch_internals import cache_counts, inductor_cache_at, room_for_compiled_copies
from .device import device_label
from .report import nan_to_none, print0
from .rounds import interleaved_rounds
from .stats import iqr, median, ratio_summary

__all__ = ["GPTJob", "Mode", "ModeTable", "Runner", "FRESH", "SAME", "first_steps", "measure_rounds", "measuring",
           "gather_rank0", "runner_measures", "Steps", "step_stats", "compile_seconds", "max_loss_diff", "max_peak_mib",
           "loss_reference", "job_columns"]

FRESH, SAME = "fresh", "same"  # first_steps' cache policies
MiB = 2**20


@dataclass(frozen=True)
class GPTJob:
    """The model (the repo's GPT) and the round schedule of an interleaved job; each
    family's config extends it with its modes and settings."""

    device: str = "cpu"  # "cpu" or "cuda", resolved (benchmarks.harness.device.resolve_device)
    backend: str = "inductor"
    warmup: int = 3
    rounds: int = 10
    batch: int = 8
    seq: int = GPTConfig.block_size  # the GPT's own sizes (launch.models.GPTConfig), but for the width
    vocab: int = GPTConfig.vocab_size
    layers: int = GPTConfig.n_layer
    embd: int = 256  # wider than the GPT's default: more gradient bytes per block for the link to carry
    heads: int = GPTConfig.n_head
    lr: float = 1e-2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(
                f"device {self.device!r}: a job runs on 'cpu' or 'cuda'. Resolve --device auto first "
                "(benchmarks.harness.device.resolve_device), or pass device='cpu'."
            )
        if self.rounds < 1 or self.warmup < 0:
            raise ValueError(
                f"--steps must be >= 1 and --warmup >= 0, got {self.rounds} and {self.warmup}: a benchmark needs "
                "at least one measured round. Pass --steps 1 or more and --warmup 0 or more."
            )

    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab, block_size=self.seq, n_layer=self.layers, n_head=self.heads,
                         n_embd=self.embd)

    @property
    def torch_device(self) -> torch.device:
        """This rank's device: the CPU, or the GPU that ``device.place_rank`` made current."""
        return torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")

    def new_model(self) -> GPT:
        """The GPT every mode starts from, on this rank's device: the same seed, so the same
        weights (built on the CPU, then moved, so a CUDA run starts where a CPU run does)."""
        torch.manual_seed(self.seed)
        return GPT(self.model_config()).to(self.torch_device)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of ``step`` on its device: the same for every mode (and
        the same values on CUDA as on the CPU: drawn from a CPU generator, then moved)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + dist.get_rank() * 10_007 + step)
        idx = torch.randint(self.vocab, (self.batch, self.seq + 1), generator=g).to(self.torch_device)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    def model_label(self) -> str:
        return (f"GPT(layers={self.layers}, embd={self.embd}, heads={self.heads}, vocab={self.vocab}, "
                f"seq={self.seq}), batch {self.batch}/rank")


class Mode(Protocol):
    """What the core needs of a mode; each family's modes add their own build."""

    name: str
    summary: str  # one line: what the mode runs
    compiled: bool  # compiled modes get the cache policy of ``first_steps`` and a compile time


M = TypeVar("M", bound=Mode)


class ModeTable(Generic[M]):
    """The modes of one benchmark family, by name (like dynamo's backend registry)."""

    def __init__(self, modes: Sequence[M], default: Sequence[str]) -> None:
        self._modes = {m.name: m for m in modes}
        self.default = tuple(default)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._modes)

    def __getitem__(self, name: str) -> M:
        self.check((name,))
        return self._modes[name]

    def describe(self, names: Sequence[str]) -> str:
        """One line per mode: its name and what it runs."""
        return "\n".join(f"  {name}: {self[name].summary}" for name in names)

    def check(self, names: Sequence[str]) -> None:
        """Raises ValueError naming the valid modes when ``names`` is empty or has an unknown one."""
        bad = [m for m in names if m not in self._modes]
        if bad or not names:
            raise ValueError(
                f"--modes {','.join(names)!s} has unknown or no modes {bad}: valid modes are "
                f"{', '.join(self._modes)}. Leave --modes out to run {','.join(self.default)}."
            )


@dataclass(kw_only=True)
class Runner:
    """One mode's model and what was measured of it; families add their own parts."""

    mode: Mode
    opt: torch.optim.Optimizer
    step: int = 0  # synchronised steps taken: the batch index
    losses: list[float] = field(default_factory=list)
    first_step_s: list[float] = field(default_factory=list)  # one per first_steps call
    cache_events: list[dict] = field(default_factory=list)  # compile-cache outcomes, one per first_steps call
    step_s: list[float] = field(default_factory=list)  # one per measured round
    peak_bytes: list[int] = field(default_factory=list)  # CUDA only: peak allocated, one per measured (sync) step
    cache_dir: str | None = None

    @property
    def label(self) -> str:
        return self.mode.name


R = TypeVar("R", bound=Runner)


def _new_cache_dir(r: Runner, tag: str, root: str | None) -> str:
    root = root or tempfile.gettempdir()
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{tag}-{r.label}-rank{dist.get_rank()}-", dir=root)


def first_steps(runners: Sequence[R], step: Callable[[R], float], *, phase: str, prefix: str = "",
                cache: str | None = None, tag: str = "bench", cache_root: str | None = None) -> None:
    """Time one step of every runner, compile included (step 2 of Note [Interleaved benchmark core]).

    Args:
        runners: in build order.
        step: runs one step of a runner and returns its seconds.
        phase: named in the progress line (``cold compile``, ``first step``, ...).
        prefix: put before every progress line (``[cap 4 MiB] ``).
        cache: FRESH, SAME or None, as in the Note.
        tag, cache_root: name prefix and parent of the fresh cache directories (default: tmp).
    """
    if cache == SAME:
        torch.compiler.reset()
    for r in runners:
        compiling = r.mode.compiled
        if compiling and cache == FRESH:
            torch.compiler.reset()
            r.cache_dir = _new_cache_dir(r, tag, cache_root)
        print0(f"{prefix}{phase}: {r.label}{' (compiling...)' if compiling else ''}", end=" ")
        before = cache_counts()
        with inductor_cache_at(r.cache_dir) if compiling and cache else contextlib.nullcontext():
            r.first_step_s.append(step(r))
        after = cache_counts()
        r.cache_events.append({k: after[k] - before[k] for k in after})
        hits = " ".join(f"{k}={v}" for k, v in r.cache_events[-1].items() if v)
        print0(f"{r.first_step_s[-1]:.1f} s" + (f" (cache: {hits})" if hits else ""))


def measure_rounds(runners: Sequence[R], warmup: int, rounds: int, run_round: Callable[[R, bool], float],
                   prefix: str = "") -> None:
    """The interleaved rounds; ``run_round(runner, measured)`` records what it measured
    (when ``measured``) and returns the step seconds shown in the progress line."""
    for order, measured, label in interleaved_rounds(runners, warmup, rounds):
        line = [f"{r.label} {run_round(r, measured) * 1e3:.0f}ms" for r in order]
        print0(f"{prefix}{label}: " + ", ".join(line))


@contextlib.contextmanager
def measuring(runners: Sequence[Runner]) -> Iterator[None]:
    """Room for several compiled copies of one model; the runners' cache directories
    removed at the end, whatever happens."""
    try:
        with room_for_compiled_copies():
            yield
    finally:
        for r in runners:
            if r.cache_dir:
                shutil.rmtree(r.cache_dir, ignore_errors=True)


def gather_rank0(mine: dict) -> list[dict] | None:
    """Every rank's ``mine``, in rank order, on rank 0; None on the other ranks."""
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine)
    return gathered if dist.get_rank() == 0 else None


def runner_measures(runners: Sequence[Runner]) -> dict:
    """What ``gather_rank0`` collects of every rank's runners: ``losses`` and ``peak_mib``
    (by label; None where no peak was measured, i.e. on the CPU)."""
    return {"losses": {r.label: r.losses for r in runners},
            "peak_mib": {r.label: max(r.peak_bytes) / MiB if r.peak_bytes else None for r in runners}}


@dataclass(frozen=True)
class Steps:
    """A runner's measured step seconds (median and quartiles), and its per-round ratio to
    a baseline (None without one)."""

    median_s: float
    q1_s: float
    q3_s: float
    ratio: float | None
    ratio_q1: float | None
    ratio_q3: float | None


def step_stats(step_s: Sequence[float], base_step_s: Sequence[float] | None) -> Steps:
    q1, q3 = iqr(step_s)
    ratio = ratio_summary(step_s, base_step_s) if base_step_s is not None else (None, None, None)
    return Steps(median(step_s), q1, q3, *(nan_to_none(x) for x in ratio))


def compile_seconds(first_s: float | None, step_s: float, compiled: bool) -> float | None:
    """First step minus the median step; 0 for an uncompiled mode, None when not measured."""
    if not compiled:
        return 0.0
    return max(first_s - step_s, 0.0) if first_s is not None else None


def loss_reference(runners: Sequence[Runner]) -> str | None:
    """The label of the uncompiled runner (eager), whose losses the others are checked against."""
    return next((r.label for r in runners if not r.mode.compiled), None)


def max_loss_diff(gathered: Sequence[dict], label: str, reference: str | None) -> float | None:
    """Max over ranks and steps of |loss of ``label`` - loss of ``reference``| (the
    ``losses`` entry of every rank's gathered dict); None without a reference."""
    if reference is None:
        return None
    return max(abs(a - b) for g in gathered for a, b in zip(g["losses"][label], g["losses"][reference]))


def max_peak_mib(gathered: Sequence[dict], label: str) -> float | None:
    """Max over ranks of ``label``'s peak MiB (the ``peak_mib`` entry of every rank's
    gathered dict); None where no rank measured one (the CPU)."""
    peaks = [g["peak_mib"][label] for g in gathered if g["peak_mib"].get(label) is not None]
    return max(peaks) if peaks else None


def job_columns(cfg: GPTJob) -> dict:
    """The row keys that describe the job rather than the mode."""
    return {"device": device_label(cfg.torch_device), "world_size": dist.get_world_size(), "rounds": cfg.rounds,
            "warmup": cfg.warmup, "model": cfg.model_label(), "torch": torch.__version__}
