"""The diagnoser on models with known problems: breaks at the right lines,
recompiles with mark_dynamic advice, intended splits apart from accidents."""

import inspect
import json

import pytest
import torch

from compiler import PartitionRecord, resolve_backend
from compiler.graph.diagnose import Diagnoser


pytestmark = pytest.mark.usefixtures("clean_dynamo")


def _line_of(fn, needle: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if needle in text)


def with_print(x):
    y = x * 2
    print("a print breaks the graph")
    return y + 1


def with_branch(x):
    y = x.sin()
    if y.sum() > 0:  # data-dependent branch
        return y + 1
    return y - 1


def _run(fn, *inputs_list):
    diag = Diagnoser()
    compiled = torch.compile(fn, backend=diag.wrap(resolve_backend("eager")))
    with diag:
        for inputs in inputs_list:
            compiled(*inputs)
    return diag.report()


def test_print_is_reported_as_a_break_at_its_line(capsys):
    report = _run(with_print, (torch.randn(4),))
    (brk,) = report.breaks
    assert brk.file == __file__ and brk.line == _line_of(with_print, 'print("a print')
    assert "print" in brk.reason
    assert len(report.graphs) == 2
    assert any("remove the print" in a for a in report.advice)


def test_data_dependent_branch_is_reported_at_the_if():
    report = _run(with_branch, (torch.randn(4),))
    (brk,) = report.breaks
    assert brk.line == _line_of(with_branch, "if y.sum() > 0")
    assert "torch.where or torch.cond" in report.format()


class Seq(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)

    def forward(self, tokens):
        return self.emb(tokens).mean()


def test_changing_sequence_length_is_a_recompile_with_mark_dynamic_advice():
    torch.manual_seed(0)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        report = _run(Seq(), *[(torch.randint(0, 50, (2, t)),) for t in (8, 12, 16)])
    assert len(report.recompiles) == 2
    first = report.recompiles[0]
    assert (first.input, first.axis) == ("tokens", 1)
    assert "expected 8, actual 12" in first.guard
    assert any("mark_dynamic(<tokens>, 1)" in a for a in report.advice)
    assert report.breaks == []


def test_intended_splits_are_not_reported_as_breaks_and_fallbacks_are():
    report = _run(lambda x: (x @ x).relu(), (torch.randn(3, 3),))
    records = [PartitionRecord(0, "submod_0", "compiled", 0.1), PartitionRecord(1, "submod_1", "eager", 0.0, "RuntimeError: boom")]
    report = Diagnoser().report(partitions=records)
    text = report.format()
    assert "partitions (intended splits at DDP bucket boundaries)" in text
    assert "graph breaks (accidental)" not in text
    assert any("partition 1 (submod_1) runs eagerly because its compile failed: RuntimeError: boom" in a for a in report.advice)


def test_clean_model_gets_fullgraph_advice_and_json_round_trips():
    report = _run(lambda x: x.cos() * 2, (torch.randn(3),))
    assert report.breaks == [] and report.recompiles == [] and len(report.graphs) == 1
    assert any("fullgraph=True" in a for a in report.advice)
    data = json.loads(report.to_json())
    assert set(data) == {"graphs", "breaks", "recompiles", "partitions", "advice", "recompile_limit", "alignment",
                         "exposed_comm_ms", "compute_ms", "compute_range_ms", "timing_notes"}
    assert data["alignment"] is None  # nothing measured without DDP


def test_advice_for_divisibility_guards_and_the_recompile_limit():
    from compiler.graph.diagnose import Recompile, advise

    mod8 = Recompile("forward", "m.py", 3, "Eq(Mod(s0, 8), 0)")
    sizes = [Recompile("forward", "m.py", 3, f"tensor 'x' size mismatch at index 0. expected {n}, actual {n + 1}", "x", 0)
             for n in range(3)]
    advice = advise([], [], [mod8, *sizes], [], recompile_limit=8)
    assert any("tests divisibility by 8 (Eq(Mod(s0, 8), 0)); pad that size to a multiple of 8" in a for a in advice)
    assert any("forward has compiled 5 times of at most 8" in a for a in advice)
    assert not any("fullgraph" in a for a in advice)  # no graphs seen: no claim about breaks


def test_recompiles_are_still_counted_once_dynamo_evicts_old_metrics():
    # Dynamo keeps its compilation metrics in a bounded deque: a window measured by
    # position would miss every recompile once the deque is full (it did, in the
    # full test suite). Fill a small deque with older entries, then diagnose.
    from torch._dynamo import utils as dynamo_utils

    dynamo_utils.set_compilation_metrics_limit(4)
    try:
        for _ in range(4):
            dynamo_utils._compilation_metrics.append(object())
        torch.manual_seed(0)
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            report = _run(Seq(), *[(torch.randint(0, 50, (2, t)),) for t in (8, 12, 16)])
    finally:
        dynamo_utils.set_compilation_metrics_limit(dynamo_utils.DEFAULT_COMPILATION_METRICS_LIMIT)
    assert len(report.recompiles) == 2
