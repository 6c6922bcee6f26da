"""The parts CompiledDDP delegates to (ddp_opt.handle_parts), each alone: hand-built stand-ins
for the gate, the traced plan and the cache, and a one-rank gloo DDP where DDP itself is needed.
Nothing is compiled."""

import contextlib
import types

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_opt.handle_parts as parts
from ddp_opt.compression.hooks import own_hook
from ddp_opt.handle_parts import CacheAutoSave, CommHooks, GateHook, Realigner
from ddp_opt.strategies.traced.backward import TracedBackward
from ddp_opt.planning.buckets import Bucket
from ddp_opt.strategies.table import STRATEGIES


def _ddp(**kw):
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), **kw)


def _step(ddp):
    ddp(torch.randn(4, 8)).sum().backward()


def _fake_ddp(sync=True):
    return types.SimpleNamespace(require_backward_grad_sync=sync)


def _counting_hook(calls):
    def hook(state, bucket):
        calls.append(len(bucket.buffer()))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    return hook


def test_the_strategy_table_names_every_strategy_of_the_config():
    from ddp_opt.config import STRATEGIES as NAMES

    assert sorted(STRATEGIES) == sorted(NAMES)


# -- CommHooks ------------------------------------------------------------------------------------


def test_comm_hooks_registers_on_ddp_and_keeps_the_hook(gloo):
    ddp, calls = _ddp(), []
    hooks = CommHooks(ddp)
    hook = _counting_hook(calls)
    hooks.register(None, hook)
    _step(ddp)
    assert calls and hooks.hooks == [(None, hook)]


def test_comm_hooks_registers_the_own_hook_first_and_refuses_a_second(gloo):
    ddp = _ddp()
    own = own_hook(ddp.process_group, torch.bfloat16, None)
    hooks = CommHooks(ddp, own)
    assert hooks.hooks == [(own.state, own.bucket)]
    with pytest.raises(ValueError, match=r"compiled with reduce_dtype=torch.bfloat16, which all-reduces the gradients "
                                         r"through a comm hook of its own.*Compile with reduce_dtype=None"):
        hooks.register(None, _counting_hook([]))


def test_comm_hooks_refuses_a_bucket_hook_under_the_traced_strategy(gloo):
    hooks = CommHooks(_ddp(), traced=True)
    with pytest.raises(RuntimeError, match=r"strategy='traced'.*a DDP bucket hook cannot take that\. Compile with "
                                           r"strategy='split'"):
        hooks.register(None, _counting_hook([]))
    assert hooks.hooks == []


# -- Realigner ------------------------------------------------------------------------------------


def _layer_buckets(ddp):
    """One bucket per Linear, in forward order."""
    out = []
    for name in ("0", "2"):
        named = [(f"{name}.{n}", p) for n, p in ddp.module.get_submodule(name).named_parameters()]
        sizes = [p.numel() * p.element_size() for _, p in named]
        out.append(Bucket(size=sum(sizes), params=[n for n, _ in named], param_ids=[id(p) for _, p in named],
                          param_bytes=sizes, param_kinds=["torch.float32@cpu"] * len(named)))
    return out


