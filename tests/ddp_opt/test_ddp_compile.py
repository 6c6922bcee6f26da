"""compile_ddp through dynamo on one gloo rank: splitting, scoping of PyTorch's
splitter, autocast/no_grad/checkpoint regions across splits, dynamic shapes and
partition fallback. Two-rank parity lives in test_ddp_multirank.py."""

import copy
import logging

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from ddp_opt import BucketCaps, DDPOptimizer, caps_from_ddp, compile_ddp
from launch.models import GPT, GPTConfig

MiB = 2**20


pytestmark = pytest.mark.usefixtures("gloo_module", "clean_dynamo")


class Tower(nn.Module):
    """Four 64x64 layers (16 KiB of weights each): a 16 KiB cap splits between layers."""

    def __init__(self, depth=4, width=64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


LAYER_MB = 64 * 64 * 4 / MiB


def _pair(model_fn, **ddp_kwargs):
    torch.manual_seed(0)
    model = model_fn()
    ref = copy.deepcopy(model)
    return DDP(model, **ddp_kwargs), DDP(ref, **ddp_kwargs)


def _assert_same_grads(a: nn.Module, b: nn.Module, step: int = 0):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step}, grad of {name}: {m}")


def test_caps_from_ddp_follow_ddp_rules():
    model = nn.Linear(4, 4)
    assert caps_from_ddp(DDP(model, bucket_cap_mb=4)) == BucketCaps(4 * MiB, 4 * MiB)
    assert caps_from_ddp(DDP(model)) == BucketCaps(25 * MiB, MiB)
    assert caps_from_ddp(DDP(model, bucket_cap_mb_list=[1, 3])).per_bucket_caps == (MiB, 3 * MiB)


def test_compile_ddp_refuses_a_plain_module():
    with pytest.raises(TypeError, match=r"compile_ddp expects a DistributedDataParallel module, got Linear.*Wrap the model first"):
        compile_ddp(nn.Linear(2, 2))


def test_compile_ddp_splits_and_keeps_pytorchs_splitter_out_only_during_calls(monkeypatch):
    from torch._dynamo.backends import distributed as torch_distributed

    def builtin_must_not_run(*args, **kwargs):
        raise AssertionError("PyTorch's DDPOptimizer was invoked")

    monkeypatch.setattr(torch_distributed.DDPOptimizer, "compile_fn", builtin_must_not_run)
    flags = []

    def spy_backend(gm, example_inputs):
        flags.append(torch._dynamo.config.optimize_ddp)
        return gm.forward

    ddp, ref = _pair(Tower, bucket_cap_mb=LAYER_MB)
    compiled = compile_ddp(ddp, backend=spy_backend)
    x = torch.randn(8, 64)
    compiled(x).sum().backward()
    ref(x).sum().backward()
    _assert_same_grads(ddp, ref)
    assert len(compiled.buckets) == 4 and flags == [False] * 4
    assert torch._dynamo.config.optimize_ddp is True  # restored after the call
    assert [r.status for r in compiled.splitter.records] == ["compiled"] * 4
    with pytest.warns(FutureWarning, match=r"CompiledDDP.ddp_optimizer is now CompiledDDP.splitter"):
        assert compiled.ddp_optimizer is compiled.splitter  # the old name, which read like optimizer=


def test_compile_ddp_compiles_a_torch_nn_container_and_refuses_a_second_compile():
    # torch.compile(ddp) would compile nothing here: dynamo skips DDP's forward
    # and the nn.Sequential forward it calls.
    torch.manual_seed(0)
    seq = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
    ddp, ref = DDP(seq, bucket_cap_mb=LAYER_MB), DDP(copy.deepcopy(seq), bucket_cap_mb=LAYER_MB)
    compiled = compile_ddp(ddp, backend="aot_eager")
    x = torch.randn(3, 64)
    torch.testing.assert_close(compiled(x), ref(x))
    assert len(compiled.buckets) == 4
    assert list(compiled.state_dict()) == list(ref.state_dict())  # DDP's keys, no _orig_mod
    with pytest.raises(RuntimeError, match=r"module inside this DDP \(Sequential\) is already compiled"):
        compile_ddp(ddp)


