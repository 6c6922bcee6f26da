"""The optimizer in backward (``compile_ddp(..., optimizer=opt)``): the bucket-by-bucket update
equals one ``optimizer.step()``, and what cannot run inside backward is refused at compile time
with the fix (Note [Optimizer in backward])."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from compiler import SettingError
from ddp_opt import DDPCompileConfig, compile_ddp
from ddp_opt.in_backward import BucketStep


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _grads(model: torch.nn.Module, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
], ids=["sgd-momentum", "adamw", "adam-for-loop"])
def test_bucket_by_bucket_update_equals_one_step_and_follows_the_lr_schedule(make):
    ours, theirs = _model(), _model()
    opt_ours, opt_theirs = make(ours.parameters()), make(theirs.parameters())
    sched_ours = torch.optim.lr_scheduler.StepLR(opt_ours, step_size=1, gamma=0.5)
    sched_theirs = torch.optim.lr_scheduler.StepLR(opt_theirs, step_size=1, gamma=0.5)
    stepper = BucketStep(opt_ours)
    params = list(ours.parameters())
    for step in range(3):
        grads = _grads(ours, step)
        for p, g in zip(theirs.parameters(), grads):
            p.grad = g.clone()
        opt_theirs.step()
        stepper.step(params[2:], [g.clone() for g in grads[2:]])  # the last layer's bucket is ready first
        stepper.step(params[:2], [g.clone() for g in grads[:2]])
        assert all(p.grad is None for p in params), "each gradient is freed after its update"
        opt_ours.step()  # the loop's own step after backward: no gradient left, nothing changes
        sched_ours.step()
        sched_theirs.step()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert stepper.updates == 6


def test_a_parameter_the_optimizer_does_not_hold_is_left_alone():
    model = _model()
    first = list(model.parameters())[:2]
    stepper = BucketStep(torch.optim.SGD(first, lr=1.0))
    last = list(model.parameters())[2]
    before = last.detach().clone()
    stepper.step([last], [torch.ones_like(last)])
    assert torch.equal(last, before) and last.grad is None


class _Wrapper(torch.optim.Optimizer):
    """As Accelerate's AcceleratedOptimizer: an Optimizer whose step steps the real one, kept as .optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)


def test_a_wrapped_optimizer_updates_only_the_bucket_it_is_given():
    model = _model()
    params = list(model.parameters())
    stepper = BucketStep(_Wrapper(torch.optim.SGD(params, lr=1.0)))
    for p in params:  # a later bucket's gradients, not reduced yet, are on .grad
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    stepper.step(params[2:], [torch.ones_like(p) for p in params[2:]])
    assert all(torch.equal(p, b) for p, b in zip(params[:2], before)), "the other bucket was not stepped"
    assert not any(torch.equal(p, b) for p, b in zip(params[2:], before))


def test_an_optimizer_that_steps_through_a_grad_scaler_is_refused_with_the_fix():
    # Accelerate's AcceleratedOptimizer under mixed_precision="fp16" keeps the real optimizer as .optimizer
    # and the GradScaler as .scaler; until its step, the gradients are scaled.
    # On CPU Accelerate makes no scaler; on CUDA, Accelerator.prepare_optimizer makes this call with its scaler.
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState

    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerate.Accelerator(cpu=True)  # the state AcceleratedOptimizer reads
        wrapped = AcceleratedOptimizer(opt, device_placement=False, scaler=torch.amp.GradScaler("cpu"))
        with pytest.raises(SettingError, match=r"optimizer=.*AcceleratedOptimizer steps through a GradScaler \(fp16 "
                                               r"mixed precision.*the gradients stay scaled until its step unscales "
                                               r"them.*train in bf16 \(no scaler\), or drop optimizer="):
            DDPCompileConfig(optimizer=wrapped)
        # without a scaler (fp32, bf16) it is the real optimizer, unwrapped
        plain = AcceleratedOptimizer(opt, device_placement=False)
        assert DDPCompileConfig(optimizer=plain).optimizer is plain
        assert BucketStep(plain).optimizer is opt
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_an_optimizer_whose_step_needs_a_closure_is_refused_with_the_fix():
    opt = torch.optim.LBFGS(_model().parameters())
    with pytest.raises(SettingError, match=r"optimizer=.*LBFGS\.step needs a closure.*drop optimizer= and call "
                                           r"optimizer\.step\(closure\) after backward"):
        DDPCompileConfig(optimizer=opt)


def test_something_else_than_an_optimizer_is_refused():
    with pytest.raises(SettingError, match=r"optimizer=.*is not a torch\.optim\.Optimizer"):
        DDPCompileConfig(optimizer=lambda: None)


def _ddp(**kwargs) -> DDP:
    return DDP(_model(), **kwargs)


def test_find_unused_parameters_is_refused_with_the_fix(gloo):
    ddp = _ddp(find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"find_unused_parameters=True.*zero gradient.*Pass "
                                         r"find_unused_parameters=False"):
        compile_ddp(ddp, backend="aot_eager", optimizer=opt)


def test_a_comm_hook_already_on_ddp_is_refused_with_the_fix(gloo):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = _ddp()
    ddp.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"comm hook 'allreduce_hook' is already registered.*DDP calls one hook"):
        compile_ddp(ddp, backend="aot_eager", optimizer=opt)


def test_a_comm_hook_after_compile_is_refused_with_the_fix(gloo):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = _ddp()
    compiled = compile_ddp(ddp, backend="aot_eager", optimizer=torch.optim.SGD(ddp.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"compiled with optimizer=.*Drop optimizer= to reduce through your hook"):
        compiled.register_comm_hook(None, allreduce_hook)
    assert compiled.in_backward is not None
