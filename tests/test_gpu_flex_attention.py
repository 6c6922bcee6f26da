"""FlexAttention in activation-checkpointed blocks under compile_ddp with Inductor on a GPU,
split and traced: two ranks sharing the GPU over gloo, losses and gradients equal eager
DDP's at every step (the CPU variant: tests/test_ddp_checkpointed_attention.py)."""

from __future__ import annotations

import pytest

from _attention_blocks import check, rank_run
from _gpu import GPU

pytestmark = GPU


@pytest.mark.parametrize("strategy", ["split", "traced"])
def test_checkpointed_flex_attention_with_inductor_trains_as_eager_ddp(run_ranks, strategy):
    check(run_ranks(rank_run, "flex", strategy, "cuda", "inductor", timeout=600), strategy)
