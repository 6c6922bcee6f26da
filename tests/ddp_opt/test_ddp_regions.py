"""Splits inside autocast and grad-mode regions (Note [Bucket planning]): each
partition re-enters the region it cuts through, so a model whose forward sits in
``torch.autocast`` gets as many partitions as buckets, and every partition's
outputs keep the dtype and ``requires_grad`` that dynamo traced for them; the
graph-break reason of each split names DDPOptimizer and the entry point's way out."""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.debugging import ExplainWithBackend
from torch._dynamo.backends.distributed import DDPOptimizer as TorchDDPOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from compiler import split_graph
from ddp_opt import DDPOptimizer, compile_ddp

MiB = 2**20
LAYER_MB = 64 * 64 * 4 / MiB  # one 64x64 float32 weight per bucket
BF16 = dict(rtol=1e-2, atol=1e-2)  # 0.0 seen with aot_eager; the margin is bf16's 8-bit mantissa

pytestmark = pytest.mark.usefixtures("gloo_module", "clean_dynamo")


def _autocast(on):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


class Tower(nn.Module):
    def __init__(self, depth=4, autocast=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(depth))
        self.autocast = autocast

    def forward(self, x):
        with _autocast(self.autocast):
            for layer in self.layers:
                x = torch.tanh(layer(x))
        return x


class NoGradInside(nn.Module):
    """A grad-off block over layers 2-3 in the middle, optionally inside autocast;
    layers 2-3 are used again with grad so that every weight gets a gradient."""

    def __init__(self, how="no_grad", autocast=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(6))
        self.how, self.autocast = how, autocast

    def forward(self, x):
        with _autocast(self.autocast):
            h = self.layers[1](torch.tanh(self.layers[0](x)))
            with torch.no_grad() if self.how == "no_grad" else torch.set_grad_enabled(False):
                frozen = self.layers[3](torch.tanh(self.layers[2](h)))
            y = self.layers[5](torch.tanh(self.layers[4](h + frozen)))
            y = y + self.layers[3](self.layers[2](y))
        return y.float()


def _checking_backend(seen):
    """aot_eager, checking at run time that each partition's outputs have the dtype
    and requires_grad dynamo traced for them (its eager semantics)."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        fn = aot_eager(gm, example_inputs)
        (out,) = gm.graph.find_nodes(op="output")
        traced = [(n.meta["example_value"].dtype, n.meta["example_value"].requires_grad) for n in out.args[0]]

        def run(*args):
            got = fn(*args)
            seen.append((gm, traced, [(t.dtype, t.requires_grad) for t in got]))
            return got

        return run

    return backend


def _compile_and_check(model_fn, steps=2):
    torch.manual_seed(0)
    model = model_fn()
    ref = copy.deepcopy(model)
    seen = []
    compiled = compile_ddp(DDP(model, bucket_cap_mb=LAYER_MB), backend=_checking_backend(seen))
    for step in range(steps):
        x = torch.randn(8, 64)
        loss, ref_loss = compiled(x).float().pow(2).mean(), ref(x).float().pow(2).mean()
        torch.testing.assert_close(loss, ref_loss, **BF16, msg=lambda m: f"step {step}, loss: {m}")
        loss.backward(), ref_loss.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **BF16, msg=lambda m: f"step {step}, grad of {name}: {m}")
            p.grad, q.grad = None, None
    for gm, traced, got in seen:
        assert got == traced, f"{type(gm).__name__}: outputs {got}, dynamo traced {traced}\n{gm.code}"
    return compiled, seen


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _prelude(gm, n):
    """The first n calls of a partition, as (target, args)."""
    return [(c.target, c.args) for c in gm.graph.nodes if c.op == "call_function"][:n]


def _partitions(seen):
    return list({id(gm): gm for gm, _, _ in seen}.values())


def test_whole_forward_in_autocast_gets_as_many_partitions_as_buckets():
    plain, _ = _compile_and_check(Tower)
    torch._dynamo.reset()
    compiled, seen = _compile_and_check(lambda: Tower(autocast=True))
    assert len(compiled.buckets) == len(plain.buckets) == 4
    partitions = _partitions(seen)
    assert len(partitions) == 4
    for gm in partitions:  # each re-enters and leaves the region
        t = _targets(gm)
        assert t[0] is torch.amp._enter_autocast and torch.amp._exit_autocast in t, gm.code
    assert all(dtype == torch.bfloat16 for _, _, got in seen for dtype, _ in got)


@pytest.mark.parametrize("how", ["no_grad", "set_grad_enabled"])
def test_a_grad_off_block_cut_by_a_split_keeps_requires_grad(how):
    compiled, seen = _compile_and_check(lambda: NoGradInside(how))
    assert len(compiled.buckets) == 6
    grad_off = (torch._C._set_grad_enabled, (False,))
    reentered = [gm for gm in _partitions(seen) if _prelude(gm, 1) == [grad_off]]
    assert len(reentered) == 2, "the grad-off block should be cut twice (three partitions hold its layers)"
    assert any(not rg for _, _, got in seen for _, rg in got), "no output computed without grad"


def test_a_cut_inside_no_grad_nested_in_autocast():
    compiled, seen = _compile_and_check(lambda: NoGradInside("no_grad", autocast=True))
    assert len(compiled.buckets) == 6
    enter = (torch.amp._enter_autocast, ("cpu", torch.bfloat16, True, None))
    both = [gm for gm in _partitions(seen) if _prelude(gm, 2) == [enter, (torch._C._set_grad_enabled, (False,))]]
    assert len(both) == 2, "the no_grad block inside autocast should be cut twice"
    for gm in _partitions(seen):  # every piece leaves autocast and hands on grad mode as it found it
        grad_sets = [c.args[0] for c in gm.graph.nodes if c.target is torch._C._set_grad_enabled]
        assert torch.amp._exit_autocast in _targets(gm) and grad_sets[-1:] in ([], [True]), gm.code


class IndependentNoGradBranch(nn.Module):
    """An autocast branch and an independent no_grad branch: split_module's default
    (topological) order runs the no_grad piece first."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(6))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.layers[1](self.layers[0](x))
        with torch.no_grad():
            frozen = self.layers[3](self.layers[2](x))
        y = self.layers[5](self.layers[4](h.float() + frozen))
        return h, y + self.layers[3](self.layers[2](y))


