"""Every DDP setting the user chose survives bucket realignment's new reducer (Note [Bucket realignment]):
DDP built with the setting on, compiled with compile_ddp (aot_eager), trained on one gloo rank past the
realignment, then the setting shown in effect on the new reducer, with losses and gradients equal, step by
step, to eager DDP's built with the same setting. A setting this torch's DDP lacks is skipped, naming it."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Callable

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_opt import compile_ddp
from tests._torch_range import needs_realignment

pytestmark = [pytest.mark.usefixtures("gloo_module", "clean_dynamo", "one_thread"), needs_realignment]

WIDTH = 32
CAP_MB = (WIDTH * WIDTH + WIDTH) * 4 / 2**20  # one Linear per bucket: four partitions, so realignment runs
STEPS = 4  # realigned before step 2's forward; the new reducer rebuilds its buckets at step 3's


class _Net(nn.Module):
    """Four Linear layers and a BatchNorm (buffers for the buffer-sync setting); ``unused`` gets no gradient
    (only under static_graph, which finds it without find_unused_parameters)."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.norm = nn.BatchNorm1d(WIDTH)
        self.unused = nn.Linear(2, 2) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        x = self.norm(x)
        for layer in self.layers[1:]:
            x = torch.tanh(layer(x))
        return x


def _ddp_takes(name: str) -> bool:
    return name in inspect.signature(DDP.__init__).parameters


@dataclasses.dataclass(frozen=True)
class Setting:
    """A DDP setting: how the user turns it on, and what shows it in effect after a step."""

    id: str
    kwargs: dict
    shown: Callable[[DDP, Callable[[], None]], bool]  # (ddp, one more step) -> in effect
    needs: str | None = None  # the DDP keyword a torch must take, else skipped
    manual: bool = False  # require_manual_backward_finalization=True: finalize_backward() after each backward
    unused: bool = False


def _params(ddp: DDP) -> list[nn.Parameter]:
    return [p for p in ddp.module.parameters() if p.requires_grad]


def _grads_are_bucket_views(ddp: DDP, step: Callable[[], None]) -> bool:
    step()
    return all(p.grad is None or p.grad._base is not None for p in _params(ddp))


def _static_graph(ddp: DDP, step: Callable[[], None]) -> bool:
    # A reducer that is not static waits for the unused parameter's gradient: the next forward raises
    # "Expected to have finished reduction in the prior iteration".
    step()
    step()
    return ddp.module.unused.weight.grad is None


def _buffers_not_synced(ddp: DDP, step: Callable[[], None]) -> bool:
    step()
    return not ddp.will_sync_module_buffers()


def _copies_batched(ddp: DDP, step: Callable[[], None]) -> bool:
    # Batched, the reducer copies a bucket's gradients in with one _foreach_copy_; else one copy_ per gradient.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return any(e.key == "aten::_foreach_copy_" for e in prof.key_averages())


def _bucket_allocated_per_backward(ddp: DDP, step: Callable[[], None]) -> bool:
    # Gradients are views of the buckets: a reducer that keeps its buckets hands the next backward the same
    # storage; a lazy one allocates a new one while the gradient kept from the last backward holds the old.
    step()
    kept = _params(ddp)[0].grad
    ddp.zero_grad(set_to_none=True)
    step()
    return _params(ddp)[0].grad.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()


def _finalized_by_the_caller(ddp: DDP, step: Callable[[], None]) -> bool:
    # The step's finalize_backward() raises ("manual backward finalization is not required") unless the reducer
    # waited for it, as it did at every step before.
    step()
    return ddp.require_manual_backward_finalization


SYNC_OFF = ({"forward_sync_buffers": False} if _ddp_takes("forward_sync_buffers")
            else {"broadcast_buffers": False})  # the same choice before torch 2.15 renamed it

SETTINGS = [
    Setting("gradient_as_bucket_view", {"gradient_as_bucket_view": True}, _grads_are_bucket_views),
    Setting("static_graph", {"static_graph": True}, _static_graph, unused=True),
    Setting("forward_sync_buffers=False", SYNC_OFF, _buffers_not_synced),
    Setting("batched_grad_copy", {"batched_grad_copy": True}, _copies_batched, needs="batched_grad_copy"),
    Setting("lazy_bucket_allocation", {"lazy_bucket_allocation": True, "gradient_as_bucket_view": True},
            _bucket_allocated_per_backward, needs="lazy_bucket_allocation"),
    Setting("manual_finalization", {}, _finalized_by_the_caller, needs="require_manual_backward_finalization",
            manual=True),
]


