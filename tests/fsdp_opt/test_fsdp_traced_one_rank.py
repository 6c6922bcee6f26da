"""Traced FSDP on one gloo rank in this process (``aot_eager``): it trains as the unsharded
model does, keeps FSDP2's parameter names and placements, gives the parameters back as
DTensors between steps, and refuses a forward that cannot be one graph in one line."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp_opt
from launch.models import GPT, GPTConfig

CFG = GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=8)

pytestmark = pytest.mark.usefixtures("gloo", "clean_dynamo")


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def test_one_rank_trains_as_the_unsharded_model_and_keeps_fsdp2s_names():
    torch.manual_seed(0)
    ref, model = GPT(CFG), GPT(CFG)
    model.load_state_dict(ref.state_dict())
    names = [n for n, _ in ref.named_parameters()]
    plan = fsdp_opt.apply(model, strategy="traced", compile="aot_eager", shard_unit_mb=None)
    assert [n for n, _ in model.named_parameters()] == names
    assert all(isinstance(p, DTensor) and str(p.placements) == "(Shard(dim=0),)" for p in model.parameters())
    assert model.lm_head.weight is model.wte.weight  # tied weights stay one parameter
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for step in range(3):
        losses = []
        for m, opt in zip((ref, model), opts):
            loss = m(*_batch(step))[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], abs=1e-6), f"step {step}"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.full_tensor(), q, atol=1e-6), name
    assert isinstance(model.blocks[0].mlp.fc.weight, DTensor)  # between steps the properties give the DTensor
    assert [u.blocks for u in plan.traced.units] == [(), ("blocks.0",), ("blocks.1",)]
    table = plan.table()
    assert "forward graph collectives:" in table and "backward graph collectives:" in table


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        x = self.layers[0](x)
        torch._dynamo.graph_break()
        return self.layers[1](x).sum()


def test_a_graph_break_is_refused_at_the_first_step_in_one_line_with_the_fix():
    model = _Breaks()
    fsdp_opt.apply(model, strategy="traced", compile="aot_eager", shard_unit_mb=None)
    with pytest.raises(RuntimeError) as caught:
        model(torch.randn(2, 4))
    message = str(caught.value)
    assert message.startswith("fsdp_opt.apply(strategy='traced'): the forward of _Breaks cannot be captured as one "
                              "graph (")
    assert "TORCH_LOGS=graph_breaks" in message and "strategy='per_block'" in message
    assert "\n" not in message
