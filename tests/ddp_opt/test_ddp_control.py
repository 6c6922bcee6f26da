"""The line that says ddp_opt is in control (Note [In control, once] in ``ddp_opt/control.py``):
its words for each strategy, and when, where and how often a compiled DDP model says it, on a
one-rank gloo group in this process. The framework routes' own lines are pinned by their tests
(``test_framework_*.py``) and by the pages' programs (``test_docs_framework_pages.py``); the
launcher's by ``test_launch_output.py``."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_opt import compile_ddp, compile_for_ddp, compiled_ddp_of
from ddp_opt.control import PREFIX, buckets_clause, control_line
from tests._torch_range import needs_realignment

MiB = 1 << 20
LAYER = 64 * 64 * 4  # bytes of one Linear(64, 64, bias=False)


def test_the_line_names_the_entry_strategy_backend_buckets_alignment_and_changes():
    clause = buckets_clause("split", [LAYER] * 3, alignment=1.0)
    assert control_line("compile_trainer", strategy="split", backend="aot_eager", buckets=clause,
                        changes=["find_unused_parameters=False for DDP"]) == (
        "ddp_opt in control (compile_trainer): strategy=split, backend=aot_eager; 3 buckets = graph partitions "
        "(0.02, 0.02, 0.02 MiB); DDP's buckets realigned with them, alignment 1.00; changed: "
        "find_unused_parameters=False for DDP")
    assert control_line("compile_ddp", strategy="split", backend="inductor", buckets=clause).endswith(
        "alignment 1.00")  # nothing changed: no "changed:"


def test_each_strategy_says_what_its_gradients_go_through():
    assert buckets_clause("split", [MiB], kept="align_buckets=False") == (
        "1 bucket = graph partition (1.00 MiB); DDP's own buckets kept (align_buckets=False)")
    assert buckets_clause("split", [MiB, 2 * MiB], auto=True, alignment=0.5) == (
        "2 buckets = graph partitions (1.00, 2.00 MiB, planned by the cost model); DDP's buckets realigned with "
        "them, alignment 0.50")
    assert buckets_clause("regional", [MiB] * 8, alignment=1.0).startswith(
        "8 buckets of whole blocks (1.00, 1.00, 1.00, 1.00, 1.00, 1.00, ... 2 more MiB)")
    assert buckets_clause("whole", []) == "each graph compiled whole, DDP's own buckets (no split)"
    assert buckets_clause("traced", [], fused=[MiB, 3 * MiB]) == (
        "the gradients all-reduced inside the compiled backward graph, in 2 fused all-reduces (1.00, 3.00 MiB)")
    assert buckets_clause("traced", [], fused=[]).startswith(
        "the gradients all-reduced inside the compiled backward graph, one by one (no fusion recorded")


pytestmark = pytest.mark.usefixtures("gloo_module", "clean_dynamo")


def _ddp(**ddp_kwargs) -> DDP:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(3)))
    return DDP(model, bucket_cap_mb=LAYER / MiB, **ddp_kwargs)  # one bucket per layer


def _steps(model, steps: int, accumulate: int = 1) -> None:
    """``steps`` steps of ``accumulate`` micro-batches each, all but the last under DDP's no_sync."""
    ddp = model.ddp_model if hasattr(model, "ddp_model") else model
    for _ in range(steps):
        for micro in range(accumulate):
            ddp.require_backward_grad_sync = micro == accumulate - 1  # what no_sync() sets
            model(torch.randn(2, 64)).sum().backward()
        ddp.require_backward_grad_sync = True


@needs_realignment
def test_compile_ddp_logs_the_line_once_at_info_after_the_realigned_buckets_are_measured(caplog, capsys):
    compiled = compile_ddp(_ddp(), backend="aot_eager")
    with caplog.at_level(logging.INFO, logger="ddp_opt.control"):
        for step in range(1, 3):
            _steps(compiled, 1)
            assert compiled.control.line is None, f"said at step {step}, before DDP rebuilt its realigned buckets"
        _steps(compiled, 1)  # the third step's forward: DDP rebuilt the realigned buckets, measured
        line = compiled.control.line
        _steps(compiled, 3)
    assert line == ("ddp_opt in control (compile_ddp): strategy=split, backend=aot_eager; 3 buckets = graph "
                    "partitions (0.02, 0.02, 0.02 MiB); DDP's buckets realigned with them, alignment 1.00")
    assert [r.getMessage() for r in caplog.records if r.name == "ddp_opt.control"] == [line]  # once
    assert capsys.readouterr().out == ""  # compile_ddp in a loop of one's own: INFO, not stdout


@needs_realignment
def test_a_framework_route_prints_the_line_with_what_it_changed(caplog, capsys):
    compiled = compile_ddp(_ddp(), backend="aot_eager")
    compiled.control.in_framework("compile_trainer", ["find_unused_parameters=False for DDP"])
    with caplog.at_level(logging.INFO, logger="ddp_opt.control"):
        _steps(compiled, 3, accumulate=2)  # no_sync micro-batches are not steps
    out = capsys.readouterr().out.splitlines()
    assert out == [compiled.control.line] and out[0].startswith(f"{PREFIX} (compile_trainer): strategy=split")
    assert out[0].endswith("alignment 1.00; changed: find_unused_parameters=False for DDP")
    assert not [r for r in caplog.records if r.name == "ddp_opt.control"]  # printed, not logged too


def test_not_in_control_the_warning_is_the_one_line(caplog, capsys):
    ddp = _ddp(find_unused_parameters=True)  # such a DDP never rebuilds its buckets
    with pytest.warns(UserWarning, match=r"compile_ddp: this DDP module was built with find_unused_parameters=True"):
        compiled = compile_ddp(ddp, backend="aot_eager")
    compiled.control.in_framework("compile_prepared")
    with caplog.at_level(logging.INFO, logger="ddp_opt.control"), warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing more is warned
        _steps(compiled, 4)
    assert compiled.control.line is None and capsys.readouterr().out == ""
    assert not [r for r in caplog.records if r.name == "ddp_opt.control"]


def test_buckets_kept_by_choice_are_said_after_the_first_step(caplog):
    compiled = compile_ddp(_ddp(), backend="aot_eager", align_buckets=False)
    with caplog.at_level(logging.INFO, logger="ddp_opt.control"):
        _steps(compiled, 1)
        assert compiled.control.line is None
        _steps(compiled, 1)
    assert compiled.control.line.endswith("3 buckets = graph partitions (0.02, 0.02, 0.02 MiB); DDP's own buckets "
                                          "kept (align_buckets=False)")


def test_the_whole_strategy_says_it_keeps_ddps_buckets():
    compiled = compile_ddp(_ddp(), backend="aot_eager", strategy="whole")
    _steps(compiled, 2)
    assert compiled.control.line == ("ddp_opt in control (compile_ddp): strategy=whole, backend=aot_eager; each "
                                     "graph compiled whole, DDP's own buckets (no split)")


@needs_realignment
def test_compile_for_ddp_names_itself():
    torch.manual_seed(0)
    model = compile_for_ddp(nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(3))), backend="aot_eager")
    ddp = DDP(model, bucket_cap_mb=LAYER / MiB)
    _steps(ddp, 4)
    line = compiled_ddp_of(model).control.line
    assert line.startswith(f"{PREFIX} (compile_for_ddp): strategy=split, backend=aot_eager; 3 buckets") and \
        line.endswith("alignment 1.00"), line
