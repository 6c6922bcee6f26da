"""Evaluation on held-out batches during training: ``train.eval_every`` and
``train.eval_batches``.

Note [Evaluation]

Background
    The training loss is measured on the batch the step trains on; how the model does
    on data it does not train on needs batches of their own, the same at every
    evaluation so that the numbers compare across steps.

Algorithm
    - Held-out data: the dataset's ``eval_batch(index, rank, world_size, batch_size,
      seq_len)`` for ``index < train.eval_batches``. The synthetic dataset's are the
      batches of steps ``-1, -2, ...`` of its stream. A dataset without ``eval_batch``
      is refused with ``train.eval_every > 0`` before the job starts.
    - After every ``train.eval_every``-th step (and the last), each rank runs those
      batches under ``model.eval()`` and ``no_grad`` in the training precision; one
      all-reduce averages the losses.
    - Uncompiled (``set_stance("force_eager")``, through the model below DDP, or the
      FSDP2 model itself): ``eval()`` and ``no_grad`` are in dynamo's guards, so a
      compiled evaluation would compile graphs of its own, count as recompiles of the
      training frames and trip ``train.no_recompile_after_warmup``. Keep
      ``eval_batches`` small: evaluation runs at eager speed.

Notes
    Synthetic sequences come from a small space, so single held-out sequences can
    coincide with training ones; the batches do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..config.schema import TrainConfig
from ..runtime.dist import DistEnv
from ..runtime.precision import autocast

__all__ = ["Evaluator", "build_evaluator"]


@dataclass
class Evaluator:
    """Runs the held-out evaluation (Note [Evaluation]).

    Attributes:
        model: the module to evaluate, uncompiled path: below DDP, or the FSDP2 or plain model.
        data: the training dataset (its held-out batches are used).
        every: evaluate after every ``every``-th step and after ``last``.
        last: the run's last step.
        batches, batch_size, seq_len: held-out batches per rank and their size.
        rank, world_size, precision, device: as in training.
    """

    model: torch.nn.Module
    data: Any
    every: int
    last: int
    batches: int
    batch_size: int
    seq_len: int
    rank: int = 0
    world_size: int = 1
    precision: str = "fp32"
    device: torch.device = torch.device("cpu")

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.last)

    def __call__(self) -> float:
        """The mean held-out loss over this rank's batches and every rank (collective)."""
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), device=self.device)
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                for i in range(self.batches):
                    x, y = self.data.eval_batch(i, self.rank, self.world_size, self.batch_size, self.seq_len)
                    with autocast(self.precision, self.device):
                        _, loss = self.model(x.to(self.device), y.to(self.device))
                    total += loss.detach().float()
        finally:
            self.model.train(was_training)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        return total.item() / (self.batches * self.world_size)


def build_evaluator(module: torch.nn.Module, data: Any, t: TrainConfig, env: DistEnv) -> Evaluator | None:
    """The evaluator of the wrapped ``module`` (DDP, FSDP2 or plain) as ``train`` says, or
    None when ``train.eval_every`` is 0. Held-out batches have the training micro-batch size."""
    if t.eval_every <= 0:
        return None
    model = module.module if isinstance(module, DistributedDataParallel) else module
    return Evaluator(model, data, t.eval_every, t.steps, t.eval_batches, t.batch_size // env.world_size // t.grad_accum,
                     t.seq_len, env.rank, env.world_size, t.precision, env.device)

