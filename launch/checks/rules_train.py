"""The launcher's config rules for the training run: sizes and intervals of
``train``, checkpoints and resume, and the step techniques (padding, precision,
gradient accumulation, compiled optimizer), the lr schedule, gradient clipping and
evaluation. Each ``check_*`` raises
:class:`~launch.config.schema.ConfigError` naming the setting, why its value cannot work
and how to fix it; ``launch.checks.validate`` runs them.
"""

from __future__ import annotations

import math

from compiler.cache import unsafe_folder

from ..checkpoint.resume import plan_resume
from ..checkpoint.run_identity import run_identity
from ..config.schema import ConfigError, JobConfig, Lengths, LRSchedule, Padding, ParallelMode, Precision, TrainConfig
from ..runtime._torch_internals import recompile_limit, refuse_no_recompile
from ..runtime.dist import restarted_by_torchrun
from ..runtime.guard import OnNonfinite
from .rules import choice, positive, require_cuda

__all__ = ["check_train", "check_resume", "check_checkpoint_trust", "check_nonfinite", "check_step", "check_schedule",
           "check_clip_and_eval"]


def check_train(t: TrainConfig, world_size: int) -> None:
    for name, kind, why, example in (
        ("steps", "a positive integer", "it is the number of optimizer steps to run", "20"),
        ("batch_size", "a positive integer", "it is the global batch, in sequences", "8"),
        ("seq_len", "a positive integer", "it is the tokens per sequence", "64"),
        ("lr", "a positive number", "it is AdamW's learning rate", "3e-3"),
        ("log_interval", "a positive integer", "rank 0 prints every log_interval steps", "10"),
        ("keep_last", "a positive integer", "it is how many checkpoints to keep", "2"),
        ("timeout_s", "a positive number of seconds",
         "every collective fails after that long, so that a dead peer stops the job instead of hanging it", "300"),
    ):
        positive(f"train.{name}", getattr(t, name), kind, why, f"Set e.g. train.{name}={example}.")
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
    check_nonfinite(t)
    check_schedule(t)
    check_clip_and_eval(t)


def check_schedule(t: TrainConfig) -> None:
    """``train.lr_schedule``, ``train.warmup_steps`` and ``train.min_lr`` (Note [LR schedule] in
    ``launch.step.schedule``)."""
    choice("train.lr_schedule", t.lr_schedule, LRSchedule,
           ": it is the lr after the warm-up. Use train.lr_schedule=constant (train.lr throughout, the default), "
           "cosine or linear (decay from train.lr to train.min_lr at the last step).")
    if isinstance(t.warmup_steps, bool) or t.warmup_steps < 0:
        raise ConfigError(
            f"train.warmup_steps={t.warmup_steps} is negative: it is the number of steps whose lr rises linearly to "
            "train.lr. Set e.g. train.warmup_steps=100, or 0 for no warm-up."
        )
    decays = t.lr_schedule != LRSchedule.CONSTANT
    if t.warmup_steps > t.steps or (decays and t.warmup_steps == t.steps):
        raise ConfigError(
            f"train.warmup_steps={t.warmup_steps} with train.steps={t.steps}: "
            + (f"the {t.lr_schedule} decay starts after the warm-up and ends at the last step, so it needs at least "
               "one step after the warm-up" if decays else "the warm-up would not reach train.lr before the run ends")
            + f". Lower train.warmup_steps below {t.steps}, or raise train.steps."
        )
    if not 0.0 <= t.min_lr <= t.lr:
        raise ConfigError(
            f"train.min_lr={t.min_lr} is not in [0, train.lr={t.lr}]: it is the lr the {t.lr_schedule} schedule "
            "decays to at the last step. Set e.g. train.min_lr=0.0 or a tenth of train.lr."
        )
    if t.min_lr and not decays:
        raise ConfigError(
            f"train.min_lr={t.min_lr} with train.lr_schedule=constant: only cosine and linear decay to min_lr, so it "
            "would be silently ignored. Use train.lr_schedule=cosine (or linear), or drop train.min_lr."
        )


