"""compile_for_ddp (Note [Compile before wrap]) on one gloo rank: the user's module compiled in
place, its refusals, a model called outside DDP, and CompiledDDP's attribute writes reaching DDP. Two ranks in nanoGPT's
own flow: tests/ddp_opt/test_real_clients.py."""

import copy
import inspect

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from compiler import SettingError
from ddp_opt import compile_ddp, compile_for_ddp, compiled_ddp_of
from ddp_opt.compile_first import _backend_of

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


def test_it_compiles_in_place_and_returns_the_users_module():
    # Frameworks read the module they hold: Lightning's checkpoint and Accelerate's save_state its keys, the HF
    # Trainer the signature of its forward (to keep the dataset's columns); torch.compile's wrapper changes all three.
    model = _model()
    keys, signature = list(model.state_dict()), inspect.signature(model.forward)
    compiled = compile_for_ddp(model, backend="aot_eager")
    assert compiled is model and type(compiled) is nn.Sequential and "forward" not in vars(model)
    assert inspect.signature(compiled.forward) == signature and list(compiled.state_dict()) == keys
    assert compiled_ddp_of(copy.deepcopy(model)) is None  # a copy is the uncompiled module, as after Module.compile


def test_outside_ddp_it_is_torch_compile():
    model = _model()
    x = torch.randn(4, 8)
    want = model(x)
    graphs = []
    compiled = compile_for_ddp(model, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)
    torch.testing.assert_close(compiled(x), want)
    assert len(graphs) == 1  # an nn.Sequential too: torch 2.13's Module.compile compiles nothing of one
    assert compiled_ddp_of(compiled) is None  # no DDP seen, nothing split


def test_every_model_compiles_however_many_share_the_process():
    # dynamo's recompile limit (8) counts per code object: one shared frame for every model would leave the 9th
    # model, of another shape, uncompiled.
    graphs = []
    for width in range(1, 11):
        model = compile_for_ddp(nn.Linear(4, width), backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)
        model(torch.randn(2, 4))
    assert len(graphs) == 10


def test_a_module_compiled_already_is_refused():
    for compiled in (torch.compile(_model(), backend="eager"), _model()):
        compiled.compile(backend="eager") if isinstance(compiled, nn.Sequential) else None
        with pytest.raises(TypeError, match=r"^compile_for_ddp\(model\): the \w+ given is already compiled "
                                            r"\(torch.compile\(model\) or model.compile\(\)\), .* Pass the uncompiled "
                                            r"model: compile_for_ddp\(model\) takes the place of torch.compile"):
            compile_for_ddp(compiled, backend="aot_eager")


def _train_like_eager(ddp, model, ref_ddp, ref, steps=3):
    """Three steps of ``ddp`` and the eager ``ref_ddp`` on the same batches; the gradients equal at each."""
    for step in range(steps):
        x = torch.randn(4, 8)
        ddp(x).sum().backward()
        ref_ddp(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step} {name}: {m}")


def test_under_ddp_on_one_rank_it_splits_at_ddps_caps_realigns_and_trains_like_eager(gloo, recwarn):
    model, ref = _model(), _model()
    ddp = DDP(compile_for_ddp(model, backend="aot_eager"), bucket_cap_mb=64 / 2**20)  # 64 B: one bucket a layer
    ref_ddp = DDP(ref, bucket_cap_mb=64 / 2**20)  # below PyTorch's 1 MiB first bucket: its splitter asserts there
    _train_like_eager(ddp, model, ref_ddp, ref)
    state = compiled_ddp_of(ddp.module)
    assert [b.params for b in state.buckets] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    assert state.aligned_caps is not None and state.realignment.fraction == 1.0
    assert not [w for w in recwarn if "compile_for_ddp" in str(w.message)]
    assert list(ddp.state_dict()) == list(ref_ddp.state_dict())  # DDP's keys, no _orig_mod


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


def test_a_graph_that_pytorchs_splitter_split_first_is_said_once(gloo):
    model = _model()
    backend = _backend_of(compile_for_ddp(model, backend="aot_eager"))
    vars(model).pop("_compiled_call_impl")  # Module.compile's attribute: the model's own call again, uncompiled
    model.forward = torch._dynamo.optimize(backend)(model.forward)  # the backend without compile_for_ddp's call
    ddp = DDP(model)
    with pytest.warns(UserWarning, match=r"compile_for_ddp: a graph captured under DDP reached this backend with "
                                         r"PyTorch's own DDP splitter switched on .* the plan is PyTorch's, not "
                                         r"ddp_opt's.* Call the model itself \(model\(x\), as DDP does\), or wrap "
                                         r"in DDP first and call compile_ddp\(ddp_model\)") as caught:
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


def test_lightnings_wrapped_torch_compile_copies_nothing_of_the_model():
    # Importing Lightning wraps torch.compile to deep-copy the keywords of each call on a module
    # (lightning/fabric/wrappers.py); compile_for_ddp compiles a function of its own, which Lightning passes on.
    pytest.importorskip("lightning", reason="Lightning is not installed (pip install distcompile[lightning])")
    import lightning.pytorch  # noqa: F401

    model = _model()
    compiled = compile_for_ddp(model, backend="aot_eager")
    assert not hasattr(compiled, "_compile_kwargs") and _backend_of(compiled).model is model