def test_pytorch_splitter_loses_requires_grad_where_ours_keeps_it():
    torch.manual_seed(0)
    model = IndependentNoGradBranch()
    ref = copy.deepcopy(model)
    theirs = TorchDDPOptimizer(int(LAYER_MB * MiB), torch._dynamo.lookup_backend("aot_eager"),
                               first_bucket_cap=int(LAYER_MB * MiB))
    with torch._dynamo.config.patch(optimize_ddp=False):
        h, _ = torch.compile(copy.deepcopy(model), backend=theirs.compile_fn)(x := torch.randn(4, 64))
    assert len(theirs.buckets) > 1 and not h.requires_grad  # PyTorch 2.13: h lost its autograd history
    torch._dynamo.reset()
    seen = []
    compiled = compile_ddp(DDP(model, bucket_cap_mb=LAYER_MB), backend=_checking_backend(seen))
    got, want = compiled(x), ref(x)
    assert got[0].requires_grad and len(compiled.buckets) == 6
    sum(t.float().sum() for t in got).backward(), sum(t.float().sum() for t in want).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **BF16, msg=lambda m: f"grad of {name}: {m}")


def test_split_graph_refuses_decreasing_partitions_around_a_region():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch._C._set_grad_enabled, (False,))
    y = graph.call_function(torch.add, (x, 1))
    graph.call_function(torch._C._set_grad_enabled, (True,))
    graph.output(graph.call_function(torch.mul, (y, 2)))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    order = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op not in ("placeholder", "output"))}
    with pytest.raises(ValueError, match=r"node .add. is in partition 2, after ._set_grad_enabled. in partition 3"
                                         r".*never decrease.*consecutive runs"):
        split_graph(gm, lambda n: 3 - order[n] if order[n] < 2 else 3)


def test_inference_mode_region_is_never_cut():
    from ddp_opt import BucketCaps, plan_buckets

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (nn.Linear(64, 64, bias=False) for _ in range(3))

        def forward(self, x):
            return self.c(self.b(self.a(x)))

    gm = torch.fx.symbolic_trace(M())
    a, b, c = (n for n in gm.graph.nodes if n.op == "call_module")
    with gm.graph.inserting_before(a):
        enter = gm.graph.call_function(torch.autograd.grad_mode._enter_inference_mode, (True,))
    with gm.graph.inserting_after(b):
        gm.graph.call_function(torch.autograd.grad_mode._exit_inference_mode, (enter,))
    gm.recompile()
    buckets = plan_buckets(gm, BucketCaps(int(LAYER_MB * MiB), int(LAYER_MB * MiB)))
    assert [[n.name for n in reversed(bk.nodes)] for bk in buckets][-1][-1:] == ["c"]
    assert len(buckets) == 2 and a in buckets[0].nodes and b in buckets[0].nodes


# --- the graph-break reason ---------------------------------------------------------------


def _explained(make_backend):
    torch.manual_seed(0)
    ddp = DDP(Tower(), bucket_cap_mb=LAYER_MB)
    explain = ExplainWithBackend("aot_eager")
    backend, compiled = make_backend(ddp, explain)
    compiled(torch.randn(4, 64))
    return backend, [r.reason for r in explain.output().break_reasons]


def test_break_reason_names_ddpoptimizer_and_compile_ddps_way_out():
    def make(ddp, explain):
        c = compile_ddp(ddp, backend=explain)
        return c.splitter, c

    _, reasons = _explained(make)
    assert len(reasons) == 4
    assert all(r.startswith("DDPOptimizer intentional graph-break") for r in reasons)
    assert "compile_ddp(ddp, strategy='whole')" in reasons[0] and "Note [Bucket planning]" in reasons[0]


def test_break_reason_of_a_directly_used_ddpoptimizer_advises_the_plain_backend():
    def make(ddp, explain):
        opt = DDPOptimizer(int(LAYER_MB * MiB), explain)
        compiled = torch.compile(ddp, backend=opt.compile_fn)
        return opt, torch._dynamo.config.patch(optimize_ddp=False)(compiled)

    opt, reasons = _explained(make)
    assert len(reasons) == 4 and all("DDPOptimizer intentional graph-break" in r for r in reasons)
    assert "compile_ddp" not in reasons[0]
    assert "pass the backend itself to torch.compile instead of DDPOptimizer(...).compile_fn" in reasons[0]
    assert "optimize_ddp=False" in reasons[0]


def test_the_launcher_passes_its_own_spelling():
    from launch.runtime.parallel import OVERRIDE_SPELLING
    from ddp_opt.strategies.split import split_reason

    assert "ddp.strategy=whole" in split_reason(OVERRIDE_SPELLING)
