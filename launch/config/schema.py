"""The main job's configuration schemas: one typed dataclass per config group, the
choices each group offers, and their registration in Hydra's ConfigStore.

Hydra composes ``configs/config.yaml`` (YAML group options layered on the schema
stored here) and :func:`to_job_config` converts the result with
``OmegaConf.to_object`` into a :class:`JobConfig`. Everything below the entry
point takes these dataclasses, never a ``DictConfig``. The checks that need more
than a type live in ``launch.checks.validate``.
"""

from __future__ import annotations

from dataclasses import MISSING as MISSING_FACTORY, dataclass, field, fields
from enum import Enum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from compiler import CompileOptions

from ..models import GPTConfig

__all__ = [
    "ConfigError",
    # choices
    "ModelName", "ParallelMode", "DistBackend", "FSDPPrecision", "Precision", "Lengths", "Padding", "LRSchedule",
    # schemas, one per config group
    "ModelConfig",
    "ParallelConfig",
    "CompileConfig",
    "DDPConfig",
    "FSDPOptions",
    "DataConfig",
    "TrainConfig",
    "LogConfig",
    "ProfileConfig",
    "JobConfig",
    # Hydra boundary
    "register_configs",
    "to_job_config",
]


class ConfigError(ValueError):
    """A config value that cannot work. The message says what, why and how to fix it."""


# The choices of the choice fields. The fields themselves are typed `str`: a bad
# spelling must compose, so that launch.checks.validate refuses it with a message that
# names the fix (OmegaConf would refuse an Enum field while composing, with its own
# message). The Enums are str-valued, so `cfg.data.padding == Padding.MULTIPLE` holds.


class ModelName(str, Enum):
    """``model``: the GPT of ``models``, transformers' GPT-2, or ``_target_``."""
    GPT_TINY, HF_GPT2, CUSTOM = "gpt_tiny", "hf_gpt2", "custom"


class ParallelMode(str, Enum):
    """``parallel``: DDP + compile_ddp, FSDP2 through fsdp_opt, or the plain model."""
    DDP, FSDP, NONE = "ddp", "fsdp", "none"


class DistBackend(str, Enum):
    """``parallel.dist_backend``; auto: nccl when CUDA is available, gloo otherwise."""
    AUTO, GLOO, NCCL = "auto", "gloo", "nccl"


class FSDPPrecision(str, Enum):
    """``fsdp.mixed_precision``: float32 throughout, or bf16 parameters with float32 reduction."""
    NONE, BF16 = "none", "bf16"


class Precision(str, Enum):
    """``train.precision``: the autocast dtype (Note [Autocast outside the compiled forward]); and
    ``ddp.reduce_dtype``: the dtype the gradients are all-reduced in."""
    FP32, BF16, FP16 = "fp32", "bf16", "fp16"


class Lengths(str, Enum):
    """``data.lengths`` (Note [Padding strategies] in ``launch.data.batching``)."""
    FIXED, SKEWED = "fixed", "skewed"


class Padding(str, Enum):
    """``data.padding`` (Note [Padding strategies] in ``launch.data.batching``)."""
    MAX, MULTIPLE, DYNAMIC = "max", "multiple", "dynamic"


class LRSchedule(str, Enum):
    """``train.lr_schedule`` after the warm-up (Note [LR schedule] in ``launch.step.schedule``)."""
    CONSTANT, COSINE, LINEAR = "constant", "cosine", "linear"


# typing.Optional/List/Dict rather than `X | None`: OmegaConf reads these
# annotations at runtime to type-check overrides.


@dataclass
class ModelConfig:
    """``model`` group. ``gpt_tiny`` and ``hf_gpt2`` use the size fields; ``custom``
    builds ``_target_(**kwargs)`` (nested ``_target_`` dicts are instantiated too). The sizes
    default to the GPT's own (``launch.models.GPTConfig``, their one source;
    ``configs/model/gpt_tiny.yaml`` repeats them, pinned by ``tests/launch/test_launch_config.py``)."""

    name: str = "gpt_tiny"  # a ModelName
    _target_: Optional[str] = None
    vocab_size: int = GPTConfig.vocab_size
    block_size: int = GPTConfig.block_size
    n_layer: int = GPTConfig.n_layer
    n_head: int = GPTConfig.n_head
    n_embd: int = GPTConfig.n_embd
    dropout: float = GPTConfig.dropout
    kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ParallelConfig:
    """``parallel`` group: how the model is spread over the ranks."""

    name: str = "ddp"  # a ParallelMode
    dist_backend: str = "auto"  # a DistBackend


