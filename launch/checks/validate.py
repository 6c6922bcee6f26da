"""The one validation pass of the main job, before any process group starts.

Every check raises :class:`~launch.config.schema.ConfigError` naming the launcher
setting, why the value cannot work and how to fix it; the entry point prints that
message and exits with code 2.

A rule is written once. Where a library config checks it, this module builds
that config and tells its refusal in the launcher's spelling (``compile.backend=``
rather than ``compile_ddp(backend=...)``); the launcher's own rules are in
``launch.checks.rules`` and ``launch.checks.rules_train``, those of what the run writes about
itself next to the code that writes it (``launch.observe.tensorboard``, ``launch.observe.profile``).
"""

from __future__ import annotations

import torch

import fsdp_opt
from compiler import FALLBACKS, SettingError
from compiler.ranks import ShareSecretError, cluster_secret

from ..config.schema import CompileConfig, ConfigError, FSDPOptions, JobConfig
from ..data import tokens
from ..observe.profile import check_profile
from ..observe.tensorboard import check_log
from ..runtime.parallel import ddp_compile_config, in_backward_refusal
from ..step.optim import build_optimizer
from . import probe, rules, rules_in_backward, rules_resources, rules_train

__all__ = ["validate"]


def validate(cfg: JobConfig, world_size: int = 1) -> None:
    """Check every value before any process group starts.

    Args:
        cfg: the composed job config.
        world_size: the number of ranks the job will run on (torchrun's ``WORLD_SIZE``).

    Raises:
        ConfigError: the first value that cannot work, with what/why/how to fix.
    """
    rules.check_model(cfg.model, cfg.train)
    rules.check_parallel(cfg.parallel)
    rules.check_compile_time(cfg.compile)
    rules_in_backward.check_optimizer_in_backward(cfg)  # before check_ddp: its own words for parallel=fsdp|none
    _compile_settings(cfg)
    _share_secret(cfg, world_size)
    rules.check_ddp(cfg.ddp, cfg.parallel)
    rules.check_auto_caps(cfg.ddp, cfg.compile)
    rules.check_fsdp(cfg.fsdp, cfg.parallel)
    _fsdp_settings(cfg.fsdp)
    rules.check_data(cfg.data)
    rules_train.check_train(cfg.train, world_size)
    tokens.check_token_data(cfg, world_size)  # after check_train: it needs a valid train.seq_len
    rules_train.check_resume(cfg, world_size)
    rules.check_diagnose(cfg)
    check_log(cfg)
    check_profile(cfg)
    rules_train.check_step(cfg, world_size)
    rules_resources.check_folders(cfg)
    rules_resources.check_memory(cfg, world_size)
    probe.check_custom_parts(cfg, world_size)  # last: it builds the user's model and dataset


# --- compile.*: ddp_opt.DDPCompileConfig ---------------------------------------------


def _share_secret(cfg: JobConfig, world_size: int) -> None:
    """A share secret the user pointed to (Note [Share secret] in ``compiler.ranks.share_secret``) that
    cannot be used is refused here, in one line, instead of at the first compile."""
    if not cfg.compile.share or world_size < 2:
        return
    try:
        cluster_secret()
    except ShareSecretError as e:
        raise ConfigError(str(e)) from None


def _compile_settings(cfg: JobConfig) -> None:
    """Build the ``DDPCompileConfig`` that ``compile_ddp`` will get. It holds every
    ``compile.*`` setting, so it is built whatever the parallel mode: a bad backend or
    fallback is refused the same way everywhere. With ``ddp.optimizer_in_backward`` it holds an
    optimizer of the class the job builds (over a stand-in parameter), so that what the config refuses of
    it is refused here too."""
    rules.check_reduce_dtype(cfg.ddp)
    rules.check_compression(cfg.ddp)
    optimizer = None
    if cfg.ddp.optimizer_in_backward:  # check_optimizer_in_backward: parallel=ddp; train.lr is checked later
        optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(1))], 1e-3, 0.0, torch.device("cpu"))
    try:
        ddp_compile_config(cfg, optimizer=optimizer)
    except SettingError as e:
        raise _compile_error(e, cfg.compile, cfg.ddp.strategy) from None


