"""Alignment of DDP's runtime buckets with the partitions (measured, not enforced)."""

import copy
import logging

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_opt import compile_ddp, measure_alignment
from ddp_opt.alignment.measure import alignment_fraction
from launch.models import GPT, GPTConfig
from tests._torch_range import needs_realignment


def test_alignment_fraction_counts_bytes_of_buckets_equal_to_a_partition():
    runtime = [[(1, 100), (2, 100)], [(3, 300)], [(4, 50), (5, 450)]]
    partitions = [{1, 2}, {3, 4}, {5}]
    a = alignment_fraction(runtime, partitions)
    assert a.aligned == [True, False, False]
    assert a.runtime_bytes == [200, 300, 500]
    assert a.fraction == pytest.approx(200 / 1000)
    assert alignment_fraction(runtime, [{1, 2}, {3}, {4, 5}]).fraction == 1.0


pytestmark = pytest.mark.usefixtures("gloo_module", "clean_dynamo")


def _train(compiled, make_input, steps=3):
    for _ in range(steps):  # DDP rebuilds its buckets at the start of step 2
        out = compiled(*make_input())
        (out[1] if isinstance(out, tuple) else out).sum().backward()


def test_one_parameter_per_partition_is_fully_aligned():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
    ddp = DDP(model, bucket_cap_mb=64 * 64 * 4 / 2**20)
    compiled = compile_ddp(ddp, backend="aot_eager")
    _train(compiled, lambda: (torch.randn(2, 64),))
    a = measure_alignment(ddp, compiled.buckets)
    assert a.fraction == 1.0 and a.aligned == [True] * 4


def _gpt_pair(static_graph=False, hook=None, **compile_kwargs):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    ref = DDP(copy.deepcopy(model), bucket_cap_mb=1, static_graph=static_graph)
    ddp = DDP(model, bucket_cap_mb=1, static_graph=static_graph)
    if hook is not None:  # registered on DDP before compiling
        ddp.register_comm_hook(None, hook)
    return model, ddp, ref, compile_ddp(ddp, backend="aot_eager", **compile_kwargs)


def _steps_with_eager_gradients(model, ddp, ref, compiled, steps):
    for step in range(steps):
        x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(step))
        compiled(x, x)[1].backward()
        ref(x, x)[1].backward()
        for (name, p), q in zip(model.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step} grad {name}: {m}")
        ddp.zero_grad(), ref.zero_grad()


def test_without_realignment_the_split_gpt_drifts_from_its_partitions():
    # The problem realignment solves: DDP rebuilds its buckets from the order in
    # which the compiled partitions hand out gradients, which is not the reverse
    # graph order the plan counted in, so some buckets straddle two partitions.
    model, ddp, _, compiled = _gpt_pair(align_buckets=False)
    x = torch.randint(0, 512, (2, 16))
    _train(compiled, lambda: (x, x))
    a = measure_alignment(ddp, compiled.buckets)
    assert len(a.runtime_bytes) == len(compiled.buckets) == 4
    assert sum(a.runtime_bytes) == sum(b.size for b in compiled.buckets)
    assert 0.0 < a.fraction < 1.0


@needs_realignment
def test_realigned_buckets_equal_the_partitions_and_gradients_match_eager():
    model, ddp, ref, compiled = _gpt_pair()
    _steps_with_eager_gradients(model, ddp, ref, compiled, 4)
    a = measure_alignment(ddp, compiled.buckets)
    assert a.fraction == 1.0 and a.aligned == [True] * 4
    assert compiled.aligned_caps == tuple(b.size for b in reversed(compiled.buckets))


@needs_realignment
def test_calling_the_ddp_model_itself_realigns_as_calling_the_compiled_handle():
    # Either handle works: compile_ddp's additions run from hooks on DDP's own forward.
    model, ddp, ref, compiled = _gpt_pair()
    _steps_with_eager_gradients(model, ddp, ref, ddp, 4)  # the loop never calls `compiled`
    a = measure_alignment(ddp, compiled.buckets)
    assert compiled.aligned_caps == tuple(b.size for b in reversed(compiled.buckets))
    assert a.fraction == 1.0 and a.aligned == [True] * 4
    assert compiled.realignment is not None and compiled.realignment.fraction == 1.0


