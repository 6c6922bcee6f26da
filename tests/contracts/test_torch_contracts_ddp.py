"""The contract tests of ``ddp_opt`` and ``fsdp_opt`` (their ``_torch_internals`` modules): one small
test per private torch access, as ``tests/contracts/test_torch_contracts.py`` does for ``compiler``."""

import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import compiler._torch_internals as cti
import ddp_opt._torch_internals as dti
import ddp_opt.strategies.traced._torch_internals as tti
import fsdp_opt._torch_internals as fti
from tests._torch_range import needs_realignment


pytestmark = pytest.mark.usefixtures("clean_dynamo")


# --- ddp_opt ----------------------------------------------------------------------------


def test_ddp_bucket_settings(gloo_module):
    default = dti.bucket_settings(DDP(nn.Linear(4, 4)))
    assert (default.bucket_bytes_cap, default.first_bucket_cap) == (25 * 2**20, dti.default_first_bucket_bytes())
    assert dti.default_first_bucket_bytes() == 2**20
    four = dti.bucket_settings(DDP(nn.Linear(4, 4), bucket_cap_mb=4))
    assert (four.bucket_bytes_cap, four.first_bucket_cap) == (4 * 2**20, 4 * 2**20)
    listed = dti.bucket_settings(DDP(nn.Linear(4, 4), bucket_cap_mb_list=[1, 4]))
    assert listed.per_bucket_caps == (2**20, 4 * 2**20)


def test_ddp_reducer_helpers(gloo_module):
    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    assert dti.registered_hook_name(model) is None and dti.reducer_finalized(model)
    model(torch.randn(2, 4)).sum().backward()
    assert dti.runtime_buckets(model) and dti.reducer_finalized(model)
    assert dti.has_rebuilt_buckets(model) is False
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model.register_comm_hook(None, default_hooks.allreduce_hook)
    assert dti.registered_hook_name(model) == "allreduce_hook"
    assert dti.python_comm_hooks(model) == [(None, default_hooks.allreduce_hook)]


def test_realignment_runs_on_every_release_of_the_range():
    # Per-bucket rebuild caps: DDP._bucket_config from torch 2.12, DDP.bucket_bytes_cap_list on 2.11.
    assert dti.missing_for_realignment() == [] and dti.REALIGN_SUPPORTED, dti.missing_for_realignment()
    assert dti._rebuild_caps_kind() == ("bucket_config" if cti.torch_version() >= (2, 12) else "cap_list")


@needs_realignment
def test_ddp_reducer_rebuild(gloo_module):
    names = list(inspect.signature(DDP._ddp_init_helper).parameters)
    assert names[1:5] == ["parameters", "expect_sparse_gradient", "param_to_name_mapping", "static_graph"], names
    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    model(torch.randn(2, 4)).sum().backward()
    dti.rebuild_reducer(model, (64, 2**20))
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    assert len(dti.runtime_buckets(model)) == 2 and dti.has_rebuilt_buckets(model)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model.register_comm_hook(None, default_hooks.allreduce_hook)
    dti.rebuild_reducer(model, (2**20,))  # the new reducer has no hook, and DDP's list says so
    assert dti.registered_hook_name(model) is None and dti.python_comm_hooks(model) == []


@needs_realignment
def test_the_rebuilt_reducer_takes_the_users_settings(gloo_module):
    # DDP._ddp_init_helper builds the reducer from DDP's attributes, so those settings carry over by themselves
    # (Note [Bucket realignment]); tests/ddp_opt/test_ddp_realign_settings.py shows each in effect after training.
    source = inspect.getsource(DDP._ddp_init_helper)
    taken = [name for name in ("gradient_as_bucket_view", "batched_grad_copy", "lazy_bucket_allocation")
             if name in inspect.signature(DDP.__init__).parameters]
    assert "gradient_as_bucket_view" in taken and all(f"self.{name}" in source for name in taken), taken
    if not hasattr(DDP, "finalize_backward"):
        return  # manual finalization: torch >= 2.15
    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    model.require_manual_backward_finalization = True
    dti.rebuild_reducer(model, None)  # the reducer alone holds this setting: rebuild_reducer sets it again
    model(torch.randn(2, 4)).sum().backward()
    assert not dti.reducer_finalized(model)
    model.finalize_backward()
    assert dti.reducer_finalized(model)