def test_realigner_gives_ddp_the_partitions_as_caps_once_and_keeps_the_comm_hook(gloo):
    ddp, calls, changed = _ddp(), [], []
    hooks = CommHooks(ddp)
    hooks.register(None, _counting_hook(calls))
    buckets = _layer_buckets(ddp)
    realigner = Realigner(ddp, lambda: buckets, enabled=True, comm_hooks=hooks, on_change=lambda: changed.append(1))
    _step(ddp)
    realigner.before_forward()
    assert realigner.aligned_caps == (buckets[1].size, buckets[0].size) and changed == [1]
    for _ in range(2):  # DDP rebuilds at the next forward; measured after it
        ddp(torch.randn(4, 8)).sum().backward()
        realigner.after_forward()
    assert realigner.realignment is not None and realigner.realignment.fraction == 1.0
    calls.clear()
    realigner.before_forward()  # decided once: no second reducer
    _step(ddp)
    assert sorted(calls) == sorted(b.size // 4 for b in buckets)  # the hook survived, one call per partition


def test_realigner_does_nothing_when_off_or_before_the_plan_exists(gloo):
    ddp = _ddp()
    off = Realigner(ddp, lambda: _layer_buckets(ddp), enabled=False)
    early = Realigner(ddp, lambda: [], enabled=True)
    _step(ddp)
    off.before_forward()
    early.before_forward()
    assert off.aligned_caps is None and not off.decided
    assert early.aligned_caps is None and not early.decided


# -- CacheAutoSave --------------------------------------------------------------------------------


@pytest.fixture
def saves(monkeypatch):
    saved = []
    monkeypatch.setattr(parts, "save_on_local_rank0", lambda cache: saved.append(cache) or "/entry")
    return saved


def test_cache_auto_save_saves_once_at_the_second_call_with_gradients(saves):
    auto = CacheAutoSave("cache")
    auto.before_forward()
    with torch.no_grad():
        auto.before_forward()
    assert saves == []
    auto.before_forward()
    auto.before_forward()
    assert saves == ["cache"] and auto.attempted


def test_cache_auto_save_off_or_without_a_cache_saves_nothing(saves):
    off, none = CacheAutoSave("cache"), CacheAutoSave(None)
    off.enabled = False
    for _ in range(3):
        off.before_forward()
        none.before_forward()
    assert saves == []
    assert off.save() == "/entry" and saves == ["cache"]  # an explicit save still saves


# -- GateHook -------------------------------------------------------------------------------------


class _Gate:
    def __init__(self):
        self.met = 0

    def meet(self):
        self.met += 1


def _forward(hook):
    hook.before_forward()
    hook.after_forward()


def test_gate_hook_meets_after_each_synchronised_forward_only():
    gate, ddp = _Gate(), _fake_ddp()
    hook = GateHook(gate, ddp)
    _forward(hook)
    ddp.require_backward_grad_sync = False  # no_sync: no collective follows
    _forward(hook)
    ddp.require_backward_grad_sync = True
    with torch.no_grad():
        _forward(hook)
    assert gate.met == 1


@pytest.mark.parametrize("sync_at_attach", [True, False])
@pytest.mark.parametrize("attach_hook_runs", [True, False])
def test_gate_hook_made_inside_a_forward_leaves_the_first_synchronised_forward_ungated(sync_at_attach,
                                                                                      attach_hook_runs):
    gate, ddp = _Gate(), _fake_ddp(sync_at_attach)
    hook = GateHook(gate, ddp)
    hook.from_next()  # made in the attach call, whose own forward hook may or may not run
    if attach_hook_runs:
        hook.after_forward()
    ddp.require_backward_grad_sync = True
    if not sync_at_attach:
        _forward(hook)  # the first synchronised forward comes after the attach call
    assert gate.met == 0
    _forward(hook)
    assert gate.met == 1


# -- TracedBackward -------------------------------------------------------------------------------


class _Plan:
    def __init__(self):
        self.entered = 0

    @contextlib.contextmanager
    def backward(self):
        self.entered += 1
        yield


def test_traced_backward_runs_the_backward_in_the_plans_context():
    plan = _Plan()
    traced = TracedBackward(plan, _fake_ddp())
    assert traced.hook is None
    loss = torch.ones(2, requires_grad=True).sum()
    traced.before_forward()
    with traced.context():
        loss.backward()
    traced.before_forward()
    assert plan.entered == 1


def test_traced_backward_warns_once_when_a_forward_follows_a_plain_backward():
    traced = TracedBackward(_Plan(), _fake_ddp())
    traced.before_forward()
    with pytest.warns(UserWarning, match=r"a forward ran again without compiled.backward\(loss\).*Call "
                                         r"compiled.backward\(loss\).*or compile with strategy='split'"):
        traced.before_forward()
    traced.before_forward()  # once only: a second warning here would fail under -W error