def _skip_unless_available(setting: Setting) -> None:
    if setting.needs is None:
        return
    present = (hasattr(DDP, setting.needs) if setting.needs == "require_manual_backward_finalization"
               else _ddp_takes(setting.needs))
    if not present:
        pytest.skip(f"torch {torch.__version__}'s DistributedDataParallel has no {setting.needs} (torch 2.15 added it)")


def _build(setting: Setting) -> DDP:
    torch.manual_seed(0)
    ddp = DDP(_Net(setting.unused), bucket_cap_mb=CAP_MB, **setting.kwargs)
    if setting.manual:
        ddp.require_manual_backward_finalization = True
    return ddp


def _step_fn(call: Callable, ddp: DDP, setting: Setting, losses: list[float]) -> Callable[[], None]:
    """One forward and backward on ``call`` (the compiled handle or eager DDP), inputs by step number."""
    def step() -> None:
        n = len(losses)
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(n))
        loss = call(x).square().mean()
        loss.backward()
        if setting.manual:
            ddp.finalize_backward()
        losses.append(loss.item())
    return step


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.id for s in SETTINGS])
def test_the_setting_is_in_effect_on_the_realigned_reducer_and_training_equals_eager_ddp(setting):
    _skip_unless_available(setting)
    ddp, ref = _build(setting), _build(setting)
    compiled = compile_ddp(ddp, backend="aot_eager")
    first_reducer = ddp.reducer
    runs = {}
    for name, call, model in (("compiled", compiled, ddp), ("eager", ref, ref)):
        losses: list[float] = []
        runs[name] = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      "losses": losses, "step": _step_fn(call, model, setting, losses)}
    for step in range(STEPS):
        grads = {}
        for name, run in runs.items():
            run["step"]()
            grads[name] = [None if p.grad is None else p.grad.clone() for p in _params(run["model"])]
            run["opt"].step()
            run["opt"].zero_grad(set_to_none=True)
        ours, eager = runs["compiled"]["losses"][step], runs["eager"]["losses"][step]
        assert ours == pytest.approx(eager, rel=1e-6), f"step {step}: loss {ours} != eager {eager}"
        for i, (got, want) in enumerate(zip(grads["compiled"], grads["eager"])):
            assert (got is None) == (want is None), f"step {step}: gradient {i} of one side is None"
            if got is not None:
                torch.testing.assert_close(got, want, msg=lambda m: f"step {step}: gradient {i}: {m}")
    assert compiled.aligned_caps is not None and ddp.reducer is not first_reducer, "realignment did not run"
    assert setting.shown(ref, runs["eager"]["step"]), f"{setting.id} is not shown in effect on eager DDP"
    assert setting.shown(ddp, runs["compiled"]["step"]), f"{setting.id} was lost with realignment's new reducer"
    torch.testing.assert_close(runs["compiled"]["losses"], runs["eager"]["losses"], rtol=1e-6, atol=1e-7)


def test_the_traced_strategy_runs_split_under_manual_finalization_saying_why():
    # DDP's python reducer, which strategy="traced" runs, has no manual finalization: finalize_backward() raises
    # under it. The split strategy keeps the setting, so compile_ddp runs that, as for its other fallbacks.
    manual = next(s for s in SETTINGS if s.manual)
    _skip_unless_available(manual)
    ddp = _build(manual)
    with pytest.warns(UserWarning, match=r"strategy='traced'\) runs the split strategy instead: "
                                         r"require_manual_backward_finalization=True: the python reducer it runs has "
                                         r"no manual finalization.*pass strategy='split'"):
        compiled = compile_ddp(ddp, backend="aot_eager", strategy="traced")
    assert compiled.strategy == "split"
    losses: list[float] = []
    step = _step_fn(compiled, ddp, manual, losses)
    for _ in range(STEPS):
        step()  # finalize_backward() after each backward, on the realigned reducer too
    assert compiled.aligned_caps is not None
