"""The kernel's count of OOM kills in this process's memory cgroup: when a peer died, whether
the out-of-memory killer is the likely cause (``launch.runtime.watchdog``).

Note [OOM kill count]

Background
    A rank SIGKILLed by the OOM killer leaves no word of its own: its peers see a
    closed connection, and the user guesses. The kernel counts the processes it
    killed for memory in each memory cgroup; torchrun's workers share the cgroup of
    the job (a container, a Slurm or systemd slice), so a count that grew since the
    job started names the likely cause.

Algorithm
    - The memory cgroup's folders (:func:`memory_cgroup_dirs`), from
      ``/proc/self/cgroup``: cgroup v1's line ``N:memory:/path`` under the v1 mount
      (``/sys/fs/cgroup/memory``); cgroup v2's line ``0::/path`` under the unified
      mount (``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on a hybrid system:
      the first that holds ``cgroup.controllers``). A path that is not a folder
      under the mount (a cgroup namespace, a container whose own cgroup is mounted
      as the root) is read at the mount's root, which is then this process's cgroup.
    - The count (:func:`oom_kills`): the line ``oom_kill N`` of v1's
      ``memory.oom_control`` (Linux 4.13 and later) or of v2's ``memory.events``,
      summed over the folders found; None when none can be read.

Notes
    The count covers this machine only: a peer on another machine was killed in a
    cgroup this process cannot see. Every path is an argument, so tests read a
    fake tree.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

__all__ = ["CGROUP_V2_ROOTS", "memory_cgroup_dirs", "memory_cgroups", "oom_kills"]

CGROUP_V2_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")  # the unified mount: pure v2, then hybrid


def memory_cgroups(proc_cgroup: str = "/proc/self/cgroup", cgroup_v1: str = "/sys/fs/cgroup/memory",
                   cgroup_v2: tuple[str, ...] = CGROUP_V2_ROOTS) -> list[tuple[int, str, str]]:
    """``(version, mount root, folder)`` of this process's memory cgroup, v1 and v2 (Note [OOM kill
    count]); empty when ``proc_cgroup`` cannot be read. Also read by the memory check
    (``launch.checks.rules_resources``), which walks from the folder up to the root."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found: list[tuple[int, str, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            root = next((r for r in cgroup_v2 if os.path.isfile(os.path.join(r, "cgroup.controllers"))), None)
            if root is not None:
                found.append((2, os.path.abspath(root), _under(root, path)))
        elif "memory" in controllers.split(","):
            found.append((1, os.path.abspath(cgroup_v1), _under(cgroup_v1, path)))
    return found


def memory_cgroup_dirs(proc_cgroup: str = "/proc/self/cgroup", cgroup_v1: str = "/sys/fs/cgroup/memory",
                       cgroup_v2: tuple[str, ...] = CGROUP_V2_ROOTS) -> list[tuple[int, str]]:
    """``(version, folder)`` of this process's memory cgroup, v1 and v2 (:func:`memory_cgroups`)."""
    return [(version, folder) for version, _, folder in memory_cgroups(proc_cgroup, cgroup_v1, cgroup_v2)]


def _under(root: str, path: str) -> str:
    """The folder of the cgroup ``path`` under the mount ``root``; the root itself when it is not there."""
    root = os.path.abspath(root)
    folder = os.path.normpath(os.path.join(root, path.lstrip("/")))
    if (folder == root or folder.startswith(root + os.sep)) and os.path.isdir(folder):
        return folder
    return root


def oom_kills(proc_cgroup: str = "/proc/self/cgroup", cgroup_v1: str = "/sys/fs/cgroup/memory",
              cgroup_v2: tuple[str, ...] = CGROUP_V2_ROOTS) -> int | None:
    """How many processes the OOM killer killed in this process's memory cgroup so far; None when
    the count cannot be read (no cgroup, an older kernel, another OS)."""
    counts = [_count(os.path.join(folder, "memory.oom_control" if version == 1 else "memory.events"))
              for version, folder in memory_cgroup_dirs(proc_cgroup, cgroup_v1, cgroup_v2)]
    counts = [c for c in counts if c is not None]
    return sum(counts) if counts else None


def _count(path: str) -> int | None:
    """The value of the ``oom_kill`` line of a cgroup file; None when absent or unreadable."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == "oom_kill" and value.strip().isdigit():
                    return int(value)
    except OSError as e:
        log.debug("cannot read %s: %s", path, e)
    return None