@needs_realignment
def test_comm_hooks_survive_realignment_or_are_refused():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls = []

    def counting_hook(state, bucket):
        calls.append(len(bucket.parameters()))
        return default_hooks.allreduce_hook(state, bucket)

    x = torch.randint(0, 512, (2, 16))
    # registered on what compile_ddp returned, or on DDP itself before compiling (ddp_opt.setup): either way a
    # Python hook is registered again on the realigned reducer
    for before in (False, True):
        model, ddp, _, compiled = _gpt_pair(hook=counting_hook if before else None)
        if not before:
            compiled.register_comm_hook(None, counting_hook)
        _train(compiled, lambda: (x, x), steps=3)
        assert compiled.aligned_caps is not None
        calls.clear()
        _train(compiled, lambda: (x, x), steps=1)
        assert len(calls) == 4, before  # the hook still runs, once per (realigned) bucket
    # a built-in (C++) hook cannot be read back: DDP keeps its buckets, said once (tests/ddp_opt/test_ddp_entry_points.py)


@needs_realignment
def test_static_graph_ddp_is_realigned_one_step_later_with_gradients_equal_eager():
    # The new reducer is marked static too: its first iteration reduces everything at the end and
    # records the order, and the rebuild after it takes the partition caps.
    model, ddp, ref, compiled = _gpt_pair(static_graph=True)
    _steps_with_eager_gradients(model, ddp, ref, compiled, 5)
    assert ddp.static_graph and compiled.aligned_caps == tuple(b.size for b in reversed(compiled.buckets))
    a = measure_alignment(ddp, compiled.buckets)
    assert a.fraction == 1.0 and a.aligned == [True] * 4
    assert compiled.realignment is not None and compiled.realignment.fraction == 1.0


class _Broken(nn.Module):
    """Six layers in two graphs (a graph break in the middle); with ``y`` it also computes its
    own loss after another break, in a third graph without parameters."""

    def __init__(self, eager_middle=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
        self.middle = nn.Linear(64, 64) if eager_middle else None

    @torch._dynamo.disable
    def _eager(self, x):
        return self.middle(x)

    def forward(self, x, y=None):
        lay = self.layers
        x = torch.tanh(lay[2](torch.tanh(lay[1](torch.tanh(lay[0](x))))))
        torch._dynamo.graph_break()
        if self.middle is not None:
            x = self._eager(x)
        x = torch.tanh(lay[5](torch.tanh(lay[4](torch.tanh(lay[3](x))))))
        if y is None:
            return x
        print(end="")  # a graph break before the loss, as a library's warning_once makes
        return ((x - y) ** 2).mean()


def _broken_pair(static_graph=False, **kw):
    torch.manual_seed(0)
    model = _Broken(**kw)
    ref = DDP(copy.deepcopy(model), bucket_cap_mb=0.02, static_graph=static_graph)
    ddp = DDP(model, bucket_cap_mb=0.02, static_graph=static_graph)
    return model, ddp, ref, compile_ddp(ddp, backend="aot_eager")


@needs_realignment
@pytest.mark.parametrize("static_graph", [False, True])
def test_partitions_of_every_graph_are_planned_and_realigned_with_a_loss_computed_by_the_model(static_graph, caplog):
    model, ddp, ref, compiled = _broken_pair(static_graph)
    for step in range(5):
        x, y = torch.randn(4, 64), torch.randn(4, 64)
        loss, ref_loss = compiled(x, y), ref(x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        loss.backward(), ref_loss.backward()
        for (name, p), q in zip(model.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step} grad {name}: {m}")
        ddp.zero_grad(), ref.zero_grad()
    opt = compiled.splitter
    # three graphs: layers 0-2, layers 3-5, the loss; the last one has no parameters and no bucket
    assert [len(plan) for plan in opt.plans] == [2, 2, 1] and opt.plans[-1][0].size == 0
    assert compiled.buckets == opt.plans[0] + opt.plans[1]
    assert sorted(n for b in compiled.buckets for n in b.params) == sorted(n for n, _ in model.named_parameters())
    assert len(opt.records) == 5 and {r.status for r in opt.records} == {"compiled"}
    a = measure_alignment(ddp, compiled.buckets)
    assert a.fraction == 1.0 and len(a.runtime_bytes) == 4
    assert compiled.realignment.fraction == 1.0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "straddle" in r.getMessage()]


@needs_realignment
def test_a_parameter_used_outside_every_graph_is_named_when_alignment_is_not_reached(caplog):
    model, ddp, ref, compiled = _broken_pair(eager_middle=True)
    with caplog.at_level(logging.WARNING, logger="ddp_opt.alignment.realign"):
        for _ in range(4):
            x = torch.randn(4, 64)
            compiled(x).sum().backward()
            ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.module.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert compiled.realignment is not None and compiled.realignment.fraction < 1.0
    (warning,) = [r.getMessage() for r in caplog.records if "straddle" in r.getMessage()]
    assert "2 parameter(s) are in no compiled graph (middle.weight, middle.bias)" in warning
    assert "Remove the graph break" in warning and "align_buckets=False" in warning


class _Mixed(nn.Module):
    """fp32 weights with small fp64 scales: two kinds DDP buckets apart."""

    def __init__(self, scale_dtype=torch.float64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(4))
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(64, dtype=scale_dtype)) for _ in range(4))

    def forward(self, x):
        for layer, scale in zip(self.layers, self.scales):
            x = torch.tanh(layer(x)) * scale.float()
        return x


