"""Graph splitting and lazy per-partition compile on hand-built graphs: no process group."""

import logging
from unittest import mock

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from compiler import PartitionRecord, _torch_internals, compile_partitions, ensure_tuple_output, split_graph
from compiler.graph.partition import LazyPartition
from compiler.graph.partition import run_on_fakes


class ThreeStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.c = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _by_module_prefix(node: fx.Node) -> int:
    # call_module targets a, b, c -> partitions 0, 1, 2; relus follow their producer.
    owner = node if node.op == "call_module" else node.args[0]
    return "abc".index(str(owner.target))


def test_split_graph_cuts_where_the_policy_says():
    gm = fx.symbolic_trace(ThreeStage())
    split = split_graph(gm, _by_module_prefix)
    assert split.partition_names == ["submod_0", "submod_1", "submod_2"]
    ops = [[n.target for n in p.graph.nodes if n.op == "call_module"] for p in split.partitions()]
    assert ops == [["a"], ["b"], ["c"]]
    x = torch.randn(3, 4)
    torch.testing.assert_close(split.gm(x), gm(x))


def test_ensure_tuple_output_wraps_once():
    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert ensure_tuple_output(gm) is True
    assert isinstance(gm(torch.randn(1, 2)), tuple)
    assert ensure_tuple_output(gm) is False


def _counting_backend(calls):
    def backend(gm, example_inputs):
        calls.append([tuple(t.shape) for t in example_inputs])
        return gm.forward

    return backend


def test_lazy_partition_compiles_on_first_call_only_and_unwraps_singletons():
    calls = []
    gm = fx.symbolic_trace(torch.nn.Linear(4, 2))
    lazy = LazyPartition(gm, _counting_backend(calls), PartitionRecord(0, "p0"))
    assert calls == [] and lazy.record.status == "pending"
    x = torch.randn(3, 4)
    out = lazy(x)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 2)  # singleton unwrapped again
    lazy(x)
    assert calls == [[(3, 4)]]
    assert lazy.record.status == "compiled"


def test_compile_partitions_compiles_each_with_fake_inputs_in_order():
    calls = []
    model = ThreeStage()
    split = split_graph(fx.symbolic_trace(model), _by_module_prefix)
    x = torch.randn(5, 4)
    records = compile_partitions(split, _counting_backend(calls), [x])
    assert [r.status for r in records] == ["compiled"] * 3
    # each partition was compiled once, with the shapes flowing out of the previous one
    assert len(calls) == 3 and calls[0][-1] == (5, 4)
    torch.testing.assert_close(split.gm(x), model(x))
    assert len(calls) == 3  # real calls reuse the compiled partitions


def test_a_partition_another_rank_compiles_is_logged_as_loaded_not_compiled(caplog):
    # compile.share hands back a Pending for a compile another rank claimed (Note [Shared compile])
    class Claimed:
        def __init__(self, gm):
            self.gm, self.failure_callbacks = gm, []

        def __call__(self, *args):
            return self.gm(*args)

    def backend(gm, example_inputs):
        owned = any(n.op == "call_module" and n.target == "b" for n in gm.graph.nodes)
        return Claimed(gm) if owned else gm.forward

    model = ThreeStage()
    split = split_graph(fx.symbolic_trace(model), _by_module_prefix)
    x = torch.randn(2, 4)
    with caplog.at_level(logging.INFO, logger="compiler.graph.partition"):
        records = compile_partitions(split, backend, [x])
    assert [r.shared for r in records] == [False, True, False]
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("partition 1/3 compiled in ") for line in lines), lines
    assert any(line.startswith("partition 2/3 is compiled by another rank: loaded from the shared compile (")
               for line in lines), lines
    assert not any(line.startswith("partition 2/3 compiled") for line in lines)
    torch.testing.assert_close(split.gm(x), model(x))


def _fails_on_partition(bad_target: str):
    def backend(gm, example_inputs):
        if any(n.op == "call_module" and n.target == bad_target for n in gm.graph.nodes):
            raise RuntimeError(f"backend cannot compile {bad_target}")
        return gm.forward

    return backend


def test_failing_partition_runs_eagerly_with_a_warning_naming_it(caplog):
    model = ThreeStage()
    split = split_graph(fx.symbolic_trace(model), _by_module_prefix)
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, logger="compiler.graph.partition"):
        records = compile_partitions(split, _fails_on_partition("b"), [x])
    assert [r.status for r in records] == ["compiled", "eager", "compiled"]
    assert "backend cannot compile b" in records[1].error
    assert "Compiling partition 1 (submod_1) failed; it will run eagerly" in caplog.text
    torch.testing.assert_close(split.gm(x), model(x))


def test_fallback_raise_reraises_the_backend_error():
    split = split_graph(fx.symbolic_trace(ThreeStage()), _by_module_prefix)
    with pytest.raises(RuntimeError, match="backend cannot compile b"):
        compile_partitions(split, _fails_on_partition("b"), [torch.randn(2, 4)], fallback="raise")


def test_unknown_fallback_is_refused():
    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="fallback must be one of"):
        LazyPartition(gm, _counting_backend([]), PartitionRecord(0, "p"), fallback="ignore")


def test_dynamo_restart_is_not_mistaken_for_a_compile_failure():
    # Dynamo raises RestartAnalysis to re-trace (e.g. TensorifyScalarRestartAnalysis
    # with dynamic shapes); swallowing it would leave a partition eager for nothing.
    def restarting_backend(gm, example_inputs):
        raise torch._dynamo.exc.TensorifyScalarRestartAnalysis()

    split = split_graph(fx.symbolic_trace(ThreeStage()), _by_module_prefix)
    with pytest.raises(torch._dynamo.exc.RestartAnalysis):
        compile_partitions(split, restarting_backend, [torch.randn(2, 4)])


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        return x * self.scale


def test_fake_run_of_a_graph_with_attributes_uses_a_fake_copy(monkeypatch):
    copies, real_copy = [], _torch_internals.fake_copy

    def copying(gm, fake_mode):
        copies.append(gm)
        return real_copy(gm, fake_mode)

    monkeypatch.setattr(_torch_internals, "fake_copy", copying)
    gm = fx.symbolic_trace(Scaled())
    fake_mode = FakeTensorMode()
    with fake_mode, mock.patch.object(fake_mode, "allow_non_fake_inputs", True):
        out = run_on_fakes(gm, (fake_mode.from_tensor(torch.randn(3, 4)),), fake_mode)
    assert copies == [gm]
    assert isinstance(out, FakeTensor) and out.shape == (3, 4)


def test_fake_run_of_an_attribute_free_graph_skips_the_deep_copy(monkeypatch):
    # Dynamo lifts parameters to inputs, so its partitions read no attributes: the
    # fake deep copy (tens of ms a partition on a warm restart) is skipped.
    def add(x, w):
        return x @ w

    gm = fx.symbolic_trace(add)
    monkeypatch.setattr(_torch_internals, "fake_copy", lambda *a: pytest.fail("deep-copied"))
    fake_mode = FakeTensorMode()
    with fake_mode:
        out = run_on_fakes(gm, (torch.empty(2, 3), torch.empty(3, 5)), fake_mode)
    assert isinstance(out, FakeTensor) and out.shape == (2, 5)