def test_the_active_ddp_module_is_seen_from_a_compiled_frame(gloo_module):
    seen = []

    def backend(gm, example_inputs):
        seen.append(dti.active_ddp_module())
        return gm.forward

    inner = torch.compile(nn.Linear(4, 4), backend=backend)
    ddp = DDP(inner)
    with dti.no_builtin_ddp_splitter():
        ddp(torch.randn(2, 4))
    assert seen == [ddp] and dti.active_ddp_module() is None


def test_graph_slot_is_the_frame_of_each_graph():
    slots = []

    def backend(gm, example_inputs):
        slots.append(dti.graph_slot())
        return gm.forward

    def f(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    compiled = torch.compile(f, backend=backend)
    compiled(torch.randn(3))
    compiled(torch.randn(3, 2))  # a recompile of both frames for the new rank
    assert dti.graph_slot() is None and len(slots) == 4
    assert slots[0] != slots[1] and slots[2:] == slots[:2] and all(isinstance(s, int) for s in slots)


def test_compiled_module_markers_and_splitter_switch():
    plain, by_method, by_forward = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    by_method.compile(backend="eager")
    by_forward.forward = torch.compile(by_forward.forward, backend="eager")
    assert [dti.is_compiled(m) for m in (plain, by_method, by_forward)] == [False, True, True]
    in_place = nn.Linear(2, 2)
    cti.compile_call_in_place(in_place, lambda call_impl: call_impl)  # as compile_for_ddp compiles
    assert dti.is_compiled(in_place)
    with dti.no_builtin_ddp_splitter():
        assert torch._dynamo.config.optimize_ddp is False
        assert not dti.builtin_splitter_on()
    # convert_frame hands a graph captured under DDP to PyTorch's splitter in this mode; True is its default.
    assert torch._dynamo.utils.get_optimize_ddp_mode() == "ddp_optimizer" and dti.builtin_splitter_on()
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        assert not dti.builtin_splitter_on()


def test_store_and_trace_artifact(gloo_module):
    store = dti.default_store()
    store.set("contract", "ok")
    assert store.get("contract") == b"ok"
    dti.trace_artifact("contract", "string", lambda: "payload")


def test_what_dynamo_graphs_carry(gloo_module):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = self.lin(x)
            with torch.no_grad():
                z = y * 2
            return y + z

    m = M()
    seen = []

    def backend(gm, example_inputs):  # dynamo erases each GraphArg's real example after compile: look now
        seen.append((gm, [dti.placeholder_parameter(n) for n in gm.graph.find_nodes(op="placeholder")]))
        return gm.forward

    m.forward = torch.compile(m.forward, backend=backend)  # in place, as compile_ddp compiles
    m(torch.randn(2, 3))
    (gm, params), = seen
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {dti.AUTOCAST_ENTER, dti.AUTOCAST_EXIT, dti.SET_GRAD_ENABLED} <= targets
    assert {(name, id(p)) for name, p in filter(None, params)} == {("lin.weight", id(m.lin.weight)),
                                                                 ("lin.bias", id(m.lin.bias))}
    modes = {dti.AUTOCAST_ENTER, dti.AUTOCAST_EXIT, dti.SET_GRAD_ENABLED}
    assert all(isinstance(dti.node_example(n), torch.Tensor)
               for n in gm.graph.nodes if n.op == "call_function" and n.target not in modes)
    assert dti.is_view(torch.randn(4)[:2]) and not dti.is_view(torch.randn(4))
    plain = M()
    DDP._set_params_and_buffers_to_ignore_for_model(plain, ["lin.bias"])
    DDP(plain)
    m = plain
    assert dti.is_ddp_ignored(m.lin.bias) and not dti.is_ddp_ignored(m.lin.weight)


def test_size_hint_reads_a_symbolic_size():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(dti.node_example(n) for n in gm.graph.find_nodes(op="placeholder"))
        return gm.forward

    torch.compile(lambda x: x * 2, backend=backend, dynamic=True)(torch.randn(5, 3))
    sizes = [s for v in seen if isinstance(v, torch.Tensor) for s in v.shape]
    assert any(isinstance(s, torch.SymInt) for s in sizes), sizes
    assert [dti.size_hint(s) for s in sizes] == [5, 3] and dti.size_hint(7) == 7


def test_the_traced_strategys_pieces(gloo_module):
    assert tti.traced_strategy_missing() is None
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    ddp = DDP(model)
    inlined = "torch.nn.parallel.distributed" in torch._dynamo.trace_rules.LEGACY_MOD_INLINELIST
    tti.use_python_reducer(ddp)
    assert any(p.endswith("nn/parallel/distributed") for p in torch._dynamo.trace_rules.get_legacy_mod_inlinelist())
    if not inlined:  # the conversion is process-wide, as DDP's own under python_reducer: undone for later tests
        torch._dynamo.trace_rules.LEGACY_MOD_INLINELIST.discard("torch.nn.parallel.distributed")
        torch._dynamo.trace_rules.get_legacy_mod_inlinelist.cache_clear()
    assert ddp._use_python_reducer and len(ddp._accum_grad_hooks) == 3  # one per trainable parameter
    # Eagerly (no compiled autograd) the hooks still all-reduce: world size 1 leaves the gradient as is.
    x = torch.randn(3, 4)
    ddp(x).sum().backward()
    expected = torch.autograd.grad(model(x).sum(), model[0].weight)[0]
    torch.testing.assert_close(model[0].weight.grad, expected)
    # add_python_reducer_hook: the hooks then call ours per gradient with (grad, param), in place of theirs.
    called = []
    tti.add_python_reducer_hook(ddp, "state", lambda state, grad_and_param: called.append((state, *grad_and_param)))
    model.zero_grad()
    ddp(x).sum().backward()
    trainable = [q for q in model.parameters() if q.requires_grad]
    assert sorted(id(param) for _, _, param in called) == sorted(id(q) for q in trainable)
    assert all(state == "state" and grad is param.grad for state, grad, param in called)
    seen = []
    with tti.traced_backward(lambda gm: gm, ["schedule_comm_wait"]):
        seen.append((torch._dynamo.config.optimize_ddp, torch._inductor.config._fuse_ddp_communication,
                     torch._inductor.config._fuse_ddp_communication_passes))
    assert seen == [("python_reducer", True, ["schedule_comm_wait"])]
    assert torch._inductor.config._fuse_ddp_communication is False  # restored on exit

    class Pass(tti.custom_graph_pass_base()):
        def __call__(self, graph):
            return None

        def uuid(self):
            return "x"

    assert Pass().uuid() == "x"
    # fuse_ddp_allreduces: a graph without the python reducer's all-reduces asks for no bucket.
    asked = []
    tti.fuse_ddp_allreduces(torch.fx.symbolic_trace(nn.Linear(2, 2)).graph, lambda sizes: asked.append(sizes) or [])
    assert asked == [[]]


# --- fsdp_opt ---------------------------------------------------------------------------


def test_compiled_autograd_switch_and_checkpoint_wrapper():
    assert not fti.compiled_autograd_active()
    with torch._dynamo.config.patch(compiled_autograd=True):
        assert fti.compiled_autograd_active()
    block = nn.Linear(3, 3)
    keys = set(block.state_dict())
    wrapped = fti.checkpoint_wrapper(block)
    assert set(wrapped.state_dict()) == keys
    x = torch.randn(2, 3, requires_grad=True)
    wrapped(x).sum().backward()
    assert x.grad is not None and dist.is_available()