def test_flag_is_restored_when_forward_raises():
    ddp, _ = _pair(Tower, bucket_cap_mb=LAYER_MB)
    compiled = compile_ddp(ddp, backend="eager")
    with pytest.raises(RuntimeError):
        compiled(torch.randn(2, 3))  # wrong width
    assert torch._dynamo.config.optimize_ddp is True


def test_split_false_compiles_one_graph():
    ddp, _ = _pair(Tower, bucket_cap_mb=LAYER_MB)
    graphs = []
    compiled = compile_ddp(ddp, backend=lambda gm, ex: graphs.append(gm) or gm.forward, strategy="whole")
    compiled(torch.randn(2, 64))
    assert len(graphs) == 1 and compiled.buckets == [] and compiled.splitter is None


class MixedRegions(nn.Module):
    """bf16 autocast and no_grad regions, each spanning a bucket boundary. The
    no_grad layers are used again with grad later, so every weight gets a gradient
    (as DDP requires without find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(6))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.layers[1](self.layers[0](x))
        with torch.no_grad():
            frozen = self.layers[3](self.layers[2](x))
        y = self.layers[5](self.layers[4](h.float() + frozen))
        y = y + self.layers[3](self.layers[2](y))
        return h, frozen, y


def test_autocast_and_no_grad_regions_across_splits_keep_dtype_and_requires_grad():
    ddp, ref = _pair(MixedRegions, bucket_cap_mb=LAYER_MB)
    compiled = compile_ddp(ddp, backend="aot_eager")
    x = torch.randn(4, 64)
    got, want = compiled(x), ref(x)
    assert len(compiled.buckets) == 6  # cut inside both regions too (tests/ddp_opt/test_ddp_regions.py)
    for g, w, name in zip(got, want, ("autocast", "no_grad", "out")):
        assert (g.dtype, g.requires_grad) == (w.dtype, w.requires_grad), name
        torch.testing.assert_close(g, w, msg=lambda m: f"{name}: {m}")
    assert got[0].dtype == torch.bfloat16 and not got[1].requires_grad
    sum(t.float().sum() for t in got if t.requires_grad).backward()
    sum(t.float().sum() for t in want if t.requires_grad).backward()
    _assert_same_grads(ddp, ref)


class Checkpointed(Tower):
    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), x, use_reentrant=False)
        return x


def test_activation_checkpointing_across_splits_matches_eager_gradients():
    ddp, ref = _pair(Checkpointed, bucket_cap_mb=LAYER_MB)
    compiled = compile_ddp(ddp, backend="aot_eager")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, ref))
    for step in range(3):
        x = torch.randn(8, 64)
        compiled(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        _assert_same_grads(ddp, ref, step)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert len(compiled.buckets) == 4
    hops = [n for b in compiled.buckets for n in b.nodes if "checkpoint" in str(n.target)]
    assert len(hops) == 4  # one checkpoint region per partition


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_dynamic_batch_sizes_compile_once(how):
    ddp, ref = _pair(Tower, bucket_cap_mb=LAYER_MB)
    compiled = compile_ddp(ddp, backend="aot_eager", dynamic=True if how == "dynamic=True" else None)
    for batch in (3, 5, 7, 9):
        x = torch.randn(batch, 64)
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
        compiled(x).sum().backward()
        ref(x).sum().backward()
        _assert_same_grads(ddp, ref, batch)
        ddp.zero_grad(), ref.zero_grad()
    assert compiled.splitter.compiles == 1
    assert len(compiled.buckets) == 4


def _backend_failing_on(layer_index: int):
    """aot_eager, except for the partition that holds layers[layer_index]."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        if any(f"layers_modules_{layer_index}_" in n.name for n in gm.graph.nodes):
            raise RuntimeError("simulated backend crash")
        return aot_eager(gm, example_inputs)

    return backend


