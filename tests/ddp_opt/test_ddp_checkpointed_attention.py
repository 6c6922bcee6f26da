"""Activation-checkpointed attention blocks under compile_ddp, split and traced, on 2 gloo
ranks: losses and gradients equal eager DDP's at every step. PyTorch's splitter was reported
to give silently wrong gradients with FlexAttention and activation checkpointing. FlexAttention
has no backward on CPU ("FlexAttention does not support backward on CPU", torch 2.13), so the
model runs here with SDPA, aot_eager; with FlexAttention and Inductor on a GPU in
tests/gpu/test_gpu_flex_attention.py. Two FlexAttention cases run here with aot_eager and the CPU guard
bypassed: traced without checkpointing (the op's dense reference, forward and backward, in both
models), and traced's refusal of checkpointed FlexAttention at the first forward (Note [Traced
strategy]), which needs no backward."""

from __future__ import annotations

from pathlib import Path

import pytest

import torch.nn.attention.flex_attention as flex_module

import _attention_blocks
from _attention_blocks import check, rank_run, traced_refusal
from _dist import single_rank_group


@pytest.mark.parametrize("strategy", ["split", "traced"])
def test_checkpointed_sdpa_blocks_train_as_eager_ddp(run_ranks, strategy):
    check(run_ranks(rank_run, "sdpa", strategy, "cpu", timeout=600), strategy)


def _traced_flex_rank(rank: int, world_size: int):
    # CPU FlexAttention refuses inputs that need gradients (Inductor's CPU kernel has no backward); with
    # aot_eager both models run the op's dense reference, forward and backward.
    flex_module._validate_device = lambda *args: None
    return rank_run(rank, world_size, "flex", "traced", "cpu", "aot_eager", False)


def test_flex_attention_without_checkpointing_under_traced_trains_as_eager_ddp(run_ranks):
    check(run_ranks(_traced_flex_rank, timeout=600), "traced")


_CHECKPOINT_LINE = next(n for n, line in enumerate(Path(_attention_blocks.__file__).read_text().splitlines(), 1)
                        if "= checkpoint(block" in line)


def test_traced_refuses_checkpointed_flex_attention_at_the_first_forward_and_says_what_to_use(monkeypatch):
    # CPU FlexAttention refuses inputs that need gradients; the refusal comes before any backward.
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    with single_rank_group():
        message = traced_refusal("cpu")
    assert "FlexAttention inside 3 activation-checkpointed region(s) (checkpoint called at " in message, message
    assert f"{_attention_blocks.__file__}:{_CHECKPOINT_LINE})" in message, message
    assert "compiled autograd" in message and "Use strategy='split'" in message, message
