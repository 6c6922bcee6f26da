"""The one validation pass of the main job, before any process group starts.

Every check raises :class:`~launch.schema.ConfigError` naming the launcher
setting, why the value cannot work and how to fix it; the entry point prints that
message and exits with code 2. The launcher's own rules are in ``launch.rules`` and ``launch.rules_train``;
where a library config already checks a rule, this module builds that config and
translates its error instead of checking again.
"""

from __future__ import annotations

from . import rules, rules_train
from .schema import CompileConfig, ConfigError, JobConfig

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
    _compile(cfg.compile)
    rules.check_compile_time(cfg.compile, cfg.parallel)
    rules.check_ddp(cfg.ddp, cfg.parallel)
    rules.check_auto_caps(cfg.ddp, cfg.compile)
    rules.check_fsdp(cfg.fsdp, cfg.parallel)
    rules.check_data(cfg.data)
    rules_train.check_train(cfg.train, world_size)
    rules.check_diagnose(cfg)
    rules_train.check_step(cfg, world_size)


def _compile(c: CompileConfig) -> None:
    from compiler import FALLBACKS, resolve_backend

    rules.choice("compile.fallback", c.fallback, FALLBACKS,
                 ": 'warn' runs a partition that fails to compile eagerly, 'raise' stops on the error.")
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
