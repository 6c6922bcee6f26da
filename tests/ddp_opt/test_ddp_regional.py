"""Regional compile under DDP (Note [Regional compile]): one graph for all blocks,
buckets of whole blocks that DDP's reducer ends up using, parity with eager DDP."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import single_rank_group
from ddp_opt import BucketCaps, compile_ddp, measure_alignment
from ddp_opt.strategies.regional import find_ddp_blocks, plan_block_buckets
from launch.models import GPT, GPTConfig

CFG8 = GPTConfig(n_layer=8, n_embd=32, n_head=2, vocab_size=64, block_size=16)


def _block_bytes(model):
    return sum(p.numel() * 4 for p in model.blocks[0].parameters())


def test_buckets_are_whole_blocks_grouped_up_to_the_cap_in_gradient_ready_order():
    model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    b = _block_bytes(model)
    buckets = plan_block_buckets(model, find_ddp_blocks(model), BucketCaps(3 * b, first_bucket_cap=b))
    names = [sorted({n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "") for n in bk.params})
             for bk in buckets]
    # Forward order. In gradient-ready order (the reverse) ln_f opens the first bucket (cap b) and block 3
    # fills it; blocks 2..0 reach the 3b cap of the second; the embeddings (and tied head) come last,
    # alone since the second bucket is full. Blocks are never cut.
    assert names == [["wpe", "wte"], ["blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "ln_f"]]
    assert buckets[1].size == 3 * b and buckets[2].size == b + sum(p.numel() * 4 for p in model.ln_f.parameters())
    assert sum(bk.size for bk in buckets) == sum(p.numel() * 4 for p in model.parameters())


def test_a_model_without_repeated_blocks_fails_with_how_to_fix():
    with single_rank_group():
        ddp = DDP(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
        with pytest.raises(ValueError) as info:
            compile_ddp(ddp, backend="aot_eager", strategy="regional")
    msg = str(info.value)
    assert msg.startswith("Regional compile needs repeated blocks to compile once and reuse: blocks='auto' found "
                          "no repeated blocks in Sequential")
    assert "Pass them as compile_ddp(..., strategy='regional', blocks=...) (launcher: compile.blocks=...)" in msg
    assert "ddp.strategy=split" in msg


def test_eight_blocks_compile_one_graph_match_eager_and_realign_to_blocks(clean_dynamo):
    graphs = []

    def count(backend):
        def counted(gm, example_inputs):
            graphs.append(gm)
            return backend(gm, example_inputs)
        return counted

    with single_rank_group():
        torch.manual_seed(0)
        model = GPT(CFG8)
        ref = DDP(copy.deepcopy(model), bucket_cap_mb=2 * _block_bytes(model) / 2**20)
        ddp = DDP(model, bucket_cap_mb=2 * _block_bytes(model) / 2**20)
        compiled = compile_ddp(ddp, backend="aot_eager", strategy="regional", wrap_backend=count)
        for step in range(4):
            x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
            loss, ref_loss = compiled(x, x)[1], ref(x, x)[1]
            loss.backward(), ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss)
            for (name, p), q in zip(model.named_parameters(), ref.module.parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step} grad {name}: {m}")
            ddp.zero_grad(), ref.zero_grad()
        assert len(graphs) == 1  # the block's forward, traced once for all 8 instances
        a = measure_alignment(ddp, compiled.buckets)
        # four buckets of two blocks (ln_f rides in the first, ready first); the embeddings come after a full one
        assert len(compiled.buckets) == 8 // 2 + 1 and a.fraction == 1.0


def _two_rank_parity(rank, world_size):
    torch.manual_seed(0)
    model = GPT(CFG8)
    ref = DDP(copy.deepcopy(model), bucket_cap_mb=0.05)
    ddp = DDP(model, bucket_cap_mb=0.05)
    compiled = compile_ddp(ddp, backend="aot_eager", strategy="regional")
    opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        loss, ref_loss = compiled(x, x)[1], ref(x, x)[1]
        loss.backward(), ref_loss.backward()
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    return losses, measure_alignment(ddp, compiled.buckets).fraction


@pytest.mark.slow
def test_two_ranks_match_eager_ddp_step_by_step(run_ranks):
    results = run_ranks(_two_rank_parity, world_size=2)
    for losses, alignment in results:
        for ours, eager in losses:
            assert ours == pytest.approx(eager, rel=1e-5)
        assert alignment == 1.0
    assert results[0][0] != results[1][0]  # different data per rank: the all-reduce matters
