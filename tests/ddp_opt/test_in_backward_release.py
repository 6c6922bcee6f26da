"""DDP's bucket buffers given back between steps under compile_ddp(optimizer=opt) (Note [Bucket
buffers between steps]): released at the end of each synchronised backward, taken back at each
bucket's first gradient of the next, with parity against eager DDP + ``optimizer.step()`` through
``no_sync`` accumulation and a forward under ``no_sync`` whose backward runs after the context;
and where the buffers stay (find_unused_parameters, static_graph, manual finalization)."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_opt import compile_ddp
from ddp_opt.in_backward.release import release_refusal

pytestmark = pytest.mark.usefixtures("gloo", "clean_dynamo")

WIDTH, CAP_MB = 32, 0.006  # 4.2 KiB per layer, ~6 KiB buckets: several buckets


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
                                 for _ in range(4)], torch.nn.Linear(WIDTH, 2))


def _bucket_storages(compiled) -> list[torch.UntypedStorage]:
    """The bucket storages the release recorded (one per bucket), as the next backward will take them."""
    return list({id(s): s for s, _ in compiled.in_backward.release._bucket_of.values()}.values())


def _train(ours: bool, plan: list[str]) -> dict:
    """One step per entry of ``plan``: ``sync``, ``no_sync`` (forward and backward inside the context)
    or ``no_sync_forward`` (forward inside, backward after the context: DDP does not reduce it); the
    loop's ``optimizer.step()`` and ``zero_grad()`` after every synchronised step."""
    ddp = DDP(_model(), bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    call = compile_ddp(ddp, backend="aot_eager", optimizer=opt) if ours else ddp
    out: dict = {"losses": [], "released": [], "live_between_steps": []}
    for step, kind in enumerate(plan):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
        with ddp.no_sync() if kind != "sync" else contextlib.nullcontext():
            loss = call(x).square().mean()
            if kind == "no_sync":
                loss.backward()
        if kind != "no_sync":
            loss.backward()
        out["losses"].append(loss.item())
        if kind == "sync":
            opt.step()
            opt.zero_grad(set_to_none=True)
            if ours:
                out["released"].append(call.in_backward.release.released_bytes)
                out["live_between_steps"].append(sum(s.nbytes() for s in _bucket_storages(call)))
    out["params"] = [p.detach().clone() for p in ddp.parameters()]
    out["grad_bytes"] = sum(p.numel() * p.element_size() for p in ddp.parameters())
    if ours:
        out["buckets"] = len(_bucket_storages(call))
    return out


@pytest.mark.parametrize("plan", [["sync"] * 4, ["no_sync", "sync", "no_sync", "sync", "sync"],
                                  ["sync", "no_sync_forward", "sync", "sync"]],
                         ids=["every-step", "no_sync-accumulation", "no_sync-forward-backward-after"])
def test_buckets_are_given_back_between_steps_and_training_equals_eager_ddp(plan):
    ours, eager = _train(True, plan), _train(False, plan)
    torch.testing.assert_close(ours["losses"], eager["losses"], rtol=1e-6, atol=1e-7)
    for got, want in zip(ours["params"], eager["params"]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert ours["buckets"] >= 2
    syncs = plan.count("sync")
    # Every synchronised backward gave back every bucket (the whole gradient size), and between steps none holds
    # memory; each was taken back before the reducer wrote it (the parity above).
    assert ours["released"] == [ours["grad_bytes"]] * syncs
    assert ours["live_between_steps"] == [0] * syncs


def test_buffers_stay_where_the_reducer_writes_a_bucket_before_its_gradients():
    # find_unused_parameters is refused with optimizer= altogether (tests/ddp_opt/test_in_backward_refusals.py).
    assert release_refusal(DDP(_model(), find_unused_parameters=True)) == "find_unused_parameters=True"
    ddp = DDP(_model(), bucket_cap_mb=CAP_MB, static_graph=True)
    assert release_refusal(ddp) == "static_graph=True"
    compiled = compile_ddp(ddp, backend="aot_eager", optimizer=torch.optim.SGD(ddp.parameters(), lr=0.1))
    assert compiled.in_backward.release is None


def _manual_finalization_run(ours: bool) -> tuple[list[float], list[torch.Tensor]]:
    ddp = DDP(_model(), bucket_cap_mb=CAP_MB)
    ddp.require_manual_backward_finalization = True
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    call = compile_ddp(ddp, backend="aot_eager", optimizer=opt) if ours else ddp
    if ours:
        assert release_refusal(ddp) == "require_manual_backward_finalization=True"
        assert call.in_backward.release is None
    losses = []
    for step in range(4):  # realigned at step 1: the new reducer waits for finalize_backward() too
        loss = call(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))).square().mean()
        loss.backward()
        ddp.finalize_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if ours:
        assert call.aligned_caps is not None
    return losses, [p.detach().clone() for p in ddp.parameters()]


