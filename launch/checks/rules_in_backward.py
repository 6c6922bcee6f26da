"""The launcher's rules for ``ddp.optimizer_in_backward=true``: the settings that read every
gradient after backward, or need the update to come after it, refused with the fix.

Note [Launcher features and the optimizer in backward]

Background
    With ``ddp.optimizer_in_backward=true`` the job hands its AdamW to ``compile_ddp``
    (``optimizer=``): each bucket is updated inside backward as soon as it is reduced, and
    its gradients are freed (Note [Optimizer in backward] in ``ddp_opt.in_backward.stepper``).
    After backward no gradient is left and the step has already happened, so every
    launcher feature that reads ``.grad`` after backward, or decides on the update there,
    must either still be right or be refused before any process group starts.

Algorithm
    Each feature of the training step, and what it does with the flag:

    - refused: ``parallel=fsdp|none`` (no DDP buckets), ``compile.backend=eager`` (no
      ``compile_ddp``), ``train.max_grad_norm > 0`` (a global norm needs every gradient
      before any update; this is also the only source of the logged gradient norm),
      ``train.precision=fp16`` (the GradScaler unscales and skips on inf over every gradient
      before any update), ``compile.optimizer=true`` (no step is left after backward to
      compile), ``train.on_nonfinite=skip`` (the decision comes after backward, when the
      update has been applied), ``diagnose=true`` (its probe runs synchronised backwards
      after training, each of which would update the model), and under ``ddp.strategy=traced``
      ``ddp.compression`` (the traced PowerSGD hook writes each gradient after it returned, so
      an update traced right after it would read the gradient unreduced; ``compile_ddp``
      refuses it too, but only once the process group runs);
    - correct as it is: ``train.grad_accum`` (the ``no_sync`` micro-steps update nothing;
      the synchronising one updates from the sum), the lr schedule (set on the optimizer's
      groups before backward, read at each update), evaluation (``no_grad``), checkpoints
      and resume (the optimizer's own ``state_dict``), ``train.on_nonfinite=stop`` (the
      loss is checked after the step's update with or without the flag, and the run stops
      before a checkpoint);
    - changed: the warm-up runs its backwards under ``no_sync`` (Note [Warm-up] in
      ``launch.step.train_step``), so that it still updates nothing.

Notes
    What ``ddp_opt`` itself refuses (an optimizer it cannot run per bucket, a strategy that
    cannot run the update) comes back as ``compiler.SettingError`` on the setting
    ``optimizer``, and ``launch.runtime.parallel.in_backward_refusal`` tells it as a setting of
    the job: from ``DDPCompileConfig`` before any process group (``launch.checks.validate``
    builds it with an optimizer as the job builds it), from ``compile_ddp`` as the job starts
    (exit code 2 either way).
"""

from __future__ import annotations

from ddp_opt.compression.powersgd import parse_compression

from ..config.schema import ConfigError, JobConfig, ParallelMode, Precision
from ..runtime.guard import OnNonfinite

__all__ = ["check_optimizer_in_backward"]

_FLAG = "ddp.optimizer_in_backward=true"
_OFF = "or set ddp.optimizer_in_backward=false to step the optimizer after backward"
_INSIDE = "each bucket is updated inside backward as soon as its all-reduce completes"


def check_optimizer_in_backward(cfg: JobConfig) -> None:
    """The settings that cannot work with ``ddp.optimizer_in_backward=true`` (Note [Launcher features
    and the optimizer in backward])."""
    if not cfg.ddp.optimizer_in_backward:
        return
    c, t, p = cfg.compile, cfg.train, cfg.parallel.name
    if p != ParallelMode.DDP:
        raise ConfigError(
            f"{_FLAG} with parallel={p}: the update inside backward follows each DDP bucket's all-reduce, and "
            f"parallel={p} has no DDP buckets. Use parallel=ddp, {_OFF}.")
    if c.backend == "eager":
        raise ConfigError(
            f"{_FLAG} with compile.backend=eager: the update inside backward is part of compile_ddp, and "
            f"compile.backend=eager calls no compile_ddp (nothing is compiled). Use compile.backend=aot_eager or "
            f"inductor, {_OFF}.")
    if t.max_grad_norm > 0:
        raise ConfigError(
            f"train.max_grad_norm={t.max_grad_norm} with {_FLAG}: clipping to the gradients' total norm needs every "
            f"gradient before any update, and {_INSIDE}. Set train.max_grad_norm=0 (no clipping), {_OFF}.")
    if t.precision == Precision.FP16:
        raise ConfigError(
            f"train.precision=fp16 with {_FLAG}: the fp16 GradScaler unscales every gradient and skips the step on "
            f"an inf one before any update, and {_INSIDE}. Use train.precision=bf16 (no scaler) or fp32, {_OFF}.")
    if c.optimizer:
        raise ConfigError(
            f"compile.optimizer=true with {_FLAG}: the optimizer runs inside backward, bucket by bucket, so no "
            f"optimizer step is left after backward to compile. Set compile.optimizer=false, {_OFF}.")
    if t.on_nonfinite == OnNonfinite.SKIP:
        raise ConfigError(
            f"train.on_nonfinite=skip with {_FLAG}: skipping decides after backward, once every rank's loss is "
            "known, and by then every bucket was already updated inside backward, so no update is left to skip. "
            "Use train.on_nonfinite=stop (the default: the run stops at a non-finite loss before it saves a "
            f"checkpoint), {_OFF}.")
    if cfg.ddp.strategy == "traced" and _compresses(cfg.ddp.compression):
        raise ConfigError(
            f"ddp.compression={cfg.ddp.compression} with {_FLAG} and ddp.strategy=traced: the traced PowerSGD hook "
            "writes each gradient after it returned, so an update traced right after it would read the gradient "
            "unreduced. Use ddp.strategy=split (which updates each bucket after its compressed all-reduce) or "
            f"ddp.compression=none, {_OFF}.")
    if cfg.diagnose:
        raise ConfigError(
            f"diagnose=true with {_FLAG}: the diagnosis times forward and backward with gradient sync after "
            "training, and every synchronised backward would update the model. Diagnose the same job with "
            "ddp.optimizer_in_backward=false.")


def _compresses(compression: str) -> bool:
    """``ddp.compression`` names a compression (an invalid one is ``rules.check_compression``'s to refuse)."""
    try:
        return parse_compression(compression) is not None
    except ValueError:
        return False
