"""Training data for the main job.

The default is synthetic: each batch is a pure function of (seed, rank, step), so
a run is reproducible and a resumed run replays exactly the batches the
interrupted one would have seen, with no data-loader state in the checkpoint.
A token file (``data=tokens``, ``launch.data.tokens``) and a user's dataset
(``data._target_``) follow the same contract.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch

__all__ = ["TokenSource", "SyntheticTokens", "stream_seed"]


class TokenSource(Protocol):
    """What the training loop asks of a dataset.

    ``batch`` must depend only on its arguments (and the object's constructor
    arguments): that is what makes a resumed run bit-for-bit the same. For
    ``train.eval_every > 0`` a dataset also provides ``eval_batch(index, rank,
    world_size, batch_size, seq_len)``: held-out batches, never trained on, with
    the same contract (``launch.step.evaluate``).
    """

    def batch(self, step: int, rank: int, world_size: int, batch_size: int, seq_len: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (inputs, targets), both int64 of shape (batch_size, seq_len), for this rank."""
        ...


def stream_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed for (seed, rank, step), well mixed so nearby triples do not collide."""
    digest = hashlib.blake2b(f"{seed}/{rank}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SyntheticTokens:
    """Arithmetic token sequences ``(start + stride * t) % vocab_size``.

    Random start and stride per sequence: there is something to learn (the
    stride, read from the context), so the loss falls and a broken training
    loop shows.
    """

    def __init__(self, seed: int, vocab_size: int, max_stride: int = 7) -> None:
        self.seed, self.vocab_size, self.max_stride = seed, vocab_size, max_stride

    def batch(self, step: int, rank: int, world_size: int, batch_size: int, seq_len: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(stream_seed(self.seed, rank, step))
        start = torch.randint(0, self.vocab_size, (batch_size, 1), generator=g)
        stride = torch.randint(1, self.max_stride + 1, (batch_size, 1), generator=g)
        t = torch.arange(seq_len + 1).unsqueeze(0)
        tokens = (start + stride * t) % self.vocab_size
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def eval_batch(self, index: int, rank: int, world_size: int, batch_size: int, seq_len: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch ``index`` (0-based): the batch of step ``-(index + 1)``, a step
        training never takes (Note [Evaluation] in ``launch.step.evaluate``)."""
        return self.batch(-(index + 1), rank, world_size, batch_size, seq_len)
