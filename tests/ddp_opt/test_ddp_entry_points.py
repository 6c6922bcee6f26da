"""compile_ddp and compile_for_ddp run one setup (Note [One setup for both entry points] in
``ddp_opt.setup``): the same bad DDP module gives the same error, or the same warning and the
same decision, through either entry point. One gloo rank; compile_for_ddp meets its DDP module
at the first forward, so its outcome is read there."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_opt.setup
from ddp_opt import compile_ddp, compile_for_ddp, compiled_ddp_of

pytestmark = pytest.mark.usefixtures("clean_dynamo")

ENTRIES = ("compile_ddp", "compile_for_ddp")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _root(e: BaseException) -> BaseException:
    """The error a user's setting raised, through dynamo's wrapping of a backend's error."""
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def _outcome(entry: str, make_ddp, **settings):
    """``(error, warnings, aligned)`` of compiling ``make_ddp``'s module through ``entry`` and
    running one step: the error's type and message, each warning of ours (category and message),
    whether DDP's buckets are to be realigned; the entry's name written as ENTRY. ``optimizer="sgd"``
    is an SGD over the model's parameters."""
    model = _model()
    if settings.get("optimizer") == "sgd":
        settings["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        error, aligned = None, None
        try:
            if entry == "compile_ddp":
                compiled = compile_ddp(make_ddp(model), backend="aot_eager", **settings)
                compiled(torch.randn(4, 8)).sum().backward()
            else:
                ddp = make_ddp(compile_for_ddp(model, backend="aot_eager", **settings))
                ddp(torch.randn(4, 8)).sum().backward()
                compiled = compiled_ddp_of(ddp.module)
            aligned = compiled.align_buckets
        except Exception as e:  # noqa: BLE001 - the outcome under test
            root = _root(e)
            error = (type(root).__name__, str(root).replace(entry, "ENTRY"))
    ours = [(w.category.__name__, str(w.message).replace(entry, "ENTRY")) for w in seen
            if "ENTRY" in str(w.message).replace(entry, "ENTRY") or "is off on torch" in str(w.message)]
    return error, ours, aligned


def _python_hook(model):
    ddp = DDP(model)
    ddp.register_comm_hook(None, _hook)
    return ddp


def _builtin_hook(model):
    ddp = DDP(model)
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    return ddp


CASES = {
    # (how the DDP module is made, the settings given to the entry point, what must come out)
    "own hook beside a registered one": (_python_hook, dict(reduce_dtype=torch.bfloat16), "error"),
    "optimizer in backward beside a registered hook": (_python_hook, dict(optimizer="sgd"), "error"),
    "optimizer in backward with find_unused_parameters": (
        lambda m: DDP(m, find_unused_parameters=True), dict(optimizer="sgd"), "error"),
    "find_unused_parameters: DDP never rebuilds": (lambda m: DDP(m, find_unused_parameters=True), {}, "warning"),
    "a built-in comm hook cannot follow realignment": (_builtin_hook, {}, "warning"),
    "a Python comm hook is kept": (_python_hook, {}, "aligned"),
}


@pytest.mark.parametrize("case", CASES)
def test_both_entry_points_give_the_same_outcome(gloo, case):
    make_ddp, settings, expect = CASES[case]
    outcomes = [_outcome(entry, make_ddp, **settings) for entry in ENTRIES]
    assert outcomes[0] == outcomes[1], f"{case}: compile_ddp gave {outcomes[0]}, compile_for_ddp gave {outcomes[1]}"
    error, warned, aligned = outcomes[0]
    if expect == "error":
        assert error is not None and error[0] == "ValueError" and "ENTRY" in error[1], error
    elif expect == "warning":
        assert error is None and len(warned) == 1 and aligned is False, (warned, aligned)
    else:
        assert error is None and warned == [] and aligned is True, (warned, aligned)


def test_a_torch_without_realignments_internals_is_said_once_by_either_entry_point(gloo, monkeypatch):
    monkeypatch.setattr(ddp_opt.setup, "REALIGN_SUPPORTED", False)
    monkeypatch.setattr("ddp_opt._torch_internals.missing_for_realignment",
                        lambda: ["DDP._bucket_config.per_bucket_bytes_caps"])
    outcomes = []
    for entry in ENTRIES:
        monkeypatch.setattr("compiler.torch_release._features_off", set())  # the warning is once per process
        outcomes.append(_outcome(entry, DDP))
    assert outcomes[0] == outcomes[1]
    error, warned, aligned = outcomes[0]
    assert error is None and aligned is False and len(warned) == 1
    assert warned[0][0] == "RuntimeWarning" and "DDP._bucket_config.per_bucket_bytes_caps" in warned[0][1]
