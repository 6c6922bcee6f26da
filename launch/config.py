"""The main job's configuration: typed schemas for every config group, their
registration in Hydra's ConfigStore, and the one validation pass that runs before
any process group starts.

Hydra composes ``configs/config.yaml`` (YAML group options layered on the schemas
stored here) and the entry point converts the result with ``OmegaConf.to_object``
into a :class:`JobConfig`. Everything below the entry point takes these
dataclasses, never a ``DictConfig``.

Every check in :func:`validate` raises :class:`ConfigError` naming the setting,
why it is wrong and how to fix it; the entry point prints that message and exits
with code 2.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

__all__ = [
    "ConfigError",
    "ModelConfig",
    "ParallelConfig",
    "CompileConfig",
    "DDPConfig",
    "FSDPOptions",
    "DataConfig",
    "TrainConfig",
    "JobConfig",
    "register_configs",
    "validate",
    "describe",
]

MODEL_NAMES = ("gpt_tiny", "hf_gpt2", "custom")
PARALLEL_NAMES = ("ddp", "fsdp", "none")
DIST_BACKENDS = ("auto", "gloo", "nccl")
MIXED_PRECISION = ("none", "bf16")
PRECISIONS = ("fp32", "bf16", "fp16")
LENGTHS = ("fixed", "skewed")
PADDINGS = ("max", "multiple", "dynamic")


class ConfigError(ValueError):
    """A config value that cannot work. The message says what, why and how to fix it."""


# NOTE: typing.Optional/List/Dict rather than `X | None`: OmegaConf reads these
# annotations at runtime to type-check overrides.


@dataclass
class ModelConfig:
    """``model`` group. ``gpt_tiny`` and ``hf_gpt2`` use the size fields; ``custom``
    builds ``_target_(**kwargs)`` (nested ``_target_`` dicts are instantiated too)."""

    name: str = "gpt_tiny"
    _target_: Optional[str] = None
    vocab_size: int = 512
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ParallelConfig:
    """``parallel`` group: how the model is spread over the ranks."""

    name: str = "ddp"
    # auto: nccl when CUDA is available, gloo otherwise.
    dist_backend: str = "auto"


@dataclass
class CompileConfig:
    """``compile`` group. ``backend=eager`` means no ``torch.compile`` at all."""

    backend: str = "inductor"
    mode: Optional[str] = None
    options: Dict[str, Any] = field(default_factory=dict)
    dynamic: Optional[bool] = None
    fullgraph: bool = False
    # DDP only: split the graph at DDP's bucket boundaries (False: compile it whole).
    split: bool = True
    # A partition that fails to compile: "warn" runs it eagerly, "raise" stops.
    fallback: str = "warn"
    # Compile optimizer.step too (launch.optim, Note [Compiled optimizer step]).
    optimizer: bool = False
    # DDP only: a persistent compile cache directory (Note [Compile cache]), loaded before the
    # first step and written after it; null: only torch's local caches. Loading a cache is
    # loading code: use a directory as trusted as this code.
    cache_dir: Optional[str] = None
    # DDP only: compile each repeated block once, buckets of whole blocks, the rest eager
    # (Note [Regional compile]). parallel=fsdp always compiles per block.
    regional: bool = False
    # With regional: "auto" (a ModuleList of one block class) or the ModuleList's name.
    blocks: str = "auto"


@dataclass
class DDPConfig:
    """``ddp`` group; all caps in MiB. Unset caps mean DDP's defaults (25 MiB,
    first bucket 1 MiB). ``bucket_cap_mb=auto`` chooses the buckets from a cost
    model of the link and the model (Note [Cost-model bucket plan])."""

    # A size in MiB, or "auto" (a typed Union of float and str is not supported by OmegaConf 2.3).
    bucket_cap_mb: Optional[Any] = None
    # Realised as bucket_cap_mb_list=[first, cap]: DDP's reducer fills its rebuilt
    # buckets in gradient-ready order, the last entry repeating.
    first_bucket_cap_mb: Optional[float] = None
    bucket_cap_mb_list: Optional[List[float]] = None
    static_graph: bool = False

    def __post_init__(self) -> None:
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
    """``fsdp`` section (``parallel=fsdp`` only), passed to ``fsdp_opt.FSDPConfig``:
    ``fsdp.shard_unit_mb=4 fsdp.prefetch=1`` on the command line."""

    # Group consecutive blocks into one shard unit of at least this many MiB of
    # all-gather; null: one unit per block.
    shard_unit_mb: Optional[float] = None
    # Shard units to all-gather ahead, in forward and backward; 0: FSDP2's implicit prefetch.
    prefetch: int = 1
    # Free gathered parameters after forward (all-gather again in backward); false keeps them.
    reshard_after_forward: bool = True
    # Recompute each block's activations in backward.
    checkpointing: bool = False
    # none: float32 throughout; bf16: parameters gathered and computed in bf16, gradients reduced in float32.
    mixed_precision: str = "none"


@dataclass
class DataConfig:
    """``data`` group. ``synthetic``: tokens that are a pure function of
    (seed, rank, step). A user dataset: ``_target_(**kwargs)`` returning an object
    with ``batch(step, rank, world_size, batch_size, seq_len) -> (inputs, targets)``."""

    name: str = "synthetic"
    _target_: Optional[str] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)
    # Sequence lengths (launch.batching, Note [Padding strategies]): fixed (all
    # train.seq_len) or skewed (most short, a few up to train.seq_len).
    lengths: str = "fixed"
    # max: pad to train.seq_len; multiple: to the batch's longest rounded up to
    # pad_multiple (every shape compiled in warm-up); dynamic: mark_dynamic.
    padding: str = "max"
    pad_multiple: int = 8


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
    # fp32 | bf16 (autocast, CPU and CUDA) | fp16 (autocast + GradScaler, CUDA only).
    precision: str = "fp32"
    # Micro-batches per optimizer step (DDP no_sync on all but the last).
    grad_accum: int = 1
    # After the warm-up pass, a recompile is an error (the production stance).
    no_recompile_after_warmup: bool = False


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # Diagnose the compile (compiler.diagnose): rank 0 prints a report at the end
    # and writes it as JSON (diagnose_json, or diagnosis.json in the run directory).
    diagnose: bool = False
    diagnose_json: Optional[str] = None


def register_configs() -> None:
    """Store the schemas Hydra layers the YAML of ``configs/`` on. Idempotent."""
    ConfigStore.instance().store(name="job_schema", node=JobConfig)


# --- validation ----------------------------------------------------------------------


def validate(cfg: JobConfig, world_size: int = 1) -> None:
    """Check every value before any process group starts.

    Args:
        cfg: the composed job config.
        world_size: the number of ranks the job will run on (torchrun's ``WORLD_SIZE``).

    Raises:
        ConfigError: the first value that cannot work, with what/why/how to fix.
    """
    _validate_model(cfg.model, cfg.train)
    _validate_parallel(cfg.parallel)
    _validate_compile(cfg.compile)
    _validate_compile_time(cfg.compile, cfg.parallel)
    _validate_ddp(cfg.ddp, cfg.parallel)
    _validate_auto_caps(cfg.ddp, cfg.compile)
    _validate_fsdp(cfg.fsdp, cfg.parallel)
    _validate_data(cfg.data)
    _validate_train(cfg.train, world_size)
    _validate_diagnose(cfg)
    _validate_step(cfg, world_size)


def _validate_diagnose(cfg: JobConfig) -> None:
    if not cfg.diagnose:
        return
    if cfg.compile.backend == "eager":
        raise ConfigError(
            "diagnose=true with compile.backend=eager: there is no compile to diagnose (eager means no "
            "torch.compile at all). Use compile=aot_eager (quick) or compile=inductor."
        )
    if cfg.parallel.name == "fsdp":
        raise ConfigError(
            "diagnose=true is not supported with parallel=fsdp yet: fsdp_opt compiles each block itself, "
            "out of the diagnoser's reach. Diagnose the same model with parallel=ddp or parallel=none."
        )


def _positive(name: str, value: Any, kind: str, why: str, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{name}={value!r} is not valid: it must be {kind}; {why}. {fix}")


def _importable(name: str, target: str, what: str) -> None:
    module, _, attr = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), attr) if module else None
    except (ImportError, AttributeError) as e:
        obj, err = None, e
    else:
        err = None
    if obj is None or not callable(obj):
        raise ConfigError(
            f"{name}={target!r} cannot be imported ({err or 'not a callable'}): the job builds the {what} "
            f"by calling it. Give a full dotted path to a class or function, e.g. {name}=my_pkg.build."
        )


def _validate_model(m: ModelConfig, t: TrainConfig) -> None:
    if m.name not in MODEL_NAMES:
        raise ConfigError(
            f"model.name={m.name!r} is not a model this job knows: valid names are {', '.join(MODEL_NAMES)}. "
            "Pick one with model=<name>, or use model=custom model._target_=<dotted path> for your own module."
        )
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        _positive(f"model.{name}", getattr(m, name), "a positive integer", "it sizes the model",
                  f"Set e.g. model.{name}={getattr(ModelConfig, name)}.")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} is not a probability in [0, 1). Use e.g. model.dropout=0.1.")
    if m.name in ("gpt_tiny", "hf_gpt2") and m.n_embd % m.n_head:
        raise ConfigError(
            f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}: each attention head gets "
            "n_embd // n_head channels. Pick n_embd a multiple of n_head."
        )
    if m.name == "hf_gpt2" and importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            "model=hf_gpt2 needs the `transformers` package, which is not installed. "
            "Install it with `pip install -e .[hf]`, or use model=gpt_tiny."
        )
    if m.name == "custom" or m._target_:
        if not m._target_:
            raise ConfigError(
                "model=custom needs model._target_, the dotted path of a class or function returning an "
                "nn.Module whose forward(idx) gives logits. Set model._target_=my_pkg.MyModel."
            )
        _importable("model._target_", m._target_, "model")
    if t.seq_len > m.block_size:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is longer than model.block_size={m.block_size}: the model has no "
            "position embedding past block_size. Lower train.seq_len or raise model.block_size."
        )


def _require_cuda(message: str) -> None:
    """A ConfigError with ``message`` unless a CUDA GPU is visible."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(message)


def _validate_parallel(p: ParallelConfig) -> None:
    if p.name not in PARALLEL_NAMES:
        raise ConfigError(
            f"parallel={p.name!r} is not a parallel mode: valid modes are {', '.join(PARALLEL_NAMES)}. "
            "Use parallel=ddp (default), parallel=fsdp or parallel=none."
        )
    if p.dist_backend not in DIST_BACKENDS:
        raise ConfigError(
            f"parallel.dist_backend={p.dist_backend!r} is not one of {', '.join(DIST_BACKENDS)}. "
            "Leave it at auto (nccl with GPUs, gloo without)."
        )
    if p.dist_backend == "nccl":
        _require_cuda("parallel.dist_backend=nccl needs CUDA GPUs, and none is visible. "
                      "Use parallel.dist_backend=auto (gloo on CPU).")
    if p.name == "fsdp":
        from .parallel import fsdp_entry_point

        fsdp_entry_point()  # raises ConfigError while fsdp_opt has no entry point


def _validate_compile(c: CompileConfig) -> None:
    from compiler import FALLBACKS, resolve_backend

    if c.fallback not in FALLBACKS:
        raise ConfigError(
            f"compile.fallback={c.fallback!r} is not one of {', '.join(FALLBACKS)}: 'warn' runs a partition "
            "that fails to compile eagerly, 'raise' stops on the error."
        )
    try:
        resolve_backend(c.backend, mode=c.mode, options=c.options or None, dynamic=c.dynamic)
    except (ValueError, TypeError) as e:
        msg = str(e)
        if msg.startswith("Unknown compile backend"):
            which, value = "compile.backend", c.backend
        elif msg.startswith("Unknown inductor mode") or (c.mode not in (None, "default") and not c.options):
            which, value = "compile.mode", c.mode
        else:
            which, value = "compile.options", c.options
        raise ConfigError(f"{which}={value!r}: {msg}") from None


def _validate_compile_time(c: CompileConfig, p: ParallelConfig) -> None:
    """compile.cache_dir and compile.regional (issue 6)."""
    if c.cache_dir is not None:
        if p.name != "ddp":
            raise ConfigError(
                f"compile.cache_dir={c.cache_dir!r} with parallel={p.name}: the persistent compile cache is "
                "implemented for parallel=ddp (compile_ddp). Drop compile.cache_dir; torch's local "
                "Inductor cache (TORCHINDUCTOR_CACHE_DIR) still serves warm restarts."
            )
        if c.backend == "eager":
            raise ConfigError(
                f"compile.cache_dir={c.cache_dir!r} with compile.backend=eager: nothing is compiled, so there is "
                "nothing to cache. Drop compile.cache_dir or pick a compile backend (compile.backend=inductor)."
            )
        if not c.cache_dir or os.path.isfile(c.cache_dir):
            raise ConfigError(
                f"compile.cache_dir={c.cache_dir!r} is not a directory: it must name a directory (created if "
                "missing) to keep one compile-cache file per model and config in. Pass a directory path, "
                "e.g. compile.cache_dir=/scratch/compile_cache."
            )
    if c.regional and p.name == "none":
        raise ConfigError(
            "compile.regional=true with parallel=none: regional compile is implemented with DDP, whose buckets "
            "it aligns to the blocks (and parallel=fsdp always compiles per block). Use parallel=ddp "
            "(also on one rank) or compile.regional=false."
        )


def _validate_ddp(d: DDPConfig, p: ParallelConfig) -> None:
    why = "DDP fills each gradient bucket up to its cap before it all-reduces it, so a cap of zero or less holds nothing"
    fix = "Give a size in MiB, e.g. {}=25, or null for DDP's default (25 MiB, first bucket 1 MiB)."
    if d.bucket_cap_mb is not None and d.bucket_cap_mb != "auto":
        _positive("ddp.bucket_cap_mb", d.bucket_cap_mb, "a positive size in MiB", why, fix.format("ddp.bucket_cap_mb"))
    if d.first_bucket_cap_mb is not None:
        _positive("ddp.first_bucket_cap_mb", d.first_bucket_cap_mb, "a positive size in MiB", why,
                  fix.format("ddp.first_bucket_cap_mb").replace("=25", "=1"))
    if d.bucket_cap_mb_list is not None:
        if len(d.bucket_cap_mb_list) == 0:
            raise ConfigError(
                "ddp.bucket_cap_mb_list=[] gives no caps: it lists one cap per bucket in gradient-ready order. "
                "Give at least one, e.g. ddp.bucket_cap_mb_list=[1,25], or set it to null."
            )
        for i, cap in enumerate(d.bucket_cap_mb_list):
            _positive(f"ddp.bucket_cap_mb_list[{i}]", cap, "a positive size in MiB", why,
                      "Give sizes in MiB, e.g. ddp.bucket_cap_mb_list=[1,25], or null for DDP's default.")
    using = [n for n in ("bucket_cap_mb", "first_bucket_cap_mb", "bucket_cap_mb_list") if getattr(d, n) is not None]
    if d.static_graph:
        using.append("static_graph")
    if p.name != "ddp" and using:
        raise ConfigError(
            f"ddp.{using[0]} is set but parallel={p.name}: ddp.* settings configure DistributedDataParallel's "
            "gradient buckets and nothing else uses them. Use parallel=ddp, or drop the ddp.* overrides."
        )
    if d.bucket_cap_mb == "auto":
        for other in ("first_bucket_cap_mb", "bucket_cap_mb_list"):
            if getattr(d, other) is not None:
                raise ConfigError(
                    f"ddp.bucket_cap_mb=auto and ddp.{other} are both set: auto chooses every bucket's size from "
                    f"the cost model, so {other} would be silently dropped. Keep one: ddp.{other}=null or a fixed "
                    "ddp.bucket_cap_mb."
                )
    if d.bucket_cap_mb_list is not None:
        for other in ("bucket_cap_mb", "first_bucket_cap_mb"):
            if getattr(d, other) is not None:
                raise ConfigError(
                    f"ddp.bucket_cap_mb_list and ddp.{other} are both set: with a per-bucket list DDP ignores "
                    f"{other}, so one of them would be silently dropped. Keep one: put the first-bucket cap "
                    "first in the list (ddp.bucket_cap_mb_list=[1,25]), or set ddp.bucket_cap_mb_list=null."
                )
    if d.first_bucket_cap_mb is not None:  # never with auto (refused above)
        cap = d.bucket_cap_mb if d.bucket_cap_mb is not None else 25.0
        if d.first_bucket_cap_mb > cap:
            raise ConfigError(
                f"ddp.first_bucket_cap_mb={d.first_bucket_cap_mb} is larger than the other buckets' cap "
                f"({cap} MiB): the first bucket exists to start communication early, so it must not be larger. "
                "Lower ddp.first_bucket_cap_mb or raise ddp.bucket_cap_mb."
            )


def _validate_auto_caps(d: DDPConfig, c: CompileConfig) -> None:
    """ddp.bucket_cap_mb=auto plans where compile_ddp splits the graph, so it needs that split."""
    if d.bucket_cap_mb != "auto":
        return
    off = ("compile.backend=eager" if c.backend == "eager" else "compile.split=false" if not c.split
           else "compile.regional=true" if c.regional else None)
    if off is not None:
        raise ConfigError(
            f"ddp.bucket_cap_mb=auto with {off}: auto chooses where compile_ddp splits the compiled graph into "
            "buckets, and with this setting nothing is split at planned buckets. Use a compile backend with "
            "compile.split=true and compile.regional=false, or a fixed ddp.bucket_cap_mb."
        )


def _validate_fsdp(f: FSDPOptions, p: ParallelConfig) -> None:
    changed = [k for k, v in vars(FSDPOptions()).items() if getattr(f, k) != v]
    if p.name != "fsdp" and changed:
        raise ConfigError(
            f"fsdp.{changed[0]}={getattr(f, changed[0])!r} is set but parallel={p.name}: fsdp.* settings "
            "configure FSDP2 sharding (fsdp_opt) and nothing else uses them. Use parallel=fsdp, or drop the "
            "fsdp.* overrides."
        )
    if f.shard_unit_mb is not None:
        _positive("fsdp.shard_unit_mb", f.shard_unit_mb, "a positive size in MiB",
                  "consecutive blocks are grouped into one shard unit until its all-gather holds that many MiB",
                  "Give a size, e.g. fsdp.shard_unit_mb=4, or fsdp.shard_unit_mb=null for one unit per block.")
    if isinstance(f.prefetch, bool) or not isinstance(f.prefetch, int) or f.prefetch < 0:
        raise ConfigError(
            f"fsdp.prefetch={f.prefetch!r} is not valid: it is how many shard units ahead to all-gather, a "
            "non-negative integer. Use fsdp.prefetch=1 (the default), or fsdp.prefetch=0 to leave FSDP2's "
            "implicit prefetching alone."
        )
    if f.mixed_precision not in MIXED_PRECISION:
        raise ConfigError(
            f"fsdp.mixed_precision={f.mixed_precision!r} is not one of {', '.join(MIXED_PRECISION)}: bf16 gathers "
            "and computes parameters in bfloat16 and reduces gradients in float32. Use fsdp.mixed_precision=bf16, "
            "or fsdp.mixed_precision=none to train in float32."
        )


def _validate_data(d: DataConfig) -> None:
    if d.name == "synthetic" and not d._target_:
        return
    if not d._target_:
        raise ConfigError(
            f"data={d.name!r} needs data._target_, the dotted path of a class or function building your "
            "dataset (an object with batch(step, rank, world_size, batch_size, seq_len)). "
            "Set data._target_=my_pkg.MyTokens, or use data=synthetic."
        )
    _importable("data._target_", d._target_, "dataset")


def _validate_train(t: TrainConfig, world_size: int) -> None:
    _positive("train.steps", t.steps, "a positive integer", "it is the number of optimizer steps to run",
              "Set e.g. train.steps=20.")
    _positive("train.batch_size", t.batch_size, "a positive integer", "it is the global batch, in sequences",
              "Set e.g. train.batch_size=8.")
    _positive("train.seq_len", t.seq_len, "a positive integer", "it is the tokens per sequence",
              "Set e.g. train.seq_len=64.")
    _positive("train.lr", t.lr, "a positive number", "it is AdamW's learning rate", "Set e.g. train.lr=3e-3.")
    _positive("train.log_interval", t.log_interval, "a positive integer", "rank 0 prints every log_interval steps",
              "Set e.g. train.log_interval=10.")
    _positive("train.keep_last", t.keep_last, "a positive integer", "it is how many checkpoints to keep",
              "Set e.g. train.keep_last=2.")
    _positive("train.timeout_s", t.timeout_s, "a positive number of seconds",
              "every collective fails after that long, so that a dead peer stops the job instead of hanging it",
              "Set e.g. train.timeout_s=300.")
    if t.weight_decay < 0:
        raise ConfigError(f"train.weight_decay={t.weight_decay} is negative. Use 0 to switch weight decay off.")
    if t.checkpoint_every < 0:
        raise ConfigError(
            f"train.checkpoint_every={t.checkpoint_every} is negative: it is a step interval. "
            "Set e.g. train.checkpoint_every=100, or 0 to switch checkpoints off."
        )
    if t.batch_size % world_size:
        raise ConfigError(
            f"train.batch_size={t.batch_size} does not divide across {world_size} ranks: it is the global batch "
            f"and every rank takes an equal share. Use a multiple of {world_size}, e.g. "
            f"train.batch_size={max(world_size, t.batch_size // world_size * world_size)}."
        )
    _validate_resume(t)


def _validate_resume(t: TrainConfig) -> None:
    from .checkpoint import latest_checkpoint

    latest = latest_checkpoint(t.checkpoint_dir)
    if t.resume or _restarted_by_torchrun():
        if latest is None and not _restarted_by_torchrun():
            raise ConfigError(
                f"train.resume=true but there is no checkpoint in train.checkpoint_dir={t.checkpoint_dir!r} "
                f"(looked for {os.path.join(t.checkpoint_dir, 'latest')}). Point train.checkpoint_dir at the "
                "folder of the run to continue, or set train.resume=false to start fresh."
            )
        if latest is not None and latest.step >= t.steps:
            raise ConfigError(
                f"train.resume=true but the latest checkpoint ({latest.path}) is already at step {latest.step} "
                f">= train.steps={t.steps}: there is nothing left to train. Raise train.steps to train further."
            )
    elif latest is not None and t.checkpoint_every > 0:
        raise ConfigError(
            f"train.checkpoint_dir={t.checkpoint_dir!r} already holds checkpoints of another run (latest: step "
            f"{latest.step}) and train.resume=false: writing new ones there would mix two runs. Continue it with "
            "train.resume=true, pick another train.checkpoint_dir, or delete the folder."
        )


def _validate_step(cfg: JobConfig, world_size: int) -> None:
    """The training-step techniques: padding, precision, accumulation, compiled optimizer."""
    d, t, c = cfg.data, cfg.train, cfg.compile
    if d.lengths not in LENGTHS:
        raise ConfigError(
            f"data.lengths={d.lengths!r} is not one of {', '.join(LENGTHS)}: fixed makes every sequence "
            "train.seq_len long, skewed draws realistic lengths (most short, a few long). "
            "Use data.lengths=fixed (the default) or data.lengths=skewed."
        )
    if d.padding not in PADDINGS:
        raise ConfigError(
            f"data.padding={d.padding!r} is not one of {', '.join(PADDINGS)}: it is how a batch of unequal "
            "sequences becomes one tensor. Use data.padding=max (pad to train.seq_len, the default), "
            "multiple (to the longest, rounded up to data.pad_multiple) or dynamic (mark_dynamic)."
        )
    _positive("data.pad_multiple", d.pad_multiple, "a positive integer",
              "padding=multiple rounds each batch's longest sequence up to a multiple of it",
              "Set e.g. data.pad_multiple=8.")
    if d.padding == "multiple":
        import math

        import torch

        limit = int(torch._dynamo.config.recompile_limit)
        shapes = math.ceil(t.seq_len / d.pad_multiple)
        if shapes > limit:
            raise ConfigError(
                f"data.padding=multiple with data.pad_multiple={d.pad_multiple} and train.seq_len={t.seq_len} "
                f"gives {shapes} padded shapes, more than torch._dynamo.config.recompile_limit={limit}: each "
                f"shape is one compiled graph, and past the limit dynamo stops compiling the model and runs it "
                f"eagerly. Raise data.pad_multiple to at least {math.ceil(t.seq_len / limit)}, or use "
                "data.padding=dynamic (one graph for every length) or data.padding=max."
            )
        if c.dynamic:
            raise ConfigError(
                "data.padding=multiple with compile.dynamic=true: padding to a few lengths exists to compile "
                "each of them as a static graph, and dynamic=true makes the length symbolic instead. "
                "Leave compile.dynamic=null (the job compiles with dynamic=false here), or use data.padding=dynamic."
            )
    if t.precision not in PRECISIONS:
        raise ConfigError(
            f"train.precision={t.precision!r} is not one of {', '.join(PRECISIONS)}. Use train.precision=fp32 "
            "(the default), bf16 (autocast to bfloat16) or fp16 (autocast + grad scaler, CUDA only)."
        )
    if t.precision == "fp16":
        _require_cuda("train.precision=fp16 needs a CUDA GPU, and none is visible: fp16 training needs a GradScaler "
                      "and float16 autocast, which this job runs on CUDA only. Use train.precision=bf16 on CPU, "
                      "or train.precision=fp32.")
        if c.optimizer:
            raise ConfigError(
                "train.precision=fp16 with compile.optimizer=true is not supported: the fp16 GradScaler skips "
                "steps with inf gradients outside the compiled step. Use train.precision=bf16 (no scaler), "
                "or compile.optimizer=false."
            )
    if t.precision != "fp32" and cfg.parallel.name == "fsdp":
        raise ConfigError(
            f"train.precision={t.precision} with parallel=fsdp: FSDP2 has its own mixed precision (parameters "
            "gathered in bf16), and autocast on top of it is not supported by this job. Use "
            "fsdp.mixed_precision=bf16 with train.precision=fp32."
        )
    _positive("train.grad_accum", t.grad_accum, "a positive integer",
              "it is the number of micro-batches per optimizer step", "Set e.g. train.grad_accum=1 (no accumulation).")
    local = t.batch_size // world_size
    if local % t.grad_accum:  # the batch divides over the ranks (_validate_train)
        raise ConfigError(
            f"train.grad_accum={t.grad_accum} does not divide the per-rank batch of {local} sequences "
            f"(train.batch_size={t.batch_size} over {world_size} rank(s)): every micro-batch must have the same "
            "size, for one compiled shape and equal loss weights. Pick train.grad_accum dividing "
            f"{local}, or change train.batch_size."
        )
    if c.optimizer and c.backend == "eager":
        raise ConfigError(
            "compile.optimizer=true with compile.backend=eager: eager means no torch.compile at all, so there is "
            "no backend to compile the optimizer step with. Use compile=aot_eager or compile=inductor, or "
            "compile.optimizer=false."
        )
    if c.optimizer and cfg.parallel.name == "fsdp":
        raise ConfigError(
            "compile.optimizer=true is not supported with parallel=fsdp yet: the optimizer there steps sharded "
            "DTensor parameters, which this job has not tested compiled. Use compile.optimizer=false with fsdp."
        )
    if t.no_recompile_after_warmup and c.backend == "eager":
        raise ConfigError(
            "train.no_recompile_after_warmup=true with compile.backend=eager: nothing is compiled, so there is "
            "no recompile to forbid. Use compile=aot_eager or compile=inductor, or set "
            "train.no_recompile_after_warmup=false."
        )


def _restarted_by_torchrun() -> bool:
    """torchrun sets TORCHELASTIC_RESTART_COUNT; > 0 means a worker failed and the job restarted."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


# --- printing ------------------------------------------------------------------------


def describe(cfg: JobConfig) -> str:
    """The resolved config in short: one line per group."""
    m, c, d, t = cfg.model, cfg.compile, cfg.ddp, cfg.train
    model = f"{m.name} target={m._target_}" if m._target_ else (
        f"{m.name} n_layer={m.n_layer} n_head={m.n_head} n_embd={m.n_embd} vocab={m.vocab_size} block={m.block_size}"
    )
    comp = f"{c.backend}" + (f" mode={c.mode}" if c.mode else "") + (f" options={c.options}" if c.options else "")
    comp += f" dynamic={c.dynamic} fullgraph={c.fullgraph}" + (" optimizer" if c.optimizer else "")
    comp += f" split={c.split}" if cfg.parallel.name == "ddp" else ""
    ddp = " ".join(f"{k}={getattr(d, k)}" for k in ("bucket_cap_mb", "first_bucket_cap_mb", "bucket_cap_mb_list")
                   if getattr(d, k) is not None) or "defaults (25 MiB, first 1 MiB)"
    data = cfg.data.name + (f" target={cfg.data._target_}" if cfg.data._target_ else "")
    data += f" lengths={cfg.data.lengths} padding={cfg.data.padding}" + (
        f" pad_multiple={cfg.data.pad_multiple}" if cfg.data.padding == "multiple" else "")
    ckpt = f"every {t.checkpoint_every} steps -> {t.checkpoint_dir}" if t.checkpoint_every else "off"
    lines = [
        ("model", model),
        ("parallel", f"{cfg.parallel.name} ({cfg.parallel.dist_backend})"),
        ("compile", comp),
        *([("ddp", ddp + (" static_graph" if d.static_graph else ""))] if cfg.parallel.name == "ddp" else []),
        *([("fsdp", _describe_fsdp(cfg.fsdp))] if cfg.parallel.name == "fsdp" else []),
        ("data", data),
        ("train", f"steps={t.steps} batch={t.batch_size} seq={t.seq_len} lr={t.lr} seed={t.seed} "
                  f"resume={t.resume} precision={t.precision} grad_accum={t.grad_accum}"
                  + (" no_recompile_after_warmup" if t.no_recompile_after_warmup else "")),
        ("checkpoint", ckpt),
    ]
    return "\n".join(f"  {k:<10} {v}" for k, v in lines)


def _describe_fsdp(f: FSDPOptions) -> str:
    units = f"shard_unit_mb={f.shard_unit_mb}" if f.shard_unit_mb is not None else "one unit per block"
    return (f"{units} prefetch={f.prefetch} reshard_after_forward={f.reshard_after_forward} "
            f"checkpointing={f.checkpointing} mixed_precision={f.mixed_precision}")