@pytest.mark.skipif(not hasattr(DDP, "finalize_backward"),
                    reason=f"torch {torch.__version__}'s DistributedDataParallel has no manual backward finalization "
                           "(torch 2.15 added require_manual_backward_finalization)")
def test_buffers_stay_under_manual_finalization_and_training_equals_eager_ddp():
    # The reducer makes its views of every bucket in the caller's finalize_backward(), after backward's end,
    # where a buffer given back would be gone.
    (ours, ours_params), (eager, eager_params) = _manual_finalization_run(True), _manual_finalization_run(False)
    torch.testing.assert_close(ours, eager, rtol=1e-6, atol=1e-7)
    for got, want in zip(ours_params, eager_params):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif("lazy_bucket_allocation" not in inspect.signature(DDP.__init__).parameters,
                    reason=f"torch {torch.__version__}'s DistributedDataParallel has no lazy_bucket_allocation "
                           "(torch 2.15 added it)")
def test_a_ddp_with_lazy_buckets_keeps_them_and_the_release_runs_beside_it():
    # The buffers are given back by this release, which peaked lower than DDP's lazy allocation alone
    # (Note [Bucket buffers between steps]); the user's setting stays on the reducer compile_ddp re-creates.
    def train(ours: bool) -> tuple[list[float], list[torch.Tensor]]:
        ddp = DDP(_model(), bucket_cap_mb=CAP_MB, lazy_bucket_allocation=True)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        call = compile_ddp(ddp, backend="aot_eager", optimizer=opt) if ours else ddp
        losses = []
        for step in range(4):
            loss = call(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        if ours:
            assert ddp.lazy_bucket_allocation and call.aligned_caps is not None
            assert call.in_backward.release.released_bytes == sum(p.numel() * 4 for p in ddp.parameters())
        return losses, [p.detach().clone() for p in ddp.parameters()]

    (ours, ours_params), (eager, eager_params) = train(True), train(False)
    torch.testing.assert_close(ours, eager, rtol=1e-6, atol=1e-7)
    for got, want in zip(ours_params, eager_params):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def _powersgd_losses(ours: bool) -> list[float]:
    """Six steps under split with PowerSGD from step 2 (its hook then keeps error feedback per bucket
    index across steps): the update in backward, or the loop's optimizer.step() after it."""
    ddp = DDP(_model(), bucket_cap_mb=CAP_MB)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    compiled = compile_ddp(ddp, backend="aot_eager", compression="powersgd:2:2",
                           optimizer=opt if ours else None)
    losses = []
    for step in range(6):
        loss = compiled(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))).square().mean()
        compiled.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if ours:
        assert compiled.in_backward.release.released_bytes == sum(p.numel() * 4 for p in ddp.parameters())
    return losses


def test_powersgd_with_the_buffers_given_back_trains_as_its_step_after_backward():
    torch.testing.assert_close(_powersgd_losses(True), _powersgd_losses(False), rtol=1e-6, atol=1e-7)
