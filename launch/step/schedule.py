"""The learning-rate schedule of the main job: ``train.lr_schedule``,
``train.warmup_steps`` and ``train.min_lr``.

Note [LR schedule]

Background
    A transformer usually trains with a short linear warm-up (Adam's moments are poor in
    the first steps) and a decay to a small lr. The lr must be the same at every step
    whether or not the run was resumed, and must not recompile a compiled optimizer.

Algorithm
    The lr of step ``s`` (1-based) is a pure function of ``s`` and the config
    (:meth:`Schedule.lr_at`; ``W = warmup_steps``, ``N = train.steps``,
    ``p = (s - W) / (N - W)``): ``lr * s / W`` while ``s <= W``; then ``constant``: lr;
    ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2``; ``linear``:
    ``lr - (lr - min_lr) * p``, so the last step runs at ``min_lr``. The loop sets it
    before each step (``OptimizerStep.set_lr``). The checkpoint's step is all the
    position a resume needs; a resume whose config plans another lr for the next step
    says so in one line (:func:`resume_note`), and the config wins.

Notes
    - The compiled optimizer reads the lr as a tensor, since a float lr is a constant to
      dynamo (Note [Compiled optimizer step]).
    - ``lr_schedule``, ``warmup_steps`` and ``min_lr`` are part of a checkpoint's
      identity; ``train.steps`` may change on resume.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from ..config.schema import LRSchedule, TrainConfig

__all__ = ["Schedule", "resume_note"]


@dataclass(frozen=True)
class Schedule:
    """The lr of every step (Note [LR schedule])."""

    kind: str = LRSchedule.CONSTANT.value  # an LRSchedule
    lr: float = 3e-3
    warmup_steps: int = 0
    min_lr: float = 0.0
    total_steps: int = 1

    @classmethod
    def of(cls, t: TrainConfig) -> Schedule:
        return cls(str(LRSchedule(t.lr_schedule).value), t.lr, t.warmup_steps, t.min_lr, t.steps)

    @property
    def varies(self) -> bool:
        """Whether the lr changes from step to step."""
        return self.kind != LRSchedule.CONSTANT or self.warmup_steps > 0

    def lr_at(self, step: int) -> float:
        """The lr of step ``step`` (1-based)."""
        w, n = self.warmup_steps, self.total_steps
        if step <= w:
            return self.lr * step / w
        if self.kind == LRSchedule.CONSTANT:
            return self.lr
        p = min(1.0, (step - w) / max(1, n - w))
        if self.kind == LRSchedule.COSINE:
            return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
        return self.lr - (self.lr - self.min_lr) * p

    def state_dict(self, step: int) -> dict[str, Any]:
        """What a checkpoint after ``step`` records: the settings and that step's lr."""
        return {"lr_schedule": {**asdict(self), "step": step, "last_lr": self.lr_at(step)}}


def resume_note(checkpoint: str, step: int, now: Schedule) -> str | None:
    """One line when this run's schedule gives step ``step + 1`` another lr than the
    schedule recorded in ``checkpoint`` would have; None when they agree (or the
    checkpoint predates schedules and the run's lr is constant)."""
    try:
        with open(os.path.join(checkpoint, "train_state.json")) as f:
            saved = json.load(f).get("lr_schedule")
    except (OSError, ValueError):
        saved = None
    if saved is None:
        return None if not now.varies else (
            f"resume: {checkpoint} records no lr schedule (written before train.lr_schedule existed); "
            f"step {step + 1} runs at lr {now.lr_at(step + 1):.4g} of this run's {now.kind} schedule")
    before = Schedule(**{k: saved[k] for k in ("kind", "lr", "warmup_steps", "min_lr", "total_steps")})
    a, b = before.lr_at(step + 1), now.lr_at(step + 1)
    if math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0):
        return None
    changed = [f"train.{k} {getattr(before, f)} -> {getattr(now, f)}"
               for k, f in (("steps", "total_steps"), ("lr", "lr")) if getattr(before, f) != getattr(now, f)]
    return (f"resume: the lr schedule changed ({', '.join(changed) or 'settings'}): step {step + 1} runs at lr "
            f"{b:.4g}, where the checkpoint's run would have used {a:.4g}")
