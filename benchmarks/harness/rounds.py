"""The interleaved round schedule both DDP and FSDP benchmarks measure with."""

from __future__ import annotations

from typing import Iterator, Sequence, TypeVar

__all__ = ["interleaved_rounds"]

R = TypeVar("R")


def interleaved_rounds(runners: Sequence[R], warmup: int, rounds: int) -> Iterator[tuple[list[R], bool, str]]:
    """``warmup + rounds`` rounds of every runner once, the starting runner rotating
    each round so that slow drift of the machine hits every runner alike.

    Yields:
        (the runners in this round's order, whether the round is measured, a label
        such as ``round 3/30`` or ``warmup 1/3``).
    """
    for rnd in range(warmup + rounds):
        k = rnd % len(runners)
        measured = rnd >= warmup
        label = f"round {rnd - warmup + 1}/{rounds}" if measured else f"warmup {rnd + 1}/{warmup}"
        yield list(runners[k:]) + list(runners[:k]), measured, label
