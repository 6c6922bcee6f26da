"""The launcher's own config rules for what the job builds (model, parallel
mode, compile, DDP buckets, FSDP, data, diagnosis), and the small checks every
rule uses. Each ``check_*`` looks at one part of the
:class:`~launch.config.schema.JobConfig` and raises :class:`~launch.config.schema.ConfigError`
naming the launcher setting, why its value cannot work and how to fix it.

``launch.checks.validate`` runs them, in order, together with the rules of the training
run (``launch.checks.rules_train``) and the checks that come from the library configs; a
rule that a library config already checks is not here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

import torch

from ddp_opt.config import STRATEGIES
from ddp_opt.compression.powersgd import parse_compression

from ..config.schema import (
    CompileConfig,
    ConfigError,
    DataConfig,
    DDPConfig,
    DistBackend,
    FSDPOptions,
    FSDPPrecision,
    JobConfig,
    ModelConfig,
    ModelName,
    ParallelConfig,
    ParallelMode,
    Precision,
    TrainConfig,
)

__all__ = [
    # the rules, in the order launch.checks.validate runs them
    "check_model",
    "check_parallel",
    "check_compile_time",
    "check_reduce_dtype",
    "check_compression",
    "check_ddp",
    "check_auto_caps",
    "auto_caps_error",
    "strategy_error",
    "check_fsdp",
    "check_data",
    "check_diagnose",
    # the checks the rules share
    "positive",
    "choice",
    "require_cuda",
]


def positive(name: str, value: Any, kind: str, why: str, fix: str) -> None:
    """``value`` must be a number above zero (``kind`` says which); ``why`` and ``fix`` end the message."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{name}={value!r} is not valid: it must be {kind}; {why}. {fix}")


def choice(name: str, value: str, choices: Any, rest: str) -> None:
    """``value`` must be one of ``choices`` (an Enum or names); ``rest`` follows the list:
    ``": why. How to fix."`` or ``". How to fix."``."""
    names = [getattr(c, "value", c) for c in choices]
    if value not in names:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(names)}{rest}")


def require_cuda(message: str) -> None:
    """A ConfigError with ``message`` unless a CUDA GPU is visible."""
    if not torch.cuda.is_available():
        raise ConfigError(message)


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


def check_model(m: ModelConfig, t: TrainConfig) -> None:
    if m.name not in [n.value for n in ModelName]:
        raise ConfigError(
            f"model.name={m.name!r} is not a model this job knows: valid names are "
            f"{', '.join(n.value for n in ModelName)}. Pick one with model=<name>, or use model=custom "
            "model._target_=<dotted path> for your own module."
        )
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        positive(f"model.{name}", getattr(m, name), "a positive integer", "it sizes the model",
                 f"Set e.g. model.{name}={getattr(ModelConfig, name)}.")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} is not a probability in [0, 1). Use e.g. model.dropout=0.1.")
    if m.name in (ModelName.GPT_TINY, ModelName.HF_GPT2) and m.n_embd % m.n_head:
        raise ConfigError(
            f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}: each attention head gets "
            "n_embd // n_head channels. Pick n_embd a multiple of n_head."
        )
    if m.name == ModelName.HF_GPT2 and importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            "model=hf_gpt2 needs the `transformers` package, which is not installed. "
            "Install it with `pip install -e .[hf]`, or use model=gpt_tiny."
        )
    if m.name == ModelName.CUSTOM or m._target_:
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


def check_parallel(p: ParallelConfig) -> None:
    if p.name not in [n.value for n in ParallelMode]:
        raise ConfigError(
            f"parallel={p.name!r} is not a parallel mode: valid modes are {', '.join(n.value for n in ParallelMode)}. "
            "Use parallel=ddp (default), parallel=fsdp or parallel=none."
        )
    choice("parallel.dist_backend", p.dist_backend, DistBackend,
           ". Leave it at auto (nccl with GPUs, gloo without).")
    if p.dist_backend == DistBackend.NCCL:
        require_cuda("parallel.dist_backend=nccl needs CUDA GPUs, and none is visible. "
                      "Use parallel.dist_backend=auto (gloo on CPU).")
        ranks, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), torch.cuda.device_count()
        if ranks > gpus:
            raise ConfigError(
                f"parallel.dist_backend=nccl with {ranks} ranks on this node and {gpus} visible GPU(s): NCCL "
                f"refuses two ranks on one device. Launch --nproc-per-node {gpus}, or use parallel.dist_backend=auto "
                "(gloo, the ranks sharing the GPUs)."
            )
    if p.name == ParallelMode.FSDP and not hasattr(importlib.import_module("fsdp_opt"), "apply"):
        raise ConfigError(
            "parallel=fsdp is not available yet: this version of the toolkit has no fsdp_opt.apply "
            "(FSDP2 sharding with per-block compile). Use parallel=ddp, or parallel=none on one rank."
        )


