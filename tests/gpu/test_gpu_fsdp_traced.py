"""Traced FSDP on the GPU path (``pytest -m gpu``; skipped without CUDA): one rank over
NCCL, the whole model compiled by Inductor with its all-gathers and reduce-scatters in the
graph, in bf16 with float32 reduction, step by step against eager FSDP2 with the same policy."""

from __future__ import annotations

import copy

import pytest
import torch

from _gpu import CFG, GPU, batch, cuda0, one_rank_nccl
from launch.models import GPT

pytestmark = [*GPU, pytest.mark.usefixtures("clean_dynamo")]


def test_traced_fsdp_on_nccl_with_bf16_matches_eager_fsdp2():
    import fsdp_opt
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with one_rank_nccl():
        device = cuda0()
        torch.manual_seed(0)
        model = GPT(CFG).to(device)
        ref = copy.deepcopy(model)
        plan = fsdp_opt.apply(model, strategy="traced", compile="inductor", mp_policy=policy)
        fsdp_opt.apply(ref, compile=None, mp_policy=policy)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for m in (model, ref)]
        for step in range(4):
            x, y = batch(step, 0, device)
            losses = [m(x, y)[1] for m in (model, ref)]
            for loss in losses:
                loss.backward()
            # both compute in bf16, Inductor fusing differently: relative errors, as for per_block
            assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-2), f"step {step}"
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert p.dtype == torch.float32 and p.device.type == "cuda", name
                g, h = p.grad.full_tensor(), q.grad.full_tensor()
                if h.norm() > 1e-6:
                    assert ((g - h).norm() / h.norm()).item() <= 5e-2, f"step {step}, grad of {name}"
            for opt in opts:
                opt.step()
                opt.zero_grad()
        assert plan.traced.reduce_via in ("reduce_scatter", "all_to_all")
        assert "forward graph collectives:" in plan.table() and "backward graph collectives:" in plan.table()
