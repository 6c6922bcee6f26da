"""Config rules about the machine rather than the values: whether the sizes fit in
memory, and whether the folders the job writes can be created. Both run in the
launching process, before any process group starts, so that a job that cannot run
stops with one message instead of a traceback (or the OOM killer) later.


Note [Memory a rank can use]

Background
    ``/proc/meminfo``'s MemAvailable is the host's. A job in a container or a
    Slurm/systemd slice runs under a memory cgroup whose limit can be far below it:
    the check let a batch through that the host had room for, and the kernel's OOM
    killer SIGKILLed the ranks in their first step, with no word from the job.

Algorithm
    - The host: MemAvailable.
    - cgroup v1: the memory hierarchy's line in ``/proc/self/cgroup``
      (``N:memory:/path``); under the v1 mount (``/sys/fs/cgroup/memory``) that
      folder's ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``.
    - cgroup v2: the ``0::/path`` line; under the unified mount (``/sys/fs/cgroup``,
      or ``/sys/fs/cgroup/unified`` on a hybrid system: the first that holds
      ``cgroup.controllers``) that folder's ``memory.max`` and ``memory.current``.
    - Both: the folder and every folder above it up to the mount, since each
      ancestor's limit holds for everything below it. No limit (``max`` in v2,
      the largest page-aligned 64-bit value in v1) is skipped. The room under a
      limit is the limit less the usage, the usage less the inactive file cache
      (``memory.stat``: ``total_inactive_file`` in v1, ``inactive_file`` in v2),
      which the kernel drops before it kills anything.
    - The smallest room wins, shared by the ranks on this machine; the refusal
      names it (MemAvailable, or the cgroup's limit, usage and folder).

Notes
    A path in ``/proc/self/cgroup`` that is not under the mount (a cgroup namespace,
    or a container that mounts its own cgroup as the root) is read at the mount's
    root, which is then this process's cgroup. Anything unreadable counts as no
    limit: the check is a guard against a clear mistake, not a promise.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch

from ..config.schema import ConfigError, JobConfig, ModelName, ParallelMode
from ..runtime.oom import CGROUP_V2_ROOTS, memory_cgroups

__all__ = ["MemoryEstimate", "CgroupLimit", "estimate_memory", "available_memory", "cgroup_memory_limits",
           "check_memory", "check_folders"]

GiB = 1024**3
_NO_LIMIT = 1 << 60  # v1 writes "no limit" as 9223372036854771712; no machine has an exbibyte


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs, by kind (float32 training with AdamW)."""

    parameters: int
    states: int  # gradients, DDP's gradient buckets, AdamW's two moments
    activations: int  # saved for backward, for one micro-batch, plus the logits
    micro_batch: int

    @property
    def total(self) -> int:
        return self.parameters + self.states + self.activations


def gpt_parameters(cfg: JobConfig) -> int:
    """Parameters of the GPT of ``models`` (and of GPT-2, the same layout): embeddings,
    per block attention (4 E^2) and MLP (8 E^2) with biases and layer norms, the head."""
    m = cfg.model
    e, v = m.n_embd, m.vocab_size
    tied = m.name == ModelName.HF_GPT2 or m.kwargs.get("tie_weights", True)
    per_block = 12 * e * e + 13 * e
    return v * e + m.block_size * e + m.n_layer * per_block + 2 * e + (0 if tied else v * e)


