"""The rest of the GPU path (``pytest -m gpu``; skipped without CUDA): FSDP2 with
per-block compile and bf16 mixed precision, the compiled optimizer step (fused and
foreach AdamW) against the eager step, the compile cache serving Triton kernels to
a fresh Inductor directory, and the main job under torchrun on the GPU (one rank
over NCCL; two ranks sharing the GPU over gloo, with fp16 and a GradScaler)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from _cache_job import run_job
from _gpu import CFG, GPU, batch, cuda0, one_rank_nccl
from _torchrun import metrics, ok
from launch.models import GPT

pytestmark = [*GPU, pytest.mark.usefixtures("clean_dynamo")]


@pytest.mark.parametrize("strategy", ["per_block", "traced"])
def test_fsdp2_compiled_with_bf16_mixed_precision_matches_eager_fsdp2(strategy):
    # per_block: each block compiled before fully_shard; traced: the whole model with FSDP's collectives in the
    # graph, on NCCL (fsdp_opt.traced)
    import fsdp_opt
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with one_rank_nccl():
        device = cuda0()
        torch.manual_seed(0)
        model = GPT(CFG).to(device)
        ref = copy.deepcopy(model)
        plan = fsdp_opt.apply(model, strategy=strategy, compile="inductor", mp_policy=policy)
        fsdp_opt.apply(ref, compile=None, mp_policy=policy)
        if strategy == "per_block":
            assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.blocks)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for m in (model, ref)]
        for step in range(4):
            x, y = batch(step, 0, device)
            losses = [m(x, y)[1] for m in (model, ref)]
            for loss in losses:
                loss.backward()
            # Both compute in bf16 (FSDP2 casts the parameters; the loss too, so it moves
            # in steps of 2**-5 near 5.5), with Inductor fusing differently: relative errors.
            assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-2), f"step {step}"
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert p.dtype == torch.float32 and p.device.type == "cuda", f"{name}: the shards stay float32"
                g, h = p.grad.full_tensor(), q.grad.full_tensor()
                if h.norm() > 1e-6:
                    assert ((g - h).norm() / h.norm()).item() <= 5e-2, f"step {step}, grad of {name}"
            for opt in opts:
                opt.step()
                opt.zero_grad()
        if strategy == "traced":
            assert plan.traced.reduce_via in ("reduce_scatter", "all_to_all")
            assert "forward graph collectives:" in plan.table() and "backward graph collectives:" in plan.table()


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_compiled_adamw_step_matches_the_eager_step_without_recompiling(impl):
    from torch._dynamo.utils import counters

    from launch.step.optim import OptimizerStep

    device = cuda0()
    torch.manual_seed(0)
    model = GPT(CFG).to(device)
    ref = copy.deepcopy(model)
    kind = {impl: True}
    step = OptimizerStep(torch.optim.AdamW(model.parameters(), lr=1e-3, **kind), backend="inductor")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, **kind)
    for i in range(4):
        x, y = batch(i, 0, device)
        for m in (model, ref):
            m(x, y)[1].backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)  # the same weights and kernels: equal up to atomics
        step()
        ref_opt.step()
        ref_opt.zero_grad()
        if i == 0:
            frames = counters["stats"]["unique_graphs"]
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            # Note [Compiled optimizer step]: ulps, except where Adam normalises a float-noise gradient.
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-4, msg=lambda m: f"step {i}, {name}: {m}")
    assert counters["stats"]["unique_graphs"] == frames, "the optimizer step recompiled after step 1"


def test_the_compile_cache_serves_triton_kernels_to_a_fresh_inductor_dir(tmp_path):
    cold = run_job(tmp_path / "cache", tmp_path / "inductor_cold", "cuda")
    assert cold["load"] == "missing" and cold["saved"] and cold["partitions"] >= 2
    warm = run_job(tmp_path / "cache", tmp_path / "inductor_warm", "cuda")  # another machine, in effect
    assert warm["load"] == "loaded" and not warm["saved"]
    assert warm["aot"].get("autograd_cache_hit", 0) == warm["partitions"] == cold["partitions"]
    assert warm["aot"].get("autograd_cache_miss", 0) == 0
    assert warm["losses"] == pytest.approx(cold["losses"], rel=1e-5)
    assert warm["losses"] == pytest.approx(cold["eager_losses"], rel=1e-4)
    print(f"first step: cold {cold['first_step_s']:.2f} s, warm from the cache file {warm['first_step_s']:.2f} s")


def _finite_losses(run_dir) -> dict:
    m = metrics(run_dir)
    assert len(m["losses"]) == m["steps"] and all(math.isfinite(loss) for _, loss in m["losses"]), m["losses"]
    return m


def test_the_main_job_trains_on_one_gpu_over_nccl_in_bf16_with_the_compiled_optimizer(tmp_path, torchrun):
    run = torchrun(tmp_path, "compile=inductor", "compile.optimizer=true", "train.precision=bf16",
                   "train.steps=6", f"hydra.run.dir={tmp_path / 'run'}", nproc=1, timeout=600)
    ok(run)
    m = _finite_losses(tmp_path / "run")
    assert (m["device"], m["dist_backend"]) == ("cuda", "nccl")
    assert {p["status"] for p in m["partitions"]} == {"compiled"}


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="two ranks get a GPU each here (NCCL): nothing is shared")
def test_two_ranks_share_the_gpu_over_gloo_with_fp16_and_a_grad_scaler(tmp_path, torchrun):
    run = torchrun(tmp_path, "compile=inductor", "train.precision=fp16", "train.steps=6",
                   f"hydra.run.dir={tmp_path / 'run'}", nproc=2, timeout=600)
    ok(run)
    assert "2 ranks on this node share 1 GPU(s)" in run.stderr + run.stdout
    m = _finite_losses(tmp_path / "run")
    assert (m["device"], m["dist_backend"]) == ("cuda", "gloo")