@dataclass
class CompileConfig:
    """``compile`` group. ``backend=eager`` means no ``torch.compile`` at all.

    The fields from ``backend`` to ``share_timeout_s`` are ``compiler.CompileOptions``'s,
    one to one (same names and defaults; ``compile_options()`` maps them by name), so
    each is documented there once."""

    backend: str = "inductor"
    mode: Optional[str] = None
    options: Dict[str, Any] = field(default_factory=dict)
    dynamic: Optional[bool] = None
    fullgraph: bool = False
    # A persistent compile cache directory, any parallel mode (Note [Compile cache]); null: off.
    cache_dir: Optional[str] = None
    share: bool = True
    share_timeout_s: float = 7200.0
    # DDP only: a partition that fails to compile: "warn" runs it eagerly, "raise" stops.
    fallback: str = "warn"
    # Compile optimizer.step too (launch.step.optim, Note [Compiled optimizer step]).
    optimizer: bool = False
    # DDP with ddp.strategy=regional: "auto" (a ModuleList/ModuleDict/Sequential of one block class) or
    # the container's name.
    blocks: str = "auto"

    def compile_options(self) -> CompileOptions:
        """The ``compiler.CompileOptions`` these settings hold (every field of it, by name)."""
        return CompileOptions(**{f.name: getattr(self, f.name) for f in fields(CompileOptions)})


@dataclass
class DDPConfig:
    """``ddp`` group; all caps in MiB. Unset caps mean DDP's defaults (25 MiB, first bucket 1 MiB).
    ``bucket_cap_mb=auto``: buckets from a cost model of the link and model (Note [Cost-model bucket plan])."""

    # A size in MiB, or "auto" (a typed Union of float and str is not supported by OmegaConf 2.3).
    bucket_cap_mb: Optional[Any] = None
    # Realised as bucket_cap_mb_list=[first, cap]: DDP's reducer fills its rebuilt
    # buckets in gradient-ready order, the last entry repeating.
    first_bucket_cap_mb: Optional[float] = None
    bucket_cap_mb_list: Optional[List[float]] = None
    static_graph: bool = False
    # After step 1, make DDP's runtime buckets equal the compiled partitions (Note [Bucket realignment]).
    align_buckets: bool = True
    # How compile_ddp compiles the model, one of ddp_opt.config.STRATEGIES (split, whole, regional, traced).
    strategy: str = "split"
    # Ranks meet in the store before each step's first collective, so that a rank compiling alone is
    # waited for there and not inside a collective with its timeout (Note [Step gate]).
    step_gate: bool = True
    # fp32 | bf16: the gradients all-reduced in bf16 (half the bytes on the wire), averaged, then widened
    # for the optimizer (Note [Reduced-precision all-reduce]); fp32: as they are.
    reduce_dtype: str = "fp32"
    # none | powersgd:RANK[:START]: rank-RANK PowerSGD from step START, default 10 (Note [PowerSGD compression]).
    compression: str = "none"
    # The job's AdamW updates each bucket inside backward, right after its all-reduce (compile_ddp's
    # optimizer=, Note [Optimizer in backward]); the loop's step after backward finds no gradients.
    optimizer_in_backward: bool = False

    def __post_init__(self) -> None:
        # The one check a type cannot make: `Any` lets every word through.
        cap = self.bucket_cap_mb
        if isinstance(cap, str) and cap != "auto":
            raise ConfigError(
                f"ddp.bucket_cap_mb={cap!r} is not valid: it must be a positive size in MiB or 'auto' (buckets chosen "
                "by a cost model of the measured link and the model's backward). Use e.g. ddp.bucket_cap_mb=25, "
                "ddp.bucket_cap_mb=auto, or null for DDP's default."
            )
        if isinstance(cap, int) and not isinstance(cap, bool):
            self.bucket_cap_mb = float(cap)