@needs_realignment
def test_parameters_of_two_dtypes_are_bucketed_per_dtype_as_ddp_does(caplog):
    from ddp_opt.alignment.measure import runtime_buckets

    cap = 64 * 64 * 4 / 2**20
    torch.manual_seed(0)
    model = _Mixed()
    eager = DDP(copy.deepcopy(model), bucket_cap_mb=cap)
    ref, ddp = DDP(copy.deepcopy(model), bucket_cap_mb=cap), DDP(model, bucket_cap_mb=cap)
    compiled = compile_ddp(ddp, backend="aot_eager")
    with caplog.at_level(logging.INFO, logger="ddp_opt.alignment.realign"):
        for _ in range(4):
            x = torch.randn(2, 64)
            eager(x).sum().backward()
            compiled(x).sum().backward(), ref(x).sum().backward()
            for p, q in zip(model.parameters(), ref.module.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
            ddp.zero_grad(), ref.zero_grad()
    # the plan cuts where DDP closes a float32 bucket; the float64 scales stay in one open bucket
    assert [b.params for b in compiled.buckets] == [[f"scales.{i}", f"layers.{i}.weight"] for i in range(4)]
    assert [set(b.param_kinds) for b in compiled.buckets] == [{"float32@cpu", "float64@cpu"}] * 4
    assert compiled.aligned_caps == (64 * 64 * 4,) * 4  # the float32 bytes of each partition
    # compiled and realigned, DDP's buckets are eager DDP's own: one per float32 weight, then the scales
    names = {id(p): n for n, p in model.named_parameters()}
    eager_names = {id(p): n for n, p in eager.module.named_parameters()}
    got = [[names[i] for i, _ in b] for b in runtime_buckets(ddp)]
    assert got == [[eager_names[i] for i, _ in b] for b in runtime_buckets(eager)]
    assert got == [[f"layers.{i}.weight"] for i in (3, 2, 1, 0)] + [[f"scales.{i}" for i in (3, 2, 1, 0)]]
    a = measure_alignment(ddp, compiled.buckets)
    assert a.aligned == [True] * 4 + [False] and a.fraction == pytest.approx(4 * 16384 / (4 * 16384 + 4 * 512))
    # the float64 bucket spanning every partition is DDP's doing, not a failed realignment: said, not warned
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "ddp_opt.alignment.realign"]
    assert not [m for level, m in messages if level >= logging.WARNING]
    assert any("DDP buckets the float64@cpu parameters apart" in m for _, m in messages)
