"""Alignment: do DDP's runtime buckets hold exactly the parameters of one partition?

DDP rebuilds its buckets after the first iteration from the order in which
gradients became ready. Under a split, compiled graph, that order is the order in
which each partition's backward hands out its gradients, which need not be the
reverse graph order the plan assumed, so a runtime bucket can straddle two
partitions. Its all-reduce then waits for the later partition, and the overlap
the split was made for is lost. This module measures that; nothing here changes
DDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch.nn.parallel import DistributedDataParallel

from .._torch_internals import runtime_buckets
from ..planning.buckets import Bucket, kind_groups

__all__ = ["Alignment", "alignment_fraction", "measure_alignment", "runtime_buckets"]


@dataclass
class Alignment:
    """Attributes:
    fraction: gradient bytes in runtime buckets that hold exactly one partition's
        parameters, over all gradient bytes (1.0 = every bucket matches a partition).
    runtime_bytes: bytes of each runtime bucket, in the order DDP reduces them.
    aligned: per runtime bucket, whether it matches a partition.
    """

    fraction: float
    runtime_bytes: list[int]
    aligned: list[bool]


def alignment_fraction(runtime: Sequence[Sequence[tuple[int, int]]], partitions: Sequence[set[int]]) -> Alignment:
    """The pure measure: ``runtime`` buckets of ``(param id, bytes)`` against the
    parameter-id sets of the ``partitions``."""
    wanted = [frozenset(p) for p in partitions if p]
    sizes, aligned = [], []
    for bucket in runtime:
        ids = frozenset(i for i, _ in bucket)
        sizes.append(sum(n for _, n in bucket))
        aligned.append(ids in wanted)
    total = sum(sizes)
    fraction = sum(s for s, ok in zip(sizes, aligned) if ok) / total if total else 1.0
    return Alignment(fraction, sizes, aligned)


def measure_alignment(ddp_model: DistributedDataParallel, buckets: Sequence[Bucket] | None) -> Alignment | None:
    """Alignment of ``ddp_model``'s runtime buckets with a plan (``compiled.buckets``).

    ``buckets`` empty or None (compiled without splitting) counts the whole model
    as one partition. With parameters of several dtypes or devices, each
    partition's parameters of one kind count as one partition (DDP never mixes
    kinds in a bucket). Returns None before DDP has built any bucket.
    """
    runtime = runtime_buckets(ddp_model)
    if not runtime:
        return None
    if buckets:
        partitions = kind_groups(list(buckets))
    else:
        partitions = [{i for bucket in runtime for i, _ in bucket}]
    return alignment_fraction(runtime, partitions)