@dataclass
class FSDPOptions:
    """``fsdp`` section (``parallel=fsdp`` only), passed to ``fsdp_opt.FSDPConfig``: ``fsdp.prefetch=1``."""

    # per_block: each block compiled, FSDP2's hooks around them; traced: the whole model
    # compiled with FSDP's all-gathers and reduce-scatters in the graph (fsdp_opt.traced).
    strategy: str = "per_block"
    # Group consecutive blocks into one shard unit of at least this many MiB of
    # all-gather; null: one unit per block; auto: per_block one unit per block, traced
    # planned from the measured link (a typed Union of float and str is not supported by OmegaConf 2.3).
    shard_unit_mb: Optional[Any] = "auto"
    # traced: the most gathered parameter MiB alive at once; null: what FSDP2 holds.
    memory_budget_mb: Optional[float] = None
    # Shard units to all-gather ahead, in forward and backward; 0: FSDP2's implicit prefetch.
    prefetch: int = 1
    reshard_after_forward: bool = True  # free gathered parameters after forward (gather again in backward)
    checkpointing: bool = False  # recompute each block's activations in backward
    # FSDP2's replicate instead of sharding (torchtitan's data parallelism): gradients all-reduced per unit.
    replicate: bool = False
    # An FSDPPrecision. none: float32 throughout; bf16: parameters gathered and computed in bf16.
    mixed_precision: str = "none"
    # fp32 | bf16: the dtype gradients are reduce-scattered in (FSDP2's MixedPrecisionPolicy.reduce_dtype).
    reduce_dtype: str = "fp32"

    def __post_init__(self) -> None:
        # `Any` lets every word through: a size is a float (4 and 4.0 are one setting); a word other than
        # auto is left for fsdp_opt.FSDPConfig to refuse with the launcher's message (validate).
        mb = self.shard_unit_mb
        if isinstance(mb, int) and not isinstance(mb, bool):
            self.shard_unit_mb = float(mb)


@dataclass
class DataConfig:
    """``data`` group. ``synthetic``: tokens that are a pure function of
    (seed, rank, step). ``tokens``: a token file (``path``). A user dataset:
    ``_target_(**kwargs)`` returning an object with
    ``batch(step, rank, world_size, batch_size, seq_len) -> (inputs, targets)``."""

    name: str = "synthetic"
    _target_: Optional[str] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)
    # Lengths (launch.data.batching, Note [Padding strategies]): fixed (all train.seq_len) or
    # skewed (most short, a few up to train.seq_len).
    lengths: str = "fixed"
    # Padding. max: pad to train.seq_len; multiple: to the batch's longest rounded up to
    # pad_multiple (every shape compiled in warm-up); dynamic: mark_dynamic.
    padding: str = "max"
    pad_multiple: int = 8
    # data=tokens (launch.data.tokens, Note [Token files]): a flat file of token ids, as
    # `python -m launch.prepare_data` writes. dtype: uint16 | uint32, null: from the
    # file's sidecar PATH.json, else uint16. The last val_fraction of the file is the
    # validation region (eval_batch), never trained on.
    path: Optional[str] = None
    dtype: Optional[str] = None
    val_fraction: float = 0.1


@dataclass
class TrainConfig:
    """``train`` group. ``batch_size`` is the global batch, split evenly over ranks."""

    steps: int = 20
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 1337
    log_interval: int = 1
    checkpoint_dir: str = "checkpoints"
    checkpoint_every: int = 0  # 0: no checkpoints
    keep_last: int = 2
    resume: bool = False
    timeout_s: float = 300.0
    # A Precision. fp32 | bf16 (autocast, CPU and CUDA) | fp16 (autocast + GradScaler, CUDA only).
    precision: str = "fp32"
    # Micro-batches per optimizer step (DDP no_sync on all but the last).
    grad_accum: int = 1
    # After the warm-up pass, a recompile is an error (the production stance).
    no_recompile_after_warmup: bool = False
    # A non-finite (inf/NaN) loss (launch.runtime.guard, Note [Finite-loss guard]): "stop" ends the run
    # (exit code 3), "skip" does not apply that step's update. Checkpoints are always finite.
    on_nonfinite: str = "stop"
    # With on_nonfinite=skip: stop anyway after this many non-finite steps in a row.
    max_consecutive_skips: int = 10
    # Refuse GPT sizes whose rough memory estimate exceeds this machine's (launch.checks.rules_resources).
    memory_check: bool = True
    # An LRSchedule (Note [LR schedule] in launch.step.schedule): after warmup_steps of linear warm-up
    # (lr * step / warmup_steps), constant at lr, or a cosine or linear decay to min_lr at step `steps`.
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0  # cosine and linear only
    # Clip the gradients' total L2 norm to this before each optimizer step (after unscaling, fp16);
    # 0: no clipping (launch.step.optim, Note [Gradient clipping]).
    max_grad_norm: float = 0.0
    # Evaluate on held-out batches every eval_every steps (and after the last); 0: never
    # (launch.step.evaluate, Note [Evaluation]). eval_batches: batches per rank, averaged over ranks.
    eval_every: int = 0
    eval_batches: int = 4
    # Resume a checkpoint although the token file changed since it was written (its fingerprint
    # in the checkpoint's identity; Note [Token files] in launch.data.tokens).
    allow_data_change: bool = False


