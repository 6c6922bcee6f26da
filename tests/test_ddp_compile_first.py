"""compile_for_ddp (Note [Compile before wrap]) on one gloo rank: its refusals, a model
called outside DDP, and CompiledDDP's attribute writes reaching DDP. Two ranks in nanoGPT's
own flow: tests/test_real_clients.py."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from compiler import SettingError
from ddp_opt import compile_ddp, compile_for_ddp, compiled_ddp_of

pytestmark = pytest.mark.usefixtures("clean_dynamo")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("setting", [dict(bucket_cap_mb="auto"), dict(cache_dir="/tmp/x"),
                                     dict(strategy="regional"), dict(strategy="traced")])
def test_settings_that_need_the_ddp_module_up_front_are_refused_with_the_way_out(setting):
    name, value = next(iter(setting.items()))
    with pytest.raises(SettingError, match=rf"compile_for_ddp\({name}='{value}'\): this setting needs the DDP module "
                                           r"before the first forward .* compile_ddp\(DistributedDataParallel"):
        compile_for_ddp(_model(), backend="aot_eager", **setting)


def test_a_ddp_module_is_refused_with_the_entry_point_for_it(gloo):
    with pytest.raises(TypeError, match=r"got a DistributedDataParallel module.*call ddp_opt.compile_ddp"):
        compile_for_ddp(DDP(_model()))


def test_compile_ddp_of_a_model_compiled_first_names_compile_for_ddp(gloo):
    with pytest.raises(RuntimeError, match=r"already compiled \(torch.compile\(model\).*replace torch.compile\(model\) "
                                           r"with ddp_opt.compile_for_ddp\(model\)"):
        compile_ddp(DDP(torch.compile(_model(), backend="eager")))


def test_outside_ddp_it_is_torch_compile():
    model = _model()
    x = torch.randn(4, 8)
    want = model(x)
    compiled = compile_for_ddp(model, backend="aot_eager")
    torch.testing.assert_close(compiled(x), want)
    assert compiled_ddp_of(compiled) is None  # no DDP seen, nothing split


def _train_like_eager(ddp, model, ref_ddp, ref, steps=3):
    """Three steps of ``ddp`` and the eager ``ref_ddp`` on the same batches; the gradients equal at each."""
    for step in range(steps):
        x = torch.randn(4, 8)
        ddp(x).sum().backward()
        ref_ddp(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step} {name}: {m}")


def test_under_ddp_on_one_rank_it_splits_at_ddps_caps_and_trains_like_eager(gloo):
    model, ref = _model(), _model()
    ddp = DDP(compile_for_ddp(model, backend="aot_eager"), bucket_cap_mb=64 / 2**20)  # 64 B: one bucket a layer
    ref_ddp = DDP(ref, bucket_cap_mb=64 / 2**20)
    _train_like_eager(ddp, model, ref_ddp, ref)
    state = compiled_ddp_of(ddp.module)
    assert [b.params for b in state.buckets] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]


def test_writes_of_ddps_attributes_reach_ddp(gloo):
    ddp = DDP(_model())
    compiled = compile_ddp(ddp, backend="aot_eager")
    compiled.require_backward_grad_sync = False  # nanoGPT's accumulation idiom
    assert ddp.require_backward_grad_sync is False and "require_backward_grad_sync" not in vars(compiled)
    compiled.require_forward_param_sync = False
    assert ddp.require_forward_param_sync is False
    compiled.auto_save_cache = False  # CompiledDDP's own setting stays its own
    assert compiled.auto_save_cache is False and not hasattr(ddp, "auto_save_cache")
    compiled.my_note = "mine"  # a new name is the handle's, as on any object
    assert compiled.my_note == "mine" and not hasattr(ddp, "my_note")


def test_a_wrapper_that_keeps_only_dynamo_ctx_still_splits_at_ddp_opts_plan(gloo, recwarn):
    # Lightning's from_compiled keeps the compiled module's dynamo_ctx and re-wraps the LightningModule's
    # methods with it; the forward hooks that keep PyTorch's splitter out are not called on that route.
    model, ref = _model(), _model()
    compiled = compile_for_ddp(model, backend="aot_eager")
    model.forward = compiled.dynamo_ctx(model.forward)  # from_compiled's own line
    ddp = DDP(model, bucket_cap_mb=64 / 2**20)  # below PyTorch's 1 MiB first bucket: its splitter asserts there
    ref_ddp = DDP(ref, bucket_cap_mb=64 / 2**20)
    _train_like_eager(ddp, model, ref_ddp, ref)
    state = compiled_ddp_of(compiled)
    assert [b.params for b in state.buckets] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    assert state.aligned_caps is not None and state.realignment.fraction == 1.0
    assert not [w for w in recwarn if "compile_for_ddp" in str(w.message)]


def test_a_graph_that_pytorchs_splitter_split_first_is_said_once(gloo):
    model = _model()
    compiled = compile_for_ddp(model, backend="aot_eager")
    model.forward = torch._dynamo.optimize(compiled._ddp_opt_backend)(model.forward)  # no ddp_opt context around it
    ddp = DDP(model)
    with pytest.warns(UserWarning, match=r"compile_for_ddp: a graph captured under DDP reached this backend with "
                                         r"PyTorch's own DDP splitter switched on .* the plan is PyTorch's, not "
                                         r"ddp_opt's.* Call the module compile_for_ddp returned, or wrap in DDP first "
                                         r"and call compile_ddp\(ddp_model\)") as caught:
        for _ in range(2):
            ddp(torch.randn(4, 8)).sum().backward()
    assert sum("PyTorch's own DDP splitter" in str(w.message) for w in caught) == 1


_NO_REBUILD = (r"{entry}: this DDP module was built with find_unused_parameters=True and without static_graph, and "
               r"such a DDP never rebuilds its gradient buckets.*part of the overlap of communication with backward "
               r"is lost; training stays correct. If every parameter gets a gradient at every step, build DDP with "
               r"find_unused_parameters=False \(HF Trainer: TrainingArguments\(ddp_find_unused_parameters=False\)\).*"
               r"align_buckets=False silences this")


def test_find_unused_parameters_is_said_at_compile_time(gloo):
    with pytest.warns(UserWarning, match=_NO_REBUILD.format(entry="compile_ddp")):
        compiled = compile_ddp(DDP(_model(), find_unused_parameters=True), backend="aot_eager")
    assert compiled.align_buckets is False  # realignment could not take effect: not attempted


def test_find_unused_parameters_is_said_when_compile_for_ddp_meets_its_ddp(gloo):
    ddp = DDP(compile_for_ddp(_model(), backend="aot_eager"), find_unused_parameters=True)
    with pytest.warns(UserWarning, match=_NO_REBUILD.format(entry="compile_for_ddp")):
        ddp(torch.randn(4, 8)).sum().backward()


def test_find_unused_parameters_with_static_graph_rebuilds_and_is_not_warned_about(gloo, recwarn):
    compiled = compile_ddp(DDP(_model(), find_unused_parameters=True, static_graph=True), backend="aot_eager")
    assert compiled.align_buckets is True
    assert not [w for w in recwarn if "compile_ddp" in str(w.message)]


def test_lightnings_wrapped_torch_compile_keeps_no_copy_of_the_model():
    # Importing Lightning wraps torch.compile to deep-copy the keywords of each call on a module
    # (lightning/fabric/wrappers.py); a backend that holds the model would be copied whole.
    pytest.importorskip("lightning", reason="Lightning is not installed (pip install distcompile[lightning])")
    import lightning.pytorch  # noqa: F401

    compiled = compile_for_ddp(_model(), backend="aot_eager")
    kept = getattr(compiled, "_compile_kwargs", None)
    assert kept is not None, "Lightning no longer records torch.compile's keywords: drop this test"
    assert kept["backend"].__closure__[0].cell_contents is compiled._ddp_opt_backend  # the same object, no copy
