"""FlexAttention under compile_ddp with Inductor on a GPU: two ranks sharing the GPU over gloo,
losses and gradients equal eager DDP's at every step (the CPU variant, with SDPA:
tests/ddp_opt/test_ddp_checkpointed_attention.py).

- split, every block activation-checkpointed: the case PyTorch's splitter was reported to get
  silently wrong. The eager reference runs the blocks without checkpointing
  (tests/_attention_blocks.py says why).
- traced, without checkpointing; with it, traced is refused at the first forward, before any step
  (Note [Traced strategy]: compiled autograd cannot trace the recomputed FlexAttention)."""

from __future__ import annotations

from _attention_blocks import check, rank_run, traced_refusal
from _gpu import GPU

pytestmark = GPU


def test_checkpointed_flex_attention_with_inductor_split_trains_as_eager_ddp(run_ranks):
    check(run_ranks(rank_run, "flex", "split", "cuda", "inductor", timeout=600), "split")


def test_flex_attention_with_inductor_traced_trains_as_eager_ddp(run_ranks):
    check(run_ranks(rank_run, "flex", "traced", "cuda", "inductor", False, timeout=600), "traced")


def _refusal(rank: int, world_size: int) -> str:
    return traced_refusal("cuda")


def test_traced_refuses_checkpointed_flex_attention_before_the_first_step(run_ranks):
    for message in run_ranks(_refusal, timeout=300):
        assert "FlexAttention inside 3 activation-checkpointed region(s)" in message, message
        assert "Use strategy='split'" in message, message
