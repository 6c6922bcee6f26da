"""Config rules about the machine rather than the values: whether the sizes fit in
memory, and whether the folders the job writes can be created. Both run in the
launching process, before any process group starts, so that a job that cannot run
stops with one message instead of a traceback (or the OOM killer) later.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch

from ..config.schema import ConfigError, JobConfig, ModelName, ParallelMode

__all__ = ["MemoryEstimate", "estimate_memory", "available_memory", "check_memory", "check_folders"]

GiB = 1024**3


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


def available_memory(on_gpu: bool) -> tuple[int, str] | None:
    """Bytes one rank of this machine can use, and where that number comes from; None
    when unknown. CPU: MemAvailable (``/proc/meminfo``) over the ranks on this machine;
    GPU: the smallest GPU's total memory over the ranks that share it."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if on_gpu:
        gpus = torch.cuda.device_count()
        total = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
        share = -(-local // gpus)
        return total // share, f"{total / GiB:.1f} GiB per GPU, {share} rank(s) per GPU"
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kb * 1024 // local, f"MemAvailable {kb * 1024 / GiB:.1f} GiB shared by {local} rank(s) on this machine"


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
    raise ConfigError(
        f"the job needs about {_size(need.total)} per rank (parameters {_size(need.parameters)}, "
        f"gradients and optimizer state {_size(need.states)}, activations {_size(need.activations)} "
        f"for a micro-batch of {need.micro_batch} x {t.seq_len} tokens) but a rank here has about "
        f"{_size(have[0])} ({have[1]}): it would run out of memory. Lower train.batch_size (or raise "
        "train.grad_accum), train.seq_len or the model sizes (model.n_layer, model.n_embd, model.vocab_size), "
        "or run on more ranks. The estimate is rough (float32, no activation checkpointing): if you know the job "
        "fits, set train.memory_check=false."
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