def _compile_error(e: SettingError, c: CompileConfig, strategy: str) -> ConfigError:
    """DDPCompileConfig's refusal of ``e.setting``, in the launcher's spelling."""
    if e.setting == "share_timeout_s":
        return ConfigError(
            f"compile.share_timeout_s={c.share_timeout_s!r} is not valid: it is the longest a rank waits for another "
            "rank's compile, a positive number of seconds. Give the longest compile you expect with margin, e.g. "
            "compile.share_timeout_s=3600 (the default is 7200)."
        )
    if e.setting in ("backend", "mode", "options", "blocks"):  # the library's message lists the valid choices
        return ConfigError(f"compile.{e.setting}={getattr(c, e.setting)!r}: {e}")
    if e.setting == "fallback":
        return ConfigError(
            f"compile.fallback={c.fallback!r} is not one of {', '.join(FALLBACKS)}: 'warn' runs a partition that "
            "fails to compile eagerly, 'raise' stops on the error."
        )
    if e.setting == "cache_dir":
        return ConfigError(
            f"compile.cache_dir={c.cache_dir!r} is not a directory: it must name a directory (created if missing) "
            "to keep one compile-cache file per model and config in. Pass a directory path, e.g. "
            "compile.cache_dir=/scratch/compile_cache."
        )
    if e.setting == "strategy":
        return rules.strategy_error(strategy)
    if e.setting == "bucket_cap_mb":  # the launcher passes only 'auto' to compile_ddp
        return rules.auto_caps_error(f"ddp.strategy={strategy}")
    if e.setting == "optimizer":  # the job's AdamW, given as compile_ddp(optimizer=...)
        return in_backward_refusal(e, strategy)
    return ConfigError(f"the compile.* settings cannot work together: {e}")


# --- fsdp.*: fsdp_opt.FSDPConfig ------------------------------------------------------

# The fsdp.* settings fsdp_opt.FSDPConfig checks, and how the launcher words a refusal.
_FSDP_ERRORS = {
    "strategy": "fsdp.strategy={!r} is not valid: per_block compiles each block before FSDP2 shards it; traced "
                "compiles the whole model with FSDP's collectives inside the graph. Use fsdp.strategy=per_block (the "
                "default) or fsdp.strategy=traced.",
    "shard_unit_mb": "fsdp.shard_unit_mb={!r} is not valid: it must be a positive size in MiB; consecutive blocks "
                     "are grouped into one shard unit until its all-gather holds that many MiB. Give a size, e.g. "
                     "fsdp.shard_unit_mb=4, fsdp.shard_unit_mb=auto (the default), or fsdp.shard_unit_mb=null for "
                     "one unit per block.",
    "prefetch": "fsdp.prefetch={!r} is not valid: it is how many shard units ahead to all-gather, a non-negative "
                "integer. Use fsdp.prefetch=1 (the default), or fsdp.prefetch=0 to leave FSDP2's implicit "
                "prefetching alone.",
}


def _fsdp_settings(f: FSDPOptions) -> None:
    """``fsdp.strategy``, ``fsdp.shard_unit_mb`` and ``fsdp.prefetch`` through ``fsdp_opt.FSDPConfig``. Its
    ValueError does not name the field (fsdp_opt raises no SettingError), so each is
    checked by a config that sets only that field; the job builds the whole config
    (``launch.runtime.parallel.fsdp_config``) when it shards."""
    for name, message in _FSDP_ERRORS.items():
        try:
            fsdp_opt.FSDPConfig(**{name: getattr(f, name)})
        except ValueError:
            raise ConfigError(message.format(getattr(f, name))) from None
    if f.memory_budget_mb is not None:
        try:
            fsdp_opt.FSDPConfig(strategy=f.strategy, memory_budget_mb=f.memory_budget_mb)
        except ValueError:
            raise ConfigError(
                f"fsdp.memory_budget_mb={f.memory_budget_mb!r} with fsdp.strategy={f.strategy}: the budget bounds "
                "how many gathered parameter MiB traced FSDP holds at once; it must be a positive number and needs "
                "fsdp.strategy=traced. Set fsdp.strategy=traced, or drop fsdp.memory_budget_mb."
            ) from None
