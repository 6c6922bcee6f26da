"""CPU seconds of this process and everything it started, for compile-cost accounting
(Note [Shared compile]): Inductor's C++ builds run as child processes."""

from __future__ import annotations

import os
import resource

__all__ = ["cpu_seconds"]


def cpu_seconds() -> float:
    """CPU seconds of this process, of its finished child processes and of its live
    descendants (Inductor's compile workers, C++ kernel builds; live ones read from
    ``/proc`` where there is one)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _live_descendants_cpu()


def _live_descendants_cpu() -> float:
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0.0
    parent, cpu = {}, {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parent[pid] = int(fields[1])  # ppid; utime and stime are fields 14 and 15 of stat
        cpu[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    mine, total, frontier = {os.getpid()}, 0.0, [os.getpid()]
    while frontier:
        frontier = [pid for pid, ppid in parent.items() if ppid in frontier and pid not in mine]
        mine.update(frontier)
        total += sum(cpu[pid] for pid in frontier)
    return total
