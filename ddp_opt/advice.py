"""Advice about DDP's buckets and compile time, in the spelling of the entry
point the user came through.

``compiler.graph.diagnose`` reports facts and advises on what is fixed in code
(graph breaks, recompiles). What is fixed by a setting is advised here, next to
the settings: a :class:`Spelling` says how each one is written, so a Python user
reads ``compile_ddp(ddp, bucket_cap_mb='auto')`` and a launcher user reads
``ddp.bucket_cap_mb=auto`` (``launch.doctor`` supplies that spelling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["API_SPELLING", "DIRECT_SPELLING", "Spelling", "ddp_advice"]


@dataclass(frozen=True)
class Spelling:
    """How advice writes each setting; ``{}`` takes the suggested value.

    Attributes:
        bucket_cap: one bucket cap in MiB.
        bucket_cap_list: per-bucket caps in MiB, gradient-ready order.
        auto: the cost-model bucket plan.
        keep_aligned: the setting that keeps DDP's runtime buckets on the partitions.
        regional: compile the repeated block once.
        cache_dir: the persistent compile cache.
        compare: a command comparing caps side by side (``{}``: the caps), or None.
        no_split: how to compile without splitting at the buckets (shown as the
            graph-break reason of each split).
    """

    bucket_cap: str = "DistributedDataParallel(model, bucket_cap_mb={})"
    bucket_cap_list: str = "DistributedDataParallel(model, bucket_cap_mb_list={})"
    auto: str = "compile_ddp(ddp, bucket_cap_mb='auto')"
    keep_aligned: str = "Keep compile_ddp's align_buckets=True"
    regional: str = "compile_ddp(ddp, strategy='regional')"
    cache_dir: str = "compile_ddp(ddp, cache_dir=DIR)"
    compare: str | None = None
    no_split: str = "compile_ddp(ddp, strategy='whole')"


API_SPELLING = Spelling()

# A DDPOptimizer used directly as a dynamo backend, not through compile_ddp.
DIRECT_SPELLING = Spelling(
    no_split="pass the backend itself to torch.compile instead of DDPOptimizer(...).compile_fn, with "
             "torch._dynamo.config.optimize_ddp=False (otherwise PyTorch's own DDPOptimizer splits the graph)",
)

_DDP_DEFAULT_CAP_MB = 25.0


def ddp_advice(
    *,
    alignment: float | None = None,
    partition_mib: Sequence[float] | None = None,
    exposed_comm_ms: float | None = None,
    compute_ms: float | None = None,
    bucket_cap_mb: float | None = None,
    compile_s: float | None = None,
    step_s: float | None = None,
    spelling: Spelling = API_SPELLING,
) -> list[str]:
    """Advice lines for what was measured on a compiled DDP model.

    Args:
        alignment: fraction of gradient bytes whose runtime bucket is exactly one
            partition (``measure_alignment``).
        partition_mib: the partitions' gradient sizes in MiB, gradient-ready order.
        exposed_comm_ms: a step with gradient sync minus the same without.
        compute_ms: forward+backward without gradient sync.
        bucket_cap_mb: the bucket cap in use (None: DDP's default).
        compile_s: seconds spent compiling (``Diagnoser.compile_seconds``).
        step_s: a typical step after warm-up, to weigh compile time against.
        spelling: how settings are written for the user's entry point.
    """
    advice = []
    if exposed_comm_ms is not None and compute_ms and exposed_comm_ms > 0.1 * (compute_ms + exposed_comm_ms):
        cap = bucket_cap_mb or _DDP_DEFAULT_CAP_MB
        compare = (f", side by side with {spelling.compare.format(f'{cap / 2:g},{cap:g},{cap * 2:g},auto')}"
                   if spelling.compare else "")
        advice.append(
            f"{exposed_comm_ms:.0f} ms of each {compute_ms + exposed_comm_ms:.0f} ms step waits for gradient "
            f"communication that backward did not hide: try {spelling.bucket_cap.format(f'{cap / 2:g}')} (smaller "
            f"buckets start their all-reduce earlier) and {spelling.bucket_cap.format(f'{cap * 2:g}')} (fewer "
            f"all-reduces, when latency dominates){compare}; or let {spelling.auto} choose the buckets from the "
            "measured link and the model."
        )
    if alignment is not None and alignment < 0.99:
        caps = f"[{', '.join(f'{m:.3g}' for m in partition_mib)}]" if partition_mib else "the partition sizes"
        advice.append(
            f"only {alignment:.0%} of the gradient bytes are in DDP buckets that match one partition: a bucket "
            f"that straddles two partitions waits for the later one. {spelling.keep_aligned}, or give "
            f"{spelling.bucket_cap_list.format(caps)} (the partitions in MiB, gradient-ready order) so DDP's "
            "rebuilt buckets are the partitions."
        )
    if step_s and compile_s and compile_s > 50 * step_s:
        advice.append(
            f"compile took {compile_s:.1f}s, {compile_s / step_s:.0f}x a step: compile the repeated block once "
            f"({spelling.regional}) or reuse compiled partitions across restarts ({spelling.cache_dir})."
        )
    return advice
