"""compile_ddp(optimizer=opt) on a CUDA GPU (``pytest -m gpu``; skipped without CUDA): the update
inside backward with CUDA's default AdamW (foreach), under the split strategy (chained to each
bucket's reduction on NCCL) and the traced one (in Inductor's Triton backward), one rank over
NCCL, step by step against eager DDP with ``optimizer.step()`` after backward
(Note [Optimizer in backward]). The CPU tests check the same on gloo and C++ kernels."""

from __future__ import annotations

import pytest
import torch

from _gpu import GPU, batch, cuda0, ddp_pair, one_rank_nccl
from ddp_opt import compile_ddp

pytestmark = [*GPU, pytest.mark.usefixtures("clean_dynamo")]

STEPS, LR = 4, 1e-3


def _train(strategy: str | None) -> dict:
    """STEPS steps of the compiled model with its update in backward (``strategy``) and of eager
    DDP with ``optimizer.step()`` after backward, on the same batches; per step both losses, the
    gradients backward left, and at the end the parameters."""
    device = cuda0()
    ddp, ref = ddp_pair(device)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1) for m in (ddp, ref))
    compiled = compile_ddp(ddp, backend="inductor", strategy=strategy, optimizer=opt)
    out: dict = {"losses": [], "ref_losses": [], "left": []}
    for step in range(STEPS):
        x, y = batch(step, 0, device)
        loss = compiled(x, y)[1]
        compiled.backward(loss)
        out["left"].append(sum(p.grad is not None for p in ddp.parameters()))
        opt.step()  # finds no gradient: the update ran in backward
        opt.zero_grad(set_to_none=True)
        ref_loss = ref(x, y)[1]
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        out["ref_losses"].append(ref_loss.item())
    torch.cuda.synchronize(device)
    out["params"] = [(p.detach().clone(), q.detach().clone()) for p, q in zip(ddp.parameters(), ref.parameters())]
    return out


@pytest.mark.parametrize("strategy", ["split", "traced"])
def test_update_in_backward_on_one_rank_over_nccl_matches_eager_ddp_step_after_backward(strategy):
    with one_rank_nccl():
        out = _train(strategy)
    # fp32 within 1e-4, as tests/gpu/test_gpu_ddp.py: Inductor reorders reductions, AdamW carries a few ulps.
    assert out["losses"] == pytest.approx(out["ref_losses"], abs=1e-4), strategy
    assert out["left"] == [0] * STEPS, f"{strategy}: backward left gradients, so an update did not run in it"
    for got, want in out["params"]:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
