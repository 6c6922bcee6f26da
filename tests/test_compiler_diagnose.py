"""The diagnoser on models with known problems: breaks at the right lines,
recompiles with mark_dynamic advice, intended splits apart from accidents."""

import inspect
import json

import pytest
import torch

from compiler import PartitionRecord, resolve_backend
from compiler.diagnose import Diagnoser


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
                         "exposed_comm_ms", "compute_ms"}
    assert data["alignment"] is None  # nothing measured without DDP


def test_advice_for_divisibility_guards_and_the_recompile_limit():
    from compiler.diagnose import Recompile, advise

    mod8 = Recompile("forward", "m.py", 3, "Eq(Mod(s0, 8), 0)")
    sizes = [Recompile("forward", "m.py", 3, f"tensor 'x' size mismatch at index 0. expected {n}, actual {n + 1}", "x", 0)
             for n in range(3)]
    advice = advise([], [], [mod8, *sizes], [], recompile_limit=8)
    assert any("tests divisibility by 8 (Eq(Mod(s0, 8), 0)); pad that size to a multiple of 8" in a for a in advice)
    assert any("forward has compiled 5 times of at most 8" in a for a in advice)
    assert not any("fullgraph" in a for a in advice)  # no graphs seen: no claim about breaks


def test_poor_alignment_suggests_the_partition_sizes_as_bucket_caps():
    from compiler.diagnose import advise

    advice = advise([], [], [], [], recompile_limit=8, alignment=0.39, partition_mib=[1.0078, 1.0085, 1.0093, 0.2822])
    (line,) = [a for a in advice if "match one partition" in a]
    assert line.startswith("only 39% of the gradient bytes are in DDP buckets that match one partition")
    assert "bucket_cap_mb_list=[1.01, 1.01, 1.01, 0.282]" in line
    assert not any("match one partition" in a for a in advise([], [], [], [], 8, alignment=1.0))


def test_exposed_communication_suggests_caps_to_compare():
    from compiler.diagnose import advise

    advice = advise([], [], [], [], recompile_limit=8, exposed_comm_ms=60.0, compute_ms=200.0, bucket_cap_mb=4.0)
    (line,) = [a for a in advice if "waits for gradient communication" in a]
    assert line.startswith("60 ms of each 260 ms step waits for gradient communication")
    assert "ddp.bucket_cap_mb=2" in line and "ddp.bucket_cap_mb=8" in line and "--modes eager,nosplit,ours --caps 2,4,8,auto" in line
    assert "ddp.bucket_cap_mb=auto" in line
    hidden = advise([], [], [], [], recompile_limit=8, exposed_comm_ms=5.0, compute_ms=200.0, bucket_cap_mb=4.0)
    assert not any("waits for gradient communication" in a for a in hidden)


def test_compile_time_that_dominates_points_at_regional_compile_and_the_cache():
    from compiler.diagnose import GraphInfo, advise

    slow = advise([GraphInfo(0, 10, 5, compile_s=60.0)], [], [], [], recompile_limit=8, step_s=0.2)
    (line,) = [a for a in slow if a.startswith("compile took")]
    assert line.startswith("compile took 60.0s, 300x a step")
    assert "compile.regional=true" in line and "compile.cache_dir=DIR" in line
    quick = advise([GraphInfo(0, 10, 5, compile_s=5.0)], [], [], [], recompile_limit=8, step_s=0.2)
    assert not any(a.startswith("compile took") for a in quick)


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
