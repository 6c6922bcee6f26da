"""The compiled optimizer step (compile.optimizer) against the eager one, and
autocast outside the compiled forward (train.precision) leaving no autocast
region in the graph the DDP planner splits."""

from __future__ import annotations

import copy

import gc

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import single_rank_group
from ddp_opt import compile_ddp
from launch.runtime.precision import autocast
from launch.step.optim import OptimizerStep, build_optimizer
from launch.models import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread", "clean_dynamo")

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
STEPS = 4
# Note [Compiled optimizer step]. After step 1 the two models differ by an ulp (1.2e-7 seen), and
# Adam carries that on. The attention's key bias has an analytically zero gradient (softmax is
# shift-invariant): its float-noise gradient (~1e-11) is normalised by Adam to an update of about
# lr * g / eps, so an ulp of difference in g shows there as ~1e-5 (3e-5 seen after 4 steps).
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
QKV_BIAS_TOL = dict(rtol=0.0, atol=1e-4)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def test_compiled_adamw_step_matches_eager_and_keeps_grads_in_place():
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = copy.deepcopy(model)
    init = copy.deepcopy(model)
    device = torch.device("cpu")
    step = OptimizerStep(build_optimizer(model.parameters(), 1e-2, 0.1, device), backend="aot_eager")
    ref_step = OptimizerStep(build_optimizer(ref.parameters(), 1e-2, 0.1, device))
    assert step.optimizer.defaults["foreach"] is True and step.compiled and not ref_step.compiled
    addresses = None
    for i in range(1, STEPS + 1):
        x, y = _batch(i)
        model(x, y)[1].backward()
        ref(x, y)[1].backward()
        step(), ref_step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            tol = QKV_BIAS_TOL if name.endswith("qkv.bias") else PARAM_TOL
            torch.testing.assert_close(p, q, **tol, msg=lambda m: f"step {i} {name}: {m}")
        # compiled: gradients zeroed in place, the same tensors every step; eager: freed
        now = [p.grad.data_ptr() for p in model.parameters()]
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        assert addresses in (None, now), f"step {i}: a gradient moved"
        addresses = now
        assert all(q.grad is None for q in ref.parameters())
    assert any((p - q).abs().max() > 0 for p, q in zip(model.parameters(), init.parameters()))  # it trained


def _autocast_nodes(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if "autocast" in str(n.target)]


class _AutocastInside(torch.nn.Module):
    """Control: autocast entered inside the compiled code does leave nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.lin(x).float().sum()


def test_autocast_outside_the_compiled_forward_leaves_no_autocast_nodes():
    graphs = []

    def capture(backend):
        def capturing(gm, example_inputs, **kw):
            graphs.append(gm)
            return backend(gm, example_inputs, **kw)
        return capturing

    inside = torch.compile(_AutocastInside(), backend=capture(torch._dynamo.lookup_backend("eager")))
    inside(torch.randn(2, 8))
    assert _autocast_nodes(graphs.pop()), "the check cannot see autocast nodes"
    torch.manual_seed(0)
    with single_rank_group():
        ddp = DDP(GPT(CFG), bucket_cap_mb=0.02)
        compiled = compile_ddp(ddp, backend="aot_eager", wrap_backend=capture)
        x, y = _batch(1)
        with autocast("bf16", torch.device("cpu")):
            logits, loss = compiled(x, y)
        loss.backward()
        buckets, statuses = len(compiled.buckets), {r.status for r in compiled.splitter.records}
        # Free DDP's reducer while its gloo group is alive: a reducer freed after the group is
        # destroyed can deadlock on the GIL in ~ProcessGroupGloo (seen hanging this test).
        del ddp, compiled
        gc.collect()
    assert logits.dtype == torch.bfloat16, "autocast did not reach the compiled forward"
    assert len(graphs) == 1 and _autocast_nodes(graphs[0]) == []
    assert buckets > 1 and statuses == {"compiled"}
