"""Variable-length batches: sequence lengths, padding strategies and the shapes
they compile.

Note [Padding strategies]

Background
    Real text comes in sequences of different lengths: most are short, a few are
    long. ``torch.compile`` specialises a graph on its input shapes, so a batch
    padded to its own longest sequence has a new shape almost every step, and
    each new shape is a recompile (until dynamo's ``recompile_limit`` is hit and
    the frame silently runs eagerly). Three ways out, chosen by ``data.padding``:

    - ``max``: pad every batch to ``train.seq_len``. One static shape, one
      graph, and the most wasted compute on padding.
    - ``multiple``: pad to the batch's longest, rounded up to
      ``data.pad_multiple``. At most ``ceil(seq_len / pad_multiple)`` static
      shapes, all compiled in a warm-up pass before training
      (:func:`warmup_lengths`), with ``dynamic=False`` so that dynamo's
      automatic dynamic shapes do not turn the second shape into a symbolic
      graph: each shape is one static graph, and the count must stay within
      ``recompile_limit`` (checked in ``launch.checks.validate``).
    - ``dynamic``: pad to the batch's longest and ``mark_dynamic`` the sequence
      axis: one graph with a symbolic length. The least padding; the generated
      code cannot specialise on the length.

Algorithm
    :func:`sequence_lengths` draws the lengths, a pure function of (seed, rank,
    step) like the tokens themselves. :func:`pad_batch` masks the positions past
    each sequence's length (inputs: ``pad_id``, targets: ``IGNORE_INDEX``, which
    ``F.cross_entropy`` skips, so the loss is the mean over real tokens only),
    then cuts the batch to the strategy's padded length. The model is causal:
    padding after a sequence never changes what its real positions see.

Notes
    - ``fixed`` lengths (the default) are every sequence at ``train.seq_len``:
      the batches are exactly those of the plain synthetic data.
    - ``skewed`` lengths are log-normal around ``seq_len / 8`` (sigma 1),
      clamped to ``[2, seq_len]``: about half the sequences are at most
      ``seq_len / 8`` long and about 2% reach ``seq_len``. Length 1 is never
      drawn: dynamo specialises sizes 0 and 1, so a symbolic length of 1 would
      recompile under ``padding=dynamic``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runtime._torch_internals import mark_dynamic
from .source import stream_seed

__all__ = ["IGNORE_INDEX", "PaddedBatch", "sequence_lengths", "padded_length", "padded_lengths",
           "warmup_lengths", "pad_batch"]

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index

_LENGTH_SALT = 0x9E3779B97F4A7C15  # keeps the length stream apart from the token stream of the same step


@dataclass
class PaddedBatch:
    """One (micro-)batch as the model sees it.

    Attributes:
        inputs, targets: int64, shape (batch, padded_length); padded targets are
            ``IGNORE_INDEX``.
        real_tokens: the number of targets that are not padding.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    real_tokens: int

    @property
    def padded_tokens(self) -> int:
        return self.targets.numel()


def sequence_lengths(kind: str, seed: int, rank: int, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """The real length of each sequence of a rank's batch: ``fixed`` (all ``seq_len``)
    or ``skewed`` (Note [Padding strategies]); a pure function of its arguments."""
    if kind == "fixed":
        return torch.full((batch_size,), seq_len, dtype=torch.int64)
    if kind != "skewed":
        raise ValueError(f"unknown data.lengths {kind!r}: expected fixed or skewed")
    g = torch.Generator().manual_seed(stream_seed(seed ^ _LENGTH_SALT, rank, step))
    normal = torch.randn(batch_size, generator=g, dtype=torch.float64)
    lengths = torch.exp(math.log(max(seq_len / 8, 1.0)) + normal).round().to(torch.int64)
    return lengths.clamp(min=min(2, seq_len), max=seq_len)


def padded_length(longest: int, seq_len: int, padding: str, multiple: int) -> int:
    """The sequence length a batch whose longest sequence is ``longest`` is padded to."""
    if padding == "max":
        return seq_len
    if padding == "multiple":
        return min(seq_len, -(-longest // multiple) * multiple)
    if padding == "dynamic":
        return max(longest, min(2, seq_len))
    raise ValueError(f"unknown data.padding {padding!r}: expected max, multiple or dynamic")


def padded_lengths(seq_len: int, padding: str, multiple: int) -> list[int] | None:
    """Every padded length the strategy can produce (None: any length, ``dynamic``)."""
    if padding == "dynamic":
        return None
    return sorted({padded_length(n, seq_len, padding, multiple) for n in range(1, seq_len + 1)})


def warmup_lengths(seq_len: int, padding: str, multiple: int) -> list[int]:
    """The lengths a warm-up pass feeds so that every graph training needs exists
    before step 1: each static padded length, or one length for ``dynamic`` (the
    longest; its graph is symbolic in the length, so one call compiles it)."""
    lengths = padded_lengths(seq_len, padding, multiple)
    return lengths if lengths is not None else [seq_len]


def pad_batch(inputs: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor, padding: str,
              multiple: int, device: torch.device | str = "cpu", pad_id: int = 0) -> PaddedBatch:
    """Mask the positions past each sequence's length and cut the batch to the
    strategy's padded length; ``dynamic`` marks the sequence axis dynamic.

    Args:
        inputs, targets: (batch, seq_len) token ids.
        lengths: (batch,) real lengths, each in ``[1, seq_len]``.
        padding: ``max``, ``multiple`` or ``dynamic``.
        multiple: ``data.pad_multiple`` (used by ``multiple``).
        device: where the batch goes; ``mark_dynamic`` marks the tensors the
            model will be called with, so the move happens here, first.
        pad_id: the input token at padded positions (never a target).
    """
    seq_len = inputs.shape[1]
    width = padded_length(int(lengths.max()), seq_len, padding, multiple)
    real = torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)
    inputs = torch.where(real, inputs, torch.full_like(inputs, pad_id))[:, :width].contiguous().to(device)
    targets = torch.where(real, targets, torch.full_like(targets, IGNORE_INDEX))[:, :width].contiguous().to(device)
    if padding == "dynamic":
        mark_dynamic(inputs, 1)
        mark_dynamic(targets, 1)
    return PaddedBatch(inputs, targets, int(lengths.clamp(max=width).sum()))