def check_compile_time(c: CompileConfig) -> None:
    """compile.cache_dir needs a compile (any parallel mode; whether it is a directory is
    compiler.CompileOptions's check)."""
    if c.cache_dir is not None and c.backend == "eager":
        raise ConfigError(
            f"compile.cache_dir={c.cache_dir!r} with compile.backend=eager: nothing is compiled, so there is "
            "nothing to cache. Drop compile.cache_dir or pick a compile backend (compile.backend=inductor)."
        )


def check_reduce_dtype(d: DDPConfig) -> None:
    """``ddp.reduce_dtype`` names a dtype (before ``compile_ddp``'s config is built from it)."""
    choice("ddp.reduce_dtype", d.reduce_dtype, (Precision.FP32, Precision.BF16),
           ": the dtype the gradients are all-reduced in. Use ddp.reduce_dtype=bf16 (half the bytes on the wire, "
           "fp32's range; fp16 would overflow without a loss scale, which this job does not apply to the "
           "reduction), or fp32 (the default) to reduce them as they are.")


def check_compression(d: DDPConfig) -> None:
    """``ddp.compression`` names a compression, and not beside a setting it cannot share."""
    try:
        spec = parse_compression(d.compression)
    except ValueError as e:
        raise ConfigError(f"ddp.compression={d.compression!r} is not valid: {e} In the launcher: "
                          "ddp.compression=powersgd:4, or ddp.compression=none to reduce the gradients as they "
                          "are.") from None
    if spec is not None and d.reduce_dtype != Precision.FP32:
        raise ConfigError(f"ddp.compression={d.compression} with ddp.reduce_dtype={d.reduce_dtype}: both choose how "
                          "the gradients cross the link, through one comm hook each, and DDP calls one hook. Keep "
                          "one: ddp.reduce_dtype=fp32 or ddp.compression=none.")


def check_ddp(d: DDPConfig, p: ParallelConfig) -> None:
    why = "DDP fills each gradient bucket up to its cap before it all-reduces it, so a cap of zero or less holds nothing"
    fix = "Give a size in MiB, e.g. {}=25, or null for DDP's default (25 MiB, first bucket 1 MiB)."
    if d.bucket_cap_mb is not None and d.bucket_cap_mb != "auto":
        positive("ddp.bucket_cap_mb", d.bucket_cap_mb, "a positive size in MiB", why, fix.format("ddp.bucket_cap_mb"))
    if d.first_bucket_cap_mb is not None:
        positive("ddp.first_bucket_cap_mb", d.first_bucket_cap_mb, "a positive size in MiB", why,
                 fix.format("ddp.first_bucket_cap_mb").replace("=25", "=1"))
    if d.bucket_cap_mb_list is not None:
        if len(d.bucket_cap_mb_list) == 0:
            raise ConfigError(
                "ddp.bucket_cap_mb_list=[] gives no caps: it lists one cap per bucket in gradient-ready order. "
                "Give at least one, e.g. ddp.bucket_cap_mb_list=[1,25], or set it to null."
            )
        for i, cap in enumerate(d.bucket_cap_mb_list):
            positive(f"ddp.bucket_cap_mb_list[{i}]", cap, "a positive size in MiB", why,
                     "Give sizes in MiB, e.g. ddp.bucket_cap_mb_list=[1,25], or null for DDP's default.")
    using = [n for n in ("bucket_cap_mb", "first_bucket_cap_mb", "bucket_cap_mb_list") if getattr(d, n) is not None]
    if d.static_graph:
        using.append("static_graph")
    if d.strategy != "split":
        using.append("strategy")
    if d.reduce_dtype != Precision.FP32:
        using.append("reduce_dtype")
    if d.compression not in (None, "none"):
        using.append("compression")
    if p.name != ParallelMode.DDP and using:
        raise ConfigError(
            f"ddp.{using[0]} is set but parallel={p.name}: ddp.* settings configure DistributedDataParallel's "
            "gradient buckets and nothing else uses them. Use parallel=ddp, or drop the ddp.* overrides."
        )
    # Pairs DDP cannot honour together: the second setting would be silently dropped.
    conflicts = []
    if d.bucket_cap_mb == "auto":
        conflicts += [("bucket_cap_mb=auto", other, f"auto chooses every bucket's size from the cost model, so "
                       f"{other} would be silently dropped. Keep one: ddp.{other}=null or a fixed ddp.bucket_cap_mb.")
                      for other in ("first_bucket_cap_mb", "bucket_cap_mb_list")]
    if d.bucket_cap_mb_list is not None:
        conflicts += [("bucket_cap_mb_list", other, f"with a per-bucket list DDP ignores {other}, so one of them "
                       "would be silently dropped. Keep one: put the first-bucket cap first in the list "
                       "(ddp.bucket_cap_mb_list=[1,25]), or set ddp.bucket_cap_mb_list=null.")
                      for other in ("bucket_cap_mb", "first_bucket_cap_mb")]
    for first, other, why in conflicts:
        if getattr(d, other) is not None:
            raise ConfigError(f"ddp.{first} and ddp.{other} are both set: {why}")
    if d.first_bucket_cap_mb is not None:  # never with auto (refused above)
        cap = d.bucket_cap_mb if d.bucket_cap_mb is not None else 25.0
        if d.first_bucket_cap_mb > cap:
            raise ConfigError(
                f"ddp.first_bucket_cap_mb={d.first_bucket_cap_mb} is larger than the other buckets' cap "
                f"({cap} MiB): the first bucket exists to start communication early, so it must not be larger. "
                "Lower ddp.first_bucket_cap_mb or raise ddp.bucket_cap_mb."
            )