def estimate_memory(cfg: JobConfig, world_size: int) -> MemoryEstimate:
    """A rough estimate of one rank's memory for the GPT configs (``model=gpt_tiny`` or
    ``hf_gpt2``): 4 bytes a parameter, 12 more for gradients and AdamW (16 with DDP's
    buckets; FSDP shards all of it), and the activations of Korthikanti et al. (2022)
    in float32, ``b T (68 E + 10 H T)`` bytes a block, plus 12 bytes a logit."""
    m, t = cfg.model, cfg.train
    p = gpt_parameters(cfg)
    states = (16 if cfg.parallel.name == ParallelMode.DDP else 12) * p
    params = 4 * p
    if cfg.parallel.name == ParallelMode.FSDP:
        params, states = params // world_size, states // world_size
    b = max(1, t.batch_size // max(1, world_size) // max(1, t.grad_accum))
    acts = m.n_layer * b * t.seq_len * (68 * m.n_embd + 10 * m.n_head * t.seq_len) + 12 * b * t.seq_len * m.vocab_size
    return MemoryEstimate(params, states, acts, b)


def available_memory(on_gpu: bool, *, meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                     cgroup_v1: str = "/sys/fs/cgroup/memory", cgroup_v2: tuple[str, ...] = CGROUP_V2_ROOTS
                     ) -> tuple[int, str] | None:
    """Bytes one rank of this machine can use, and where that number comes from; None
    when unknown. CPU: the smaller of MemAvailable and the room left under this
    process's memory cgroup limits (Note [Memory a rank can use]), over the ranks on this
    machine; GPU: the smallest GPU's total memory over the ranks that share it. The
    paths are arguments so that tests can point them at fake trees."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if on_gpu:
        gpus = torch.cuda.device_count()
        total = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
        share = -(-local // gpus)
        return total // share, f"{total / GiB:.1f} GiB per GPU, {share} rank(s) per GPU"
    rooms: list[tuple[int, str]] = []
    host = _mem_available(meminfo)
    if host is not None:
        rooms.append((host, f"MemAvailable {host / GiB:.1f} GiB shared by {local} rank(s) on this machine"))
    for limit in cgroup_memory_limits(proc_cgroup, cgroup_v1, cgroup_v2):
        rooms.append((limit.room, f"cgroup memory limit {limit.limit / GiB:.1f} GiB of {limit.path}, "
                                  f"{limit.usage / GiB:.1f} GiB in use, shared by {local} rank(s)"))
    if not rooms:
        return None
    room, where = min(rooms, key=lambda r: r[0])
    return room // local, where


def _mem_available(meminfo: str) -> int | None:
    try:
        with open(meminfo) as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kb * 1024


@dataclass(frozen=True)
class CgroupLimit:
    """A memory cgroup limit over this process (Note [Memory a rank can use])."""

    path: str  # the cgroup's folder
    limit: int  # bytes
    usage: int  # bytes in use, less the inactive file cache

    @property
    def room(self) -> int:
        return max(0, self.limit - self.usage)


def cgroup_memory_limits(proc_cgroup: str = "/proc/self/cgroup", cgroup_v1: str = "/sys/fs/cgroup/memory",
                         cgroup_v2: tuple[str, ...] = CGROUP_V2_ROOTS) -> list[CgroupLimit]:
    """Every memory limit over this process, v1 and v2, its cgroup's and each ancestor's
    (Note [Memory a rank can use]); empty when there is none or nothing can be read."""
    found: list[CgroupLimit] = []
    for version, root, folder in memory_cgroups(proc_cgroup, cgroup_v1, cgroup_v2):
        files = (("memory.max", "memory.current", "inactive_file") if version == 2 else
                 ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
        found += _limits_along(root, folder, *files)
    return found


def _limits_along(root: str, folder: str, limit_file: str, usage_file: str, inactive_key: str) -> list[CgroupLimit]:
    """The limits of the cgroup ``folder`` under the mount ``root`` and of each folder above it."""
    found = []
    while True:
        limit = _read_bytes(os.path.join(folder, limit_file))
        usage = _read_bytes(os.path.join(folder, usage_file))
        if limit is not None and limit < _NO_LIMIT and usage is not None:
            found.append(CgroupLimit(folder, limit, max(0, usage - _stat(folder, inactive_key))))
        if folder == root:
            return found
        folder = os.path.dirname(folder)


def _read_bytes(path: str) -> int | None:
    """The number in a cgroup file; None when absent, unreadable or ``max``."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(folder: str, key: str) -> int:
    """One value of the cgroup's ``memory.stat``; 0 when absent."""
    try:
        with open(os.path.join(folder, "memory.stat")) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0


def check_memory(cfg: JobConfig, world_size: int) -> None:
    """Refuse GPT sizes whose estimate exceeds what one rank has (a custom model's
    size is unknown here; ``launch.checks.probe`` builds it)."""
    if not cfg.train.memory_check or cfg.model._target_ or cfg.model.name not in (ModelName.GPT_TINY, ModelName.HF_GPT2):
        return
    on_gpu = torch.cuda.is_available() and cfg.parallel.dist_backend != "gloo"
    have = available_memory(on_gpu)
    need = estimate_memory(cfg, world_size)
    if have is None or need.total <= have[0]:
        return
    t = cfg.train
    cgroup = have[1].startswith("cgroup")
    more = ", or raise the memory limit of the job's cgroup (its container's or allocation's)" if cgroup else ""
    raise ConfigError(
        f"the job needs about {_size(need.total)} per rank (parameters {_size(need.parameters)}, "
        f"gradients and optimizer state {_size(need.states)}, activations {_size(need.activations)} "
        f"for a micro-batch of {need.micro_batch} x {t.seq_len} tokens) but a rank here has about "
        f"{_size(have[0])} ({have[1]}): it would run out of memory. Lower train.batch_size (or raise "
        "train.grad_accum), train.seq_len or the model sizes (model.n_layer, model.n_embd, model.vocab_size), "
        f"or run on more ranks{more}. The estimate is rough (float32, no activation checkpointing): if you know the "
        "job fits, set train.memory_check=false."
    )


def _size(n: int) -> str:
    return f"{n / GiB:,.1f} GiB" if n >= GiB else f"{n / 2**20:,.1f} MiB"


def check_folders(cfg: JobConfig) -> None:
    """The folders the job writes must exist or be creatable, and be writable:
    ``compile.cache_dir`` (when set) and ``train.checkpoint_dir`` (when checkpointing)."""
    if cfg.compile.cache_dir:
        _writable("compile.cache_dir", cfg.compile.cache_dir, "the compile cache is written there after the first step",
                  "compile.cache_dir=null to keep only torch's local caches")
    if cfg.train.checkpoint_every:
        _writable("train.checkpoint_dir", cfg.train.checkpoint_dir, "checkpoints are written there every "
                  f"{cfg.train.checkpoint_every} steps", "train.checkpoint_every=0 for no checkpoints")


def _writable(name: str, path: str, why: str, off: str) -> None:
    """Create (and remove at once) a folder in ``path``, or in its nearest existing
    parent when it does not exist yet: nothing is left behind."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    problem = None
    if not os.path.isdir(existing):
        problem = f"{existing} is a file, not a folder"
    else:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".distcompile-write-check-", dir=existing))
        except OSError as e:
            problem = f"cannot create a folder in {existing} ({e.strerror})"
    if problem:
        raise ConfigError(
            f"{name}={path!r} cannot be written: {problem}, and {why}. Point {name} at a folder you can write, "
            f"or set {off}."
        )
