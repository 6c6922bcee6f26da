"""The finite-loss guard of the main job: what happens when a step's loss, or the
model, stops being finite (``train.on_nonfinite``).

Note [Finite-loss guard]

Background
    A too-high lr, an fp16 overflow or a bad batch makes the loss inf/NaN, and every
    later step too: a job that does not look exits 0, and rotation replaces the last good
    checkpoints with NaN ones. Each rank sees only its own loss, so every rank must
    decide at the same step.

Algorithm
    - ``stop`` (default) costs no extra collective: the per-step stats all-reduce sums
      the losses, and a sum with a non-finite term is non-finite on every rank, which
      raises :class:`NonFinite` (exit :data:`EXIT_NONFINITE`, one line with what to try).
    - ``skip`` must decide before the optimizer step: :func:`all_finite` all-reduces one
      flag after backward; a non-finite step zeroes the gradients and applies no update,
      is counted (``skipped_steps``), and ``train.max_consecutive_skips`` in a row stop
      the run so a diverged run does not spin.
    - A checkpoint is published only when every parameter is finite on every rank
      (:func:`model_finite`), so rotation never deletes the last finite one.

Notes
    The loss is checked, not the gradients: non-finite gradients make a non-finite loss
    one step later, with no checkpoint between. ``skip``'s all-reduce is one float per
    step (measured: docs/reliability.md, Non-finite loss).

    With ``ddp.optimizer_in_backward=true`` each bucket is updated inside backward, before
    any rank's loss is known. ``stop`` is unchanged: the loss is checked after the step's
    update with or without the flag, and the run stops before a checkpoint of that model.
    ``skip`` has no update left to skip and is refused before the run starts
    (Note [Launcher features and the optimizer in backward] in ``launch.checks.rules_in_backward``).
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.distributed as dist

__all__ = ["OnNonfinite", "NonFinite", "EXIT_NONFINITE", "all_finite", "model_finite", "nonfinite_loss", "nonfinite_model"]

EXIT_NONFINITE = 3  # the run diverged: the last finite checkpoint is kept; retrying as is would diverge again


class OnNonfinite(str, Enum):
    """``train.on_nonfinite``: stop the run, or skip the step's update."""
    STOP, SKIP = "stop", "skip"


class NonFinite(RuntimeError):
    """The loss or the model stopped being finite at ``step``; the message is one line saying
    what to try, ``what`` in a few words (the summary's stop line)."""

    exit_code = EXIT_NONFINITE

    def __init__(self, message: str, step: int | None = None, what: str = "") -> None:
        super().__init__(message)
        self.step, self.what = step, what


_TRY = "lower train.lr, use train.precision=fp32 or check the data"
def _resume(last_checkpoint: str | None) -> str:
    """What to resume from: only a checkpoint that exists is promised."""
    if last_checkpoint:
        return f"the last finite checkpoint, {last_checkpoint}, is kept: resume from it with train.resume=true"
    return ("no checkpoint was saved before it (train.checkpoint_every sets how often), so a new run starts from "
            "step 0")


def nonfinite_loss(step: int, loss: float, skipped_in_a_row: int = 0, last_checkpoint: str | None = None,
                   what: str = "loss") -> NonFinite:
    """The error for a non-finite mean ``what`` (the loss, or the evaluation loss) at ``step``
    (after ``skipped_in_a_row`` skipped steps); ``last_checkpoint``: the newest finite one, if any."""
    if skipped_in_a_row:
        return NonFinite(f"the loss was not finite for {skipped_in_a_row} steps in a row, up to step {step} "
                         f"(train.max_consecutive_skips={skipped_in_a_row}): the run has diverged and skipping "
                         f"does not bring it back. Try to {_TRY}; {_resume(last_checkpoint)}.",
                         step, f"the loss was not finite for {skipped_in_a_row} steps in a row")
    return NonFinite(f"the {what} at step {step} is {loss}, not finite, so the run stopped before it could save a "
                     f"non-finite model (train.on_nonfinite=stop). Try to {_TRY}, or set train.on_nonfinite=skip "
                     f"to skip such steps; {_resume(last_checkpoint)}.", step, f"the {what} is {loss}")


def nonfinite_model(step: int, last_checkpoint: str | None = None) -> NonFinite:
    """The error for parameters that are not finite when saving after ``step``."""
    return NonFinite(f"the model's parameters after step {step} are not finite, so checkpoint step {step} was not "
                     f"saved. Try to {_TRY}; {_resume(last_checkpoint)}.", step, "the parameters are not finite")


def all_finite(value: torch.Tensor) -> bool:
    """True when ``value`` is finite on every rank: one all-reduce (MIN) of a flag."""
    return _everywhere(torch.isfinite(value).all())


def _everywhere(ok: torch.Tensor) -> bool:
    """True when the boolean ``ok`` holds on every rank (one all-reduce, MIN, of a float)."""
    flag = ok.to(torch.float32).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor, FSDP2) parameter: no collective."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def model_finite(model: torch.nn.Module) -> bool:
    """True when every floating-point parameter and buffer of ``model`` is finite on
    every rank: local checks, then one all-reduce."""
    local = [torch.isfinite(_local(t).detach()).all() for t in (*model.parameters(), *model.buffers())
             if t.is_floating_point() and t.numel()]
    return _everywhere(torch.stack(local).all() if local else torch.ones((), dtype=torch.bool))