def check_auto_caps(d: DDPConfig, c: CompileConfig) -> None:
    """ddp.bucket_cap_mb=auto plans where compile_ddp splits the graph, and every ddp.strategy
    but the default chooses how it compiles, so both need a compile (with ddp.strategy=whole
    or regional, DDPCompileConfig refuses auto)."""
    if d.bucket_cap_mb == "auto" and c.backend == "eager":
        raise auto_caps_error("compile.backend=eager")
    if d.strategy != "split" and c.backend == "eager":
        raise strategy_error(d.strategy)


def strategy_error(strategy: str) -> ConfigError:
    """``ddp.strategy`` refused: an unknown name, or a strategy with nothing compiled."""
    if strategy not in STRATEGIES:
        return ConfigError(
            f"ddp.strategy={strategy!r} is not valid: it must be one of "
            + "; ".join(f"{name} ({what})" for name, what in STRATEGIES.items())
            + ". Use e.g. ddp.strategy=split."
        )
    return ConfigError(
        f"ddp.strategy={strategy} with compile.backend=eager: the strategy says how compile_ddp compiles the model, "
        "and with compile.backend=eager nothing is compiled. Pick a compile backend (compile.backend=inductor or "
        "aot_eager), or drop ddp.strategy (split is the default)."
    )


def auto_caps_error(off: str) -> ConfigError:
    """``ddp.bucket_cap_mb=auto`` with ``off``, a setting under which nothing is split at planned buckets."""
    return ConfigError(
        f"ddp.bucket_cap_mb=auto with {off}: auto chooses where compile_ddp splits the compiled graph into "
        "buckets, and with this setting nothing is split at planned buckets. Use a compile backend with "
        "ddp.strategy=split or traced, or a fixed ddp.bucket_cap_mb."
    )


def check_fsdp(f: FSDPOptions, p: ParallelConfig) -> None:
    """fsdp.* only with parallel=fsdp, and the launcher's mixed-precision choice (the sizes
    are fsdp_opt.FSDPConfig's checks)."""
    changed = [k for k, v in vars(FSDPOptions()).items() if getattr(f, k) != v]
    if p.name != ParallelMode.FSDP and changed:
        raise ConfigError(
            f"fsdp.{changed[0]}={getattr(f, changed[0])!r} is set but parallel={p.name}: fsdp.* settings "
            "configure FSDP2 sharding (fsdp_opt) and nothing else uses them. Use parallel=fsdp, or drop the "
            "fsdp.* overrides."
        )
    choice("fsdp.mixed_precision", f.mixed_precision, FSDPPrecision,
           ": bf16 gathers and computes parameters in bfloat16 and reduces gradients in float32. Use "
           "fsdp.mixed_precision=bf16, or fsdp.mixed_precision=none to train in float32.")
    choice("fsdp.reduce_dtype", f.reduce_dtype, (Precision.FP32, Precision.BF16),
           ": the dtype the gradients are reduce-scattered in. Use fsdp.reduce_dtype=bf16 (half the bytes on the "
           "wire, fp32's range), or fp32 (the default).")


def check_data(d: DataConfig) -> None:
    """The data source's settings (a token file itself is ``launch.data.tokens.check_token_data``'s)."""
    if d.name != "tokens" and d.path is not None:
        raise ConfigError(
            f"data.path={d.path!r} is set but data={d.name}: only data=tokens reads a token file, so it would be "
            "silently ignored. Use data=tokens data.path=..., or drop data.path."
        )
    if d.name == "tokens" and d._target_:
        raise ConfigError(
            f"data=tokens with data._target_={d._target_!r}: data=tokens reads data.path itself, and _target_ "
            "would replace it. Drop data._target_, or use data=custom for your own dataset."
        )
    if d.name in ("synthetic", "tokens") and not d._target_:
        return
    if not d._target_:
        raise ConfigError(
            f"data={d.name!r} needs data._target_, the dotted path of a class or function building your "
            "dataset (an object with batch(step, rank, world_size, batch_size, seq_len)). "
            "Set data._target_=my_pkg.MyTokens, or use data=synthetic."
        )
    _importable("data._target_", d._target_, "dataset")


def check_diagnose(cfg: JobConfig) -> None:
    if not cfg.diagnose:
        return
    if cfg.compile.backend == "eager":
        raise ConfigError(
            "diagnose=true with compile.backend=eager: there is no compile to diagnose (eager means no "
            "torch.compile at all). Use compile=aot_eager (quick) or compile=inductor."
        )
    if cfg.parallel.name == ParallelMode.FSDP:
        raise ConfigError(
            "diagnose=true is not supported with parallel=fsdp yet: fsdp_opt compiles each block itself, "
            "out of the diagnoser's reach. Diagnose the same model with parallel=ddp or parallel=none."
        )
