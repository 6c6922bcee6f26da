"""A user's datasets and models that break the job's contract, for the probe tests
(``data._target_=_custom_parts.<Name>``, ``model._target_=_custom_parts.<Name>``)."""

from __future__ import annotations

from torch import nn

from launch.data.source import SyntheticTokens


class WrongShape(SyntheticTokens):
    def batch(self, step, rank, world_size, batch_size, seq_len):
        x, y = super().batch(step, rank, world_size, batch_size, seq_len)
        return x[:, :-1], y[:, :-1]


class WrongDtype(SyntheticTokens):
    def batch(self, step, rank, world_size, batch_size, seq_len):
        x, y = super().batch(step, rank, world_size, batch_size, seq_len)
        return x.int(), y.int()


class ShortOnRank1(SyntheticTokens):
    """The synthetic data, except that rank 1's batch of step 3 is 16 tokens shorter: a
    shape only that rank sees, so a recompile on it alone (the step gate's test)."""

    def batch(self, step, rank, world_size, batch_size, seq_len):
        x, y = super().batch(step, rank, world_size, batch_size, seq_len)
        return (x[:, :-16], y[:, :-16]) if (rank, step) == (1, 3) else (x, y)


class PastVocab(SyntheticTokens):
    """Token ids from a tokenizer with a larger vocabulary than the model's."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        super().__init__(seed, vocab_size * 2)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 16, out: str = "tensor") -> None:
        super().__init__()
        self.emb, self.head, self.out = nn.Embedding(512, dim), nn.Linear(dim, vocab), out  # vocab: of the logits

    def forward(self, idx):
        logits = self.head(self.emb(idx))
        if self.out == "dict":
            return {"logits": logits}
        if self.out == "scalar":
            return logits.mean()
        return logits


class NoHeldOut:
    """A dataset with batch() only: no eval_batch, so train.eval_every > 0 is refused."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.tokens = SyntheticTokens(seed, vocab_size)

    def batch(self, step, rank, world_size, batch_size, seq_len):
        return self.tokens.batch(step, rank, world_size, batch_size, seq_len)


class HeldOut(NoHeldOut):
    """Held-out batches of its own: every eval_batch call is recorded (index, rank, size)."""

    calls: list = []

    def eval_batch(self, index, rank, world_size, batch_size, seq_len):
        HeldOut.calls.append((index, rank, batch_size, seq_len))
        return self.tokens.batch(10_000 + index, rank, world_size, batch_size, seq_len)


class BadHeldOut(NoHeldOut):
    def eval_batch(self, index, rank, world_size, batch_size, seq_len):
        x, y = self.tokens.batch(index, rank, world_size, batch_size, seq_len)
        return x.int(), y.int()