def test_failing_partition_falls_back_to_eager_and_training_continues(caplog):
    ddp, ref = _pair(Tower, bucket_cap_mb=LAYER_MB)
    compiled = compile_ddp(ddp, backend=_backend_failing_on(2))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, ref))
    with caplog.at_level(logging.WARNING, logger="compiler.graph.partition"):
        for step in range(3):
            x = torch.randn(8, 64)
            loss, ref_loss = compiled(x).pow(2).mean(), ref(x).pow(2).mean()
            torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"step {step}: {m}")
            loss.backward(), ref_loss.backward()
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    statuses = [r.status for r in compiled.splitter.records]
    assert statuses == ["compiled", "compiled", "eager", "compiled"]
    assert "Compiling partition 2 (submod_2) failed; it will run eagerly" in caplog.text
    assert "simulated backend crash" in caplog.text


def test_fallback_raise_stops_on_the_backend_error():
    ddp, _ = _pair(Tower, bucket_cap_mb=LAYER_MB)
    compiled = compile_ddp(ddp, backend=_backend_failing_on(2), fallback="raise")
    with pytest.raises(Exception, match="simulated backend crash"):
        compiled(torch.randn(2, 64))


def test_ddp_optimizer_is_a_drop_in_dynamo_backend():
    ddp, ref = _pair(Tower, bucket_cap_mb=25)
    opt = DDPOptimizer(int(LAYER_MB * MiB), torch._dynamo.lookup_backend("aot_eager"))
    assert opt.first_bucket_cap == int(LAYER_MB * MiB)  # PyTorch's 1 MiB default, capped at the cap
    with torch._dynamo.config.patch(optimize_ddp=False):
        out = torch.compile(ddp, backend=opt.compile_fn)(x := torch.randn(4, 64))
    torch.testing.assert_close(out, ref(x))
    assert [len(b.params) for b in opt.buckets] == [1, 1, 1, 1]
    assert [b.param_ids for b in opt.buckets] == [[id(layer.weight)] for layer in ddp.module.layers]
    with pytest.raises(ValueError, match=r"fallback='skip' is not one of"):
        DDPOptimizer(MiB, opt.backend_compile_fn, fallback="skip")


def test_gpt_compiles_with_as_many_partitions_as_ddp_has_buckets():
    torch.manual_seed(0)
    ddp = DDP(GPT(GPTConfig(tie_weights=True)), bucket_cap_mb=1)
    compiled = compile_ddp(ddp, backend="aot_eager")
    x = torch.randint(0, 512, (2, 16))
    for _ in range(2):
        compiled(x, x)[1].backward()
    runtime = ddp.reducer._get_zeros_like_grad_buckets()
    assert len(compiled.buckets) == len(runtime) == 4


def test_a_graph_compiled_again_after_a_dynamo_reset_replaces_its_plan():
    # After a reset the frame can get a new id (graph_slot): the plan of the old frame must not be kept
    # beside the new one (the GPU check's benchmark counted 4 partitions of a 2-partition plan this way).
    torch.manual_seed(0)
    ddp, other = DDP(Tower(), bucket_cap_mb=2 * LAYER_MB), DDP(Tower(), bucket_cap_mb=1)  # PyTorch's: cap >= 1 MiB
    compiled = compile_ddp(ddp, backend="aot_eager")
    x = torch.randn(2, 64)
    compiled(x).sum().backward()
    before = [b.params for b in compiled.buckets]
    torch.compiler.reset()
    # The benchmarks' order: after the reset, another DDP model of the same class compiles first (here with
    # PyTorch's splitter), and ours then compiles in a frame of a new id.
    torch.compile(other, backend="aot_eager")(x).sum().backward()
    compiled(x).sum().backward()
    assert len(before) == 2 and [b.params for b in compiled.buckets] == before
    assert compiled.splitter.planned_graphs == 1 and len(compiled.splitter.records) == 2


def test_sub_mib_caps_work_where_pytorchs_splitter_crashes():
    # DDP(bucket_cap_mb < 1): PyTorch's splitter keeps its 1 MiB first-bucket cap,
    # which is then larger than the cap, and it refuses to compile at all.
    ddp, ref = _pair(Tower, bucket_cap_mb=0.5)
    with pytest.raises(Exception, match="First bucket should be smaller/equal to other buckets"):
        torch.compile(ddp, backend="eager")(torch.randn(2, 64))
    torch._dynamo.reset()
    x = torch.randn(2, 64)
    torch.testing.assert_close(compile_ddp(ddp, backend="eager")(x), ref(x))