def check_clip_and_eval(t: TrainConfig) -> None:
    """``train.max_grad_norm`` (Note [Gradient clipping] in ``launch.step.optim``), ``train.eval_every`` and
    ``train.eval_batches`` (Note [Evaluation] in ``launch.step.evaluate``; a user dataset's ``eval_batch`` is
    ``launch.checks.probe``'s check)."""
    if not (t.max_grad_norm >= 0 and math.isfinite(t.max_grad_norm)):
        raise ConfigError(
            f"train.max_grad_norm={t.max_grad_norm} is not valid: the gradients' total L2 norm is clipped to it, so "
            "it must be a positive number. Set e.g. train.max_grad_norm=1.0, or 0 to switch clipping off."
        )
    if isinstance(t.eval_every, bool) or t.eval_every < 0:
        raise ConfigError(
            f"train.eval_every={t.eval_every} is negative: it is a step interval. Set e.g. train.eval_every=100, "
            "or 0 to switch evaluation off."
        )
    if t.eval_every:
        positive("train.eval_batches", t.eval_batches, "a positive integer",
                 "each evaluation averages the loss of that many held-out batches per rank",
                 "Set e.g. train.eval_batches=4, or train.eval_every=0 to switch evaluation off.")


def check_nonfinite(t: TrainConfig) -> None:
    """``train.on_nonfinite`` and ``train.max_consecutive_skips`` (Note [Finite-loss guard] in
    ``launch.runtime.guard``)."""
    choice("train.on_nonfinite", t.on_nonfinite, OnNonfinite,
           ": it is what a step whose loss is inf or NaN does. Use train.on_nonfinite=stop (end the run, the "
           "default) or train.on_nonfinite=skip (do not apply that step's update).")
    positive("train.max_consecutive_skips", t.max_consecutive_skips, "a positive integer",
             "with train.on_nonfinite=skip the run stops after that many non-finite steps in a row, so that a "
             "diverged run does not spin", "Set e.g. train.max_consecutive_skips=10.")


def check_resume(cfg: JobConfig, world_size: int) -> None:
    """The checkpoint folder against this run (Note [Resume policy] in ``launch.checkpoint.resume``):
    a folder others can write (:func:`check_checkpoint_trust`), and a foreign, unreadable or incompatible
    checkpoint, are refused before any process group."""
    restarted = restarted_by_torchrun()
    check_checkpoint_trust(cfg.train, restarted=restarted)
    plan_resume(cfg.train, run_identity(cfg, world_size), restarted=restarted)


def check_checkpoint_trust(t: TrainConfig, *, restarted: bool) -> None:
    """``train.checkpoint_dir`` must not be writable by others when the job writes or loads checkpoints
    there: loading one unpickles (Note [Trusted folders] in ``compiler.cache.trust``)."""
    if not (t.checkpoint_every or t.resume or restarted):
        return  # the folder is neither written nor read
    why = unsafe_folder(t.checkpoint_dir)
    if why is not None:
        raise ConfigError(
            f"train.checkpoint_dir={t.checkpoint_dir!r} is not private: {why}. Loading a checkpoint unpickles "
            "(DCP's torch.load(weights_only=False)), so whoever can write there can run code in this job. Run "
            "chmod go-w on that folder, or choose a folder of your own that others cannot write (or set "
            "train.checkpoint_every=0 and train.resume=false to use no checkpoints)."
        )


