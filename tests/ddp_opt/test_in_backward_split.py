"""compile_ddp(optimizer=opt) under DDP's reducer (the split strategy): each bucket updated by the
user's optimizer inside backward, step by step equal to eager DDP + ``optimizer.step()`` after
backward, with SGD with momentum and AdamW, an LR scheduler, ``no_sync`` accumulation, bf16
reduction, realignment and a resume from the optimizer's state_dict (Note [Optimizer in backward])."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.link.peer_hooks import bucket_bf16_hook as torch_bf16_hook
from ddp_opt import compile_ddp, compile_for_ddp, compiled_ddp_of

STEPS, WIDTH, CAP_MB = 4, 48, 0.012  # several buckets, so the reducer is realigned after step 1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
                                 for _ in range(4)], torch.nn.Linear(WIDTH, 3))


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _train(rank: int, call, model, opt, backward, *, accum: int, steps: range, sched=None) -> dict:
    """The loop as users write it: optimizer.step() and zero_grad() after backward, also with ours."""
    losses, grads_left = [], []
    for step in steps:
        data = torch.Generator().manual_seed(1000 * step + rank)  # each rank, each step its own batch
        for micro in range(accum):
            x = torch.randn(6, WIDTH, generator=data)
            ddp = call if not hasattr(call, "ddp_model") else call.ddp_model
            sync = micro == accum - 1
            ddp.require_backward_grad_sync = sync  # nanoGPT's idiom for no_sync
            loss = call(x).square().mean() / accum
            backward(loss)
            losses.append(loss.item())
        grads_left.append(sum(p.grad is not None for p in model.parameters()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return {"losses": losses, "grads_left": grads_left, "params": [p.detach().clone() for p in model.parameters()]}


def _run(rank: int, name: str, accum: int, reduce_dtype, ours: bool | str, steps: range = range(STEPS),
         state: dict | None = None) -> dict:
    ddp = DDP(_model(), bucket_cap_mb=CAP_MB)
    opt = _optimizer(name, ddp.module)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # lr changes every step
    if state is not None:
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
    if not ours:
        if reduce_dtype is not None:
            ddp.register_comm_hook(None, torch_bf16_hook)
        out = _train(rank, ddp, ddp.module, opt, lambda loss: loss.backward(), accum=accum, steps=steps, sched=sched)
    elif ours == "compile_for_ddp":  # nanoGPT's order: the optimizer, compile, then DDP wraps the compiled model
        model = _model()
        opt = _optimizer(name, model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        ddp = DDP(compile_for_ddp(model, backend="aot_eager", optimizer=opt, reduce_dtype=reduce_dtype),
                  bucket_cap_mb=CAP_MB)
        out = _train(rank, ddp, model, opt, lambda loss: loss.backward(), accum=accum, steps=steps, sched=sched)
        compiled = compiled_ddp_of(ddp.module)
    else:
        compiled = compile_ddp(ddp, backend="aot_eager", optimizer=opt, reduce_dtype=reduce_dtype)
        out = _train(rank, compiled, ddp.module, opt, compiled.backward, accum=accum, steps=steps, sched=sched)
    if ours:
        out["updates"] = compiled.in_backward.updates
        out["aligned"] = compiled.aligned_caps is not None
        out["buckets"] = len([b for b in compiled.buckets if b.size > 0])
        out["released"] = compiled.in_backward.release.released_bytes
        out["grad_bytes"] = sum(p.numel() * p.element_size() for p in ddp.module.parameters())
    out["state"] = {"model": ddp.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    return out


CASES = [("sgd", 1, None), ("adamw", 1, None), ("sgd", 2, None), ("adamw", 2, None), ("adamw", 1, torch.bfloat16)]


def _ranks(rank: int, world_size: int) -> dict:
    results = {}
    for case in CASES:
        results[case] = {"eager": _run(rank, *case, ours=False), "ours": _run(rank, *case, ours=True)}
    # Resume: two steps, the optimizer's and scheduler's state_dicts, a fresh model and optimizer, two more.
    first = _run(rank, "adamw", 1, None, ours=True, steps=range(2))
    results["resumed"] = _run(rank, "adamw", 1, None, ours=True, steps=range(2, STEPS), state=first["state"])
    results["resumed"]["first_losses"] = first["losses"]
    results["compile_for_ddp"] = _run(rank, "adamw", 2, None, ours="compile_for_ddp")
    return results


@pytest.fixture(scope="module")
def results(run_ranks):
    return run_ranks(_ranks, timeout=900)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-accum{c[1]}-{'bf16' if c[2] else 'fp32'}")
def test_update_in_backward_equals_eager_ddp_step_after_backward(results, case):
    name, accum, _ = case
    for rank in results:
        eager, ours = rank[case]["eager"], rank[case]["ours"]
        # Each bucket's update is the optimizer's own elementwise step on that bucket's parameters.
        torch.testing.assert_close(ours["losses"], eager["losses"], rtol=1e-6, atol=1e-7)
        for got, want in zip(ours["params"], eager["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert ours["aligned"], "the reducer was realigned, so the update followed the new reducer's buckets too"
        # Every synchronised backward updated every bucket and freed every gradient: the loop's
        # optimizer.step() after it found none.
        assert ours["grads_left"] == [0] * STEPS
        assert eager["grads_left"] == [len(eager["params"])] * STEPS
        assert ours["updates"] >= STEPS + 1, "several buckets, each updated as its own reduction completed"
        # The last backward gave every bucket buffer back (Note [Bucket buffers between steps]), and the steps
        # after each release took them back before the reducer wrote them: the parity above.
        assert ours["released"] == ours["grad_bytes"]


def test_compile_for_ddp_takes_the_optimizer_too(results):
    case = ("adamw", 2, None)
    for rank in results:
        ours, eager = rank["compile_for_ddp"], rank[case]["eager"]
        torch.testing.assert_close(ours["losses"], eager["losses"], rtol=1e-6, atol=1e-7)
        for got, want in zip(ours["params"], eager["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert ours["grads_left"] == [0] * STEPS and ours["aligned"] and ours["updates"] >= STEPS + 1
        assert ours["released"] == ours["grad_bytes"]


def test_resume_from_the_optimizers_state_dict_is_loss_equal(results):
    case = ("adamw", 1, None)
    for rank in results:
        resumed = rank["resumed"]
        assert resumed["first_losses"] + resumed["losses"] == pytest.approx(rank[case]["ours"]["losses"], rel=1e-6)
        for got, want in zip(resumed["params"], rank[case]["ours"]["params"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
