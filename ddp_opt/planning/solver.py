"""Cost-model bucket plan: choose bucket boundaries by dynamic programming to
minimise the predicted end of gradient communication. Pure: cost tables in, plan
out; nothing is measured or run here (``ddp_opt.planning.cost`` measures).

Note [Cost-model bucket plan]

Background
    A fixed bucket cap is a guess: small buckets start communication early but pay the
    link latency (and a graph break) per bucket; large ones leave the last transfer
    exposed after backward. The best split depends on the link and on how backward time
    is spread over the model (MG-WFBP; the PyTorch DDP paper's U-shaped curve).

Algorithm
    - Units: the finest legal split, ``plan_buckets`` with a 1-byte cap. Every plan
      ``plan_buckets`` can make is a merge of consecutive units, so the legality rules
      stay in ``planning/buckets.py`` alone.
    - Bucket ``k`` over units ``j..i`` is ready at ``R(i, k) = sum(c_0..c_i) + k * gamma
      + kappa * B(0..j-1)`` (``gamma``: one graph break; ``kappa``: the CPU the
      collective takes from backward, 0 unless calibrated, Note [Calibration from a
      measured backward]). One serial link: ``finish_k = max(R, finish_{k-1}) + alpha +
      bytes / beta``.
    - ``F[k][i] = min_j max(F[k-1][j], R(i, k)) + alpha + B(j+1..i)/beta``; exact, as a
      bucket's finish is monotone in the previous one's. Answer ``min_k F[k][n-1]``;
      ties go to fewer buckets. Bucket k's cap is its bytes.
    - Compression in a reducer hook (PowerSGD under split, whole, regional): each bucket's
      power iteration runs on the rank's cores while backward runs, so every bucket sent
      before bucket k delays k's readiness by ``HookCompute.fixed_s + bytes *
      s_per_byte``: the same form as ``gamma`` and ``kappa``, added to them. The hook's
      compute also delays its own send; the link probe sends as the hook does, compute
      included, so that part is already in ``alpha`` and ``beta``.
    - A hook that computes on the very cores backward runs on (``HookCompute.shares_cores``:
      CPU buckets, one core per rank) gets one bucket from ``solve_table`` (``"auto"``), not
      the DP's plan. There the model's bucket times, from a probe that sends one matrix per
      bucket with the ranks in step and nothing else running, come out several times shorter
      than the hooks take in a step, and the hooks run in series on one worker thread, so one
      that overruns delays the next: the DP's plans of 2 or 3 buckets measured slower than one
      bucket. Running each bucket's stages on backward's own thread instead, as the traced
      strategy does, did not win either: it cost more than one bucket even on a link with
      nothing to hide, so on this CPU a bucket costs more than its overlap saves. The
      profiles and the measured ratios are in docs/compression.md. On a GPU the hook runs on
      its own stream: the DP plans.
    - Robustness (``solve_robust``, what ``"auto"`` uses): the backward estimate can be
      off by a constant factor, and where communication dominates the exact optimum is
      indifferent to a huge last bucket that a slower backward exposes. So the DP is
      solved for the estimate scaled over a range of factors and the candidate with the
      least worst-case regret wins.

Notes
    - The objective, the last all-reduce's finish, is when the optimizer can start.
    - ``simulate`` predicts any plan, fixed caps included, with the same model.
    - ``plan_auto`` solves over chunks of at least ``CostModel.min_bucket_bytes``, the
      first chunk alone: over single units the DP can choose buckets far below DDP's
      first bucket, whose costs (per-collective overhead, per-partition calls) the
      model does not see (measured: docs/ddp.md, docs/benchmarks/reading.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from compiler.ranks import LinkEstimate

__all__ = [
    "HookCompute", "NO_HOOK_COMPUTE", "LinkEstimate", "UnitCost", "BucketTiming", "Timeline", "solve", "solve_robust",
    "simulate", "format_timeline", "DEFAULT_SCALES",
]


@dataclass(frozen=True)
class HookCompute:
    """What a bucket's comm hook computes on the rank's cores, taken from backward while it
    runs: ``fixed_s + nbytes * s_per_byte`` seconds for a bucket of ``nbytes`` gradient bytes
    (PowerSGD's power iteration, Note [Cost-model bucket plan])."""

    fixed_s: float = 0.0
    s_per_byte: float = 0.0
    shares_cores: bool = False  # it runs on backward's own cores (CPU buckets): "auto" makes one bucket

    def __post_init__(self) -> None:
        if not (self.fixed_s >= 0 and self.s_per_byte >= 0):
            raise ValueError(f"HookCompute(fixed_s={self.fixed_s!r}, s_per_byte={self.s_per_byte!r}): both must be "
                             ">= 0 (seconds per bucket and per gradient byte); HookCompute() is a hook that "
                             "computes nothing.")


NO_HOOK_COMPUTE = HookCompute()


@dataclass(frozen=True)
class UnitCost:
    """One unit of the finest legal split, in gradient-ready order."""

    backward_s: float
    nbytes: int


@dataclass(frozen=True)
class BucketTiming:
    """Predicted timing of one bucket (seconds from the start of backward)."""

    units: int
    nbytes: int
    ready_s: float
    start_s: float
    finish_s: float


@dataclass(frozen=True)
class Timeline:
    """A plan's predicted backward + communication timeline.

    Attributes:
        buckets: per bucket in gradient-ready order.
        backward_s: predicted end of backward (graph-break costs included).
        finish_s: predicted end of the last all-reduce.
        link: the link the prediction used.
        gamma_s: the per-partition overhead used.
        contention_s_per_byte: the CPU contention used (``simulate``).
        hook: the comm hook's compute used (``simulate``).
    """

    buckets: tuple[BucketTiming, ...]
    backward_s: float
    finish_s: float
    link: LinkEstimate
    gamma_s: float = 0.0
    extra: dict = field(default_factory=dict, compare=False)  # e.g. regret, scales (solve_robust)
    units: tuple[UnitCost, ...] = field(default=(), compare=False, repr=False)  # the table simulated
    contention_s_per_byte: float = 0.0  # backward seconds each byte sent before a bucket's readiness adds
    hook: HookCompute = NO_HOOK_COMPUTE

    @property
    def counts(self) -> tuple[int, ...]:
        """Units per bucket, gradient-ready order (``simulate``'s ``counts``)."""
        return tuple(b.units for b in self.buckets)

    @property
    def exposed_s(self) -> float:
        """Communication left after backward: the step's comm tail."""
        return self.finish_s - self.backward_s

    @property
    def caps(self) -> tuple[int, ...]:
        """Per-bucket byte caps in gradient-ready order (``BucketCaps.per_bucket_caps``)."""
        return tuple(max(1, b.nbytes) for b in self.buckets)

    def as_dict(self) -> dict:
        return {
            "link_alpha_ms": self.link.alpha_s * 1e3, "link_bandwidth_MBps": self.link.bandwidth / 1e6,
            "link_source": self.link.source, "gamma_ms": self.gamma_s * 1e3,
            "contention_ms_per_mib": self.contention_s_per_byte * 2**20 * 1e3,
            "hook_fixed_ms": self.hook.fixed_s * 1e3, "hook_ms_per_mib": self.hook.s_per_byte * 2**20 * 1e3,
            "predicted_backward_ms": self.backward_s * 1e3, "predicted_finish_ms": self.finish_s * 1e3,
            "predicted_exposed_comm_ms": self.exposed_s * 1e3,
            "buckets": [
                {"units": b.units, "mib": b.nbytes / 2**20, "ready_ms": b.ready_s * 1e3, "start_ms": b.start_s * 1e3,
                 "finish_ms": b.finish_s * 1e3} for b in self.buckets
            ],
            **self.extra,
        }


def simulate(units: Sequence[UnitCost], counts: Sequence[int], link: LinkEstimate, gamma_s: float = 0.0,
             contention: float = 0.0, hook: HookCompute = NO_HOOK_COMPUTE) -> Timeline:
    """The timeline of the plan that puts ``counts[k]`` consecutive units in bucket k.

    Args:
        units: per-unit costs in gradient-ready order.
        counts: units per bucket in gradient-ready order; must sum to ``len(units)``.
        link: the link model.
        gamma_s: seconds each partition after the first adds to backward.
        contention: seconds of backward each byte of the earlier buckets adds (the CPU the
            collective takes from backward while it runs; 0: none). ``backward_s`` stays the
            backward without communication, so ``exposed_s`` includes it.
        hook: the comm hook's compute per bucket; each earlier bucket's delays a bucket's
            readiness as ``gamma_s`` and ``contention`` do, and ``exposed_s`` includes it.
    """
    if sum(counts) != len(units) or any(c <= 0 for c in counts):
        raise ValueError(f"bucket unit counts {list(counts)} do not cover the {len(units)} units exactly")
    timings, done, compute, free, sent = [], 0, 0.0, 0.0, 0
    for k, c in enumerate(counts):
        chunk = units[done:done + c]
        done += c
        compute += sum(u.backward_s for u in chunk)
        nbytes = sum(u.nbytes for u in chunk)
        ready = compute + k * (gamma_s + hook.fixed_s) + (contention + hook.s_per_byte) * sent
        start = max(ready, free)
        free = start + link.transfer_s(nbytes)
        sent += nbytes
        timings.append(BucketTiming(c, nbytes, ready, start, free))
    backward = compute + (len(counts) - 1) * gamma_s
    return Timeline(tuple(timings), backward, free, link, gamma_s, units=tuple(units), contention_s_per_byte=contention,
                    hook=hook)


def solve(units: Sequence[UnitCost], link: LinkEstimate, gamma_s: float = 0.0, max_buckets: int | None = None,
          first: int | None = None, contention: float = 0.0, hook: HookCompute = NO_HOOK_COMPUTE) -> Timeline:
    """The plan (a merge of consecutive units) with the least predicted finish.

    Args:
        units: per-unit costs in gradient-ready order (at least one).
        link: the link model.
        gamma_s: seconds each extra partition adds to backward.
        max_buckets: an upper bound on the number of buckets (default: one per unit).
        first: the first bucket holds exactly this many units (default: the DP chooses).
        contention, hook: as in ``simulate``.

    Returns:
        The optimal plan's :class:`Timeline` (``caps`` gives its per-bucket caps).
    """
    n = len(units)
    if n == 0:
        raise ValueError("solve needs at least one unit")
    if first is not None and not 1 <= first <= n:
        raise ValueError(f"solve(first={first}): the first bucket must hold between 1 and the {n} units")
    kmax = min(n, max_buckets or n)
    cum_c = [0.0]
    cum_b = [0]
    for u in units:
        cum_c.append(cum_c[-1] + u.backward_s)
        cum_b.append(cum_b[-1] + u.nbytes)
    inf = float("inf")
    # F[k][i]: least finish with units 0..i in k+1 buckets; P[k][i]: end of bucket k-1.
    F = [[inf] * n for _ in range(kmax)]
    P = [[-1] * n for _ in range(kmax)]
    for i in range(n):
        if first is None or i == first - 1:
            F[0][i] = cum_c[i + 1] + link.transfer_s(cum_b[i + 1])
    for k in range(1, kmax):
        prev, row, back = F[k - 1], F[k], P[k]
        for i in range(k, n):
            ready = cum_c[i + 1] + k * (gamma_s + hook.fixed_s)
            best, arg = inf, -1
            for j in range(k - 1, i):
                f = (max(prev[j], ready + (contention + hook.s_per_byte) * cum_b[j + 1]) + link.alpha_s
                     + (cum_b[i + 1] - cum_b[j + 1]) / link.bandwidth)
                if f < best:
                    best, arg = f, j
            row[i], back[i] = best, arg
    # Fewest buckets among the (numerically) best.
    best_k = min(range(kmax), key=lambda k: (round(F[k][n - 1], 12), k))
    ends, i = [], n - 1
    for k in range(best_k, -1, -1):
        ends.append(i)
        i = P[k][i]
    ends.reverse()
    counts = [ends[0] + 1] + [b - a for a, b in zip(ends, ends[1:])]
    return simulate(units, counts, link, gamma_s, contention, hook)


DEFAULT_SCALES = (0.5, 0.7, 1.0, 1.4, 2.0, 3.0)


def solve_robust(units: Sequence[UnitCost], link: LinkEstimate, gamma_s: float = 0.0,
                 scales: Sequence[float] = DEFAULT_SCALES, first: int | None = None,
                 contention: float = 0.0, hook: HookCompute = NO_HOOK_COMPUTE) -> Timeline:
    """The plan with the least worst-case regret when backward really takes ``scale`` x the estimate.

    Candidates: the exact optimum (``solve``, with ``first`` as there) for every scale,
    and the finest split (after a first bucket of ``first`` units).
    Regret of a plan at a scale = its finish / the optimum's finish at that scale.
    Returns the chosen plan's timeline at scale 1, with ``extra["regret"]`` (the
    worst case) and ``extra["scales"]`` (see Note [Cost-model bucket plan]).
    """
    def scaled(s: float) -> list[UnitCost]:
        return [UnitCost(u.backward_s * s, u.nbytes) for u in units]

    tables = {s: scaled(s) for s in scales}
    optimum = {s: solve(t, link, gamma_s, first=first, contention=contention, hook=hook) for s, t in tables.items()}
    finest = (1,) * len(units) if first is None else (first,) + (1,) * (len(units) - first)
    candidates = {t.counts for t in optimum.values()} | {finest}

    def regret(counts: tuple[int, ...]) -> float:
        return max(simulate(tables[s], counts, link, gamma_s, contention, hook).finish_s
                   / max(optimum[s].finish_s, 1e-12) for s in scales)

    best = min(candidates, key=lambda c: (round(regret(c), 9), len(c), c))
    t = simulate(units, best, link, gamma_s, contention, hook)
    t.extra.update(regret=regret(best), scales=list(scales))
    return t


def format_timeline(t: Timeline, names: Sequence[str] | None = None) -> str:
    """One table: bucket, MiB, predicted ready / start / finish (ms), then the comm tail."""
    from tabulate import tabulate

    rows = [
        (k, names[k] if names else b.units, f"{b.nbytes / 2**20:.3f}", f"{b.ready_s * 1e3:.2f}",
         f"{b.start_s * 1e3:.2f}", f"{b.finish_s * 1e3:.2f}")
        for k, b in enumerate(t.buckets)
    ]
    table = tabulate(rows, headers=("bucket", "first param" if names else "units", "MiB", "ready ms", "start ms",
                                    "finish ms"), tablefmt="simple")
    return (
        f"{table}\npredicted: backward {t.backward_s * 1e3:.2f} ms, last all-reduce done at {t.finish_s * 1e3:.2f} ms, "
        f"exposed comm (step comm tail) {t.exposed_s * 1e3:.2f} ms; link {t.link.alpha_s * 1e3:.3g} ms + "
        f"{t.link.bandwidth / 1e6:.4g} MB/s ({t.link.source}), {t.gamma_s * 1e3:.3g} ms per extra partition"
        + (f"; the hook computes {t.hook.fixed_s * 1e3:.3g} ms + {t.hook.s_per_byte * 2**20 * 1e3:.3g} ms/MiB per "
           "bucket" if t.hook != NO_HOOK_COMPUTE else "")
        + ("; one bucket: the hook computes on backward's own cores (Note [Cost-model bucket plan])"
           if t.extra.get("one_bucket") else "")
        + (f"; worst-case regret {t.extra['regret']:.3f} if backward takes {min(t.extra['scales']):g}x.."
           f"{max(t.extra['scales']):g}x the estimate" if "regret" in t.extra else "")
    )