@dataclass
class LogConfig:
    """``log`` section: what rank 0 writes into the run directory besides metrics.json
    (``launch.observe.tensorboard``): ``log.tensorboard=true`` on the command line."""

    # TensorBoard event files (every per-step curve of the run: loss, step time, tokens/s, ...)
    # and, at the end, curves.png (needs matplotlib; skipped with a warning without it).
    tensorboard: bool = False
    # The bucket table lists every parameter and each partition's compile time (-v on the command line).
    verbose: bool = False


@dataclass
class ProfileConfig:
    """``profile`` section (``launch.observe.profile``, Note [Overlap timeline]): ``profile.steps=[4,5]``
    wraps steps 4..5 in torch.profiler and writes trace.json and timeline.png."""

    # The inclusive step range [first, last] to profile; null: no profiling.
    steps: Optional[List[int]] = None


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # Diagnose the compile (compiler.graph.diagnose): rank 0 prints a report at the end
    # and writes it as JSON (diagnose_json, or diagnosis.json in the run directory).
    diagnose: bool = False
    diagnose_json: Optional[str] = None


def register_configs() -> None:
    """Store the schemas Hydra layers the YAML of ``configs/`` on. Idempotent."""
    ConfigStore.instance().store(name="job_schema", node=JobConfig)


def to_job_config(dcfg: Any) -> JobConfig:
    """The composed DictConfig as the typed :class:`JobConfig` (Hydra stays here)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _refuse_unknown_keys(OmegaConf.to_container(dcfg, resolve=False), JobConfig, "")
    try:
        cfg = OmegaConf.to_object(dcfg)
    except OmegaConfBaseException as e:
        first = (e.msg or type(e).__name__).splitlines()[0]  # OmegaConf adds full_key and the types on more lines
        raise ConfigError(f"{e.full_key or 'config'}: {first}. Set it on the command line, e.g. {e.full_key}=...") from None
    assert isinstance(cfg, JobConfig), type(cfg)
    return cfg


# Free-form sections: their keys are the user's own (constructor arguments, Inductor options).
_FREE_FORM = ("model.kwargs", "data.kwargs", "compile.options")


def _refuse_unknown_keys(node: Any, schema: type, prefix: str) -> None:
    """A ``+key=value`` the schema does not have is a typo that would be silently
    ignored (OmegaConf lets ``+`` add keys to a structured config): refuse it with the
    valid keys closest to it."""
    import difflib
    from dataclasses import fields, is_dataclass

    known = {f.name: f for f in fields(schema)}
    for key, value in node.items():
        name = f"{prefix}{key}"
        if key not in known:
            if not prefix and key == "hydra":
                continue
            close = difflib.get_close_matches(str(key), list(known), n=3, cutoff=0.5)
            fix = (f"Did you mean {' or '.join(prefix + c for c in close)}? Set it without the `+` "
                   f"(e.g. {prefix}{close[0]}=...), since it exists already." if close else
                   "Remove the override.")
            raise ConfigError(
                f"{name} is not a setting of this job: a `+` override adds a key, and nothing reads this one, so "
                f"it would be silently ignored. {fix} Valid keys{' of ' + prefix[:-1] if prefix else ''}: "
                f"{', '.join(known)}. Arguments of your own model or dataset go under model.kwargs or "
                "data.kwargs, Inductor options under compile.options."
            )
        sub = known[key].default_factory if known[key].default_factory is not MISSING_FACTORY else None
        if name not in _FREE_FORM and isinstance(value, dict) and sub is not None and is_dataclass(sub):
            _refuse_unknown_keys(value, sub, f"{name}.")