def check_step(cfg: JobConfig, world_size: int) -> None:
    """The training-step techniques: padding, precision, accumulation, compiled optimizer."""
    d, t, c = cfg.data, cfg.train, cfg.compile
    choice("data.lengths", d.lengths, Lengths,
           ": fixed makes every sequence train.seq_len long, skewed draws realistic lengths (most short, a few "
           "long). Use data.lengths=fixed (the default) or data.lengths=skewed.")
    choice("data.padding", d.padding, Padding,
           ": it is how a batch of unequal sequences becomes one tensor. Use data.padding=max (pad to "
           "train.seq_len, the default), multiple (to the longest, rounded up to data.pad_multiple) or dynamic "
           "(mark_dynamic).")
    positive("data.pad_multiple", d.pad_multiple, "a positive integer",
             "padding=multiple rounds each batch's longest sequence up to a multiple of it",
             "Set e.g. data.pad_multiple=8.")
    if d.padding == Padding.MULTIPLE:
        limit, shapes = recompile_limit(), math.ceil(t.seq_len / d.pad_multiple)
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
    choice("train.precision", t.precision, Precision,
           ". Use train.precision=fp32 (the default), bf16 (autocast to bfloat16) or fp16 (autocast + grad "
           "scaler, CUDA only).")
    if t.precision == Precision.FP16:
        require_cuda("train.precision=fp16 needs a CUDA GPU, and none is visible: fp16 training needs a GradScaler "
                      "and float16 autocast, which this job runs on CUDA only. Use train.precision=bf16 on CPU, "
                      "or train.precision=fp32.")
        if c.optimizer:
            raise ConfigError(
                "train.precision=fp16 with compile.optimizer=true is not supported: the fp16 GradScaler skips "
                "steps with inf gradients outside the compiled step. Use train.precision=bf16 (no scaler), "
                "or compile.optimizer=false."
            )
    if t.precision != Precision.FP32 and cfg.parallel.name == ParallelMode.FSDP:
        raise ConfigError(
            f"train.precision={t.precision} with parallel=fsdp: FSDP2 has its own mixed precision (parameters "
            "gathered in bf16), and autocast on top of it is not supported by this job. Use "
            "fsdp.mixed_precision=bf16 with train.precision=fp32."
        )
    positive("train.grad_accum", t.grad_accum, "a positive integer",
             "it is the number of micro-batches per optimizer step", "Set e.g. train.grad_accum=1 (no accumulation).")
    local = t.batch_size // world_size
    if local % t.grad_accum:  # the batch divides over the ranks (check_train)
        raise ConfigError(
            f"train.grad_accum={t.grad_accum} does not divide the per-rank batch of {local} sequences "
            f"(train.batch_size={t.batch_size} over {world_size} rank(s)): every micro-batch must have the same "
            "size, for one compiled shape and equal loss weights. Pick train.grad_accum dividing "
            f"{local}, or change train.batch_size."
        )
    _compiled_step(cfg)


def _compiled_step(cfg: JobConfig) -> None:
    """compile.optimizer and train.no_recompile_after_warmup need something compiled (the latter also dynamo's
    RecompileError)."""
    c = cfg.compile
    if c.optimizer and c.backend == "eager":
        raise ConfigError(
            "compile.optimizer=true with compile.backend=eager: eager means no torch.compile at all, so there is "
            "no backend to compile the optimizer step with. Use compile=aot_eager or compile=inductor, or "
            "compile.optimizer=false."
        )
    if c.optimizer and cfg.parallel.name == ParallelMode.FSDP:
        raise ConfigError(
            "compile.optimizer=true is not supported with parallel=fsdp yet: the optimizer there steps sharded "
            "DTensor parameters, which this job has not tested compiled. Use compile.optimizer=false with fsdp."
        )
    if cfg.train.no_recompile_after_warmup and c.backend == "eager":
        raise ConfigError(
            "train.no_recompile_after_warmup=true with compile.backend=eager: nothing is compiled, so there is "
            "no recompile to forbid. Use compile=aot_eager or compile=inductor, or set "
            "train.no_recompile_after_warmup=false."
        )
    if cfg.train.no_recompile_after_warmup:
        try:
            refuse_no_recompile()
        except RuntimeError as e:
            raise ConfigError(str(e)) from None
