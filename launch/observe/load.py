"""Whether the machine was busy while it was timed. On a machine running more than it has
cores, every timing is slower and noisier (the same step measured 1,958 ms with a load
average of 5 on 2 cores and 47 ms in a quiet moment), so the doctor and the job's summary
say so beside their figures, with what to change.

Two signs, read when the figures are printed:
- the load average of the last minute is above the cores this process may run on
  (other work on the machine; it includes this job's own ranks);
- this node's ranks times each rank's intra-op threads are above those cores (the job
  oversubscribes the machine by itself; ``OMP_NUM_THREADS`` sets the threads).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

import torch

__all__ = ["MachineLoad", "spread_line"]


@dataclass(frozen=True)
class MachineLoad:
    """What the machine was running: ``cores`` this process may use, the 1-minute
    ``load`` average (None where the OS has none), this node's ``ranks`` and each
    rank's intra-op ``threads``."""

    cores: int
    load: float | None
    ranks: int
    threads: int

    @classmethod
    def now(cls) -> MachineLoad:
        """Read now; this node's ranks from torchrun's ``LOCAL_WORLD_SIZE`` (1 without it)."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        try:
            load: float | None = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = None
        return cls(cores, load, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.get_num_threads())

    def note(self) -> str | None:
        """One sentence saying the machine is oversubscribed, why and what to do; None when it is not."""
        busy = self.load is not None and self.load > self.cores
        crowded = self.ranks * self.threads > self.cores
        if not busy and not crowded:
            return None
        why = [f"load average {self.load:.1f} on {self.cores} core(s)"] if busy else []
        if crowded:
            why.append(f"{self.ranks} rank(s) x {self.threads} intra-op thread(s) on {self.cores} core(s)")
        fix = []
        if crowded:
            fix.append(f"give each rank at most its share of the cores: OMP_NUM_THREADS={max(1, self.cores // self.ranks)}")
        if busy:
            fix.append("measure when the other work on this machine has finished")
        return (f"the machine is oversubscribed ({'; '.join(why)}), so these timings are slower and noisier than "
                f"on a quiet machine: {' and '.join(fix)}.")


def spread_line(times_ms: list[float], what: str, load: MachineLoad | None = None, wide: float = 1.5) -> str | None:
    """``what`` varied widely (the 90th percentile over ``wide`` times the 10th), with the
    machine's note when it is oversubscribed; None for steady times or under five of them."""
    if len(times_ms) < 5:
        return None
    deciles = statistics.quantiles(times_ms, n=10, method="inclusive")
    p10, p90 = deciles[0], deciles[-1]
    if p90 <= wide * p10:
        return None
    note = (load or MachineLoad.now()).note()
    return (f"{what} varied widely: {p10:.1f} to {p90:.1f} ms (10th to 90th percentile)"
            + (f"; {note}" if note else "; the machine is not oversubscribed now, so look for other work that ran "
                                        "during the run"))
