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


def test_under_ddp_on_one_rank_it_splits_at_ddps_caps_and_trains_like_eager(gloo):
    model, ref = _model(), _model()
    ddp = DDP(compile_for_ddp(model, backend="aot_eager"), bucket_cap_mb=64 / 2**20)  # 64 B: one bucket a layer
    ref_ddp = DDP(ref, bucket_cap_mb=64 / 2**20)
    for step in range(3):
        x = torch.randn(4, 8)
        ddp(x).sum().backward()
        ref_ddp(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step} {name}: {m}")
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
