"""Activation-checkpointed attention blocks under compile_ddp, split and traced, on 2 gloo
ranks: losses and gradients equal eager DDP's at every step. PyTorch's splitter was reported
to give silently wrong gradients with FlexAttention and activation checkpointing. FlexAttention
has no backward on CPU ("FlexAttention does not support backward on CPU", torch 2.13), so the
model runs here with SDPA, aot_eager; with FlexAttention and Inductor on a GPU in
tests/test_gpu_flex_attention.py."""

from __future__ import annotations

import pytest

from _attention_blocks import check, rank_run


@pytest.mark.parametrize("strategy", ["split", "traced"])
def test_checkpointed_sdpa_blocks_train_as_eager_ddp(run_ranks, strategy):
    check(run_ranks(rank_run, "sdpa", strategy, "cpu", timeout=600), strategy)