def test_parameter_free_graph_compiles_as_one_partition():
    class NoParams(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    opt = DDPOptimizer(MiB, torch._dynamo.lookup_backend("aot_eager"))
    with torch._dynamo.config.patch(optimize_ddp=False):
        out = torch.compile(NoParams(), backend=opt.compile_fn)(x := torch.randn(5, requires_grad=True))
    torch.testing.assert_close(out, torch.relu(x) * 2)
    assert len(opt.buckets) == 1 and opt.buckets[0].size == 0
    assert [r.status for r in opt.records] == ["compiled"]


def test_a_graph_without_backward_is_compiled_whole_and_never_planned(monkeypatch):
    # nanoGPT's estimate_loss() under no_grad on rank 0 only: no buckets to plan, nothing to agree on.
    published = []
    monkeypatch.setattr("ddp_opt.strategies.split.publish_plan", lambda *a: published.append(a) or True)
    seq = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    opt = DDPOptimizer(64 * 64 * 4, torch._dynamo.lookup_backend("aot_eager"))
    compiled = torch.compile(seq, backend=opt.compile_fn)
    with torch._dynamo.config.patch(optimize_ddp=False), torch.no_grad():
        x = torch.randn(2, 64)
        torch.testing.assert_close(compiled(x), seq(x))
    assert (opt.buckets, opt.plans, opt.records, published) == ([], [], [], [])
    assert [r.name for r in opt.inference_records] == ["no_grad_graph"] and opt.compiles == 1
    with torch._dynamo.config.patch(optimize_ddp=False):
        compiled(x).sum().backward()  # training: a graph with backward, planned and split as usual
    assert len(opt.buckets) == 2 and len(opt.plans) == 1 and len(published) == 1


def test_plan_and_split_graph_appear_in_pytorchs_structured_trace():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    trace_log = logging.getLogger("torch.__trace")
    handler = Keep(level=logging.DEBUG)
    trace_log.addHandler(handler)
    try:
        ddp, _ = _pair(Tower, bucket_cap_mb=LAYER_MB)
        compile_ddp(ddp, backend="eager")(torch.randn(2, 64))
    finally:
        trace_log.removeHandler(handler)
    artifacts = {r.metadata["artifact"]["name"]: r.payload for r in records if "artifact" in getattr(r, "metadata", {})}
    plan = __import__("json").loads(artifacts["ddp_opt_bucket_plan"])
    assert [b["params"] for b in plan] == [[f"layers.{i}.weight"] for i in range(4)]
    assert "submod_3" in artifacts["ddp_opt_split_graph"]


def test_doctor_sees_one_graph_with_intended_splits_and_a_fallback():
    from compiler.graph.diagnose import Diagnoser

    diag = Diagnoser()
    ddp, _ = _pair(Tower, bucket_cap_mb=LAYER_MB)
    compiled = compile_ddp(ddp, backend=_backend_failing_on(1), wrap_backend=diag.wrap)
    with diag:
        compiled(torch.randn(4, 64)).sum().backward()
    report = diag.report(partitions=compiled.splitter.records)
    assert len(report.graphs) == 1 and report.breaks == []  # the 4 partitions are not graph breaks
    assert [p.status for p in report.partitions] == ["compiled", "eager", "compiled", "compiled"]
    assert any("partition 1 (submod_1) runs eagerly because its compile failed: RuntimeError: simulated backend crash" in a
               for a in report.advice)


@pytest.mark.slow
def test_torch_logs_turns_on_our_loggers():
    import os
    import subprocess
    import sys

    code = "import logging, torch, ddp_opt, compiler; print(logging.getLogger('ddp_opt').level, logging.getLogger('compiler').level)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TORCH_LOGS": "+ddp_opt,+compiler"})
    assert out.stdout.split() == ["10", "10"], out.stderr[-2000:]  # DEBUG
