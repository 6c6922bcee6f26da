"""fsdp_opt.apply in one process (a one-rank gloo group): what it builds, what it
refuses, and that nothing changes when it refuses."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FSDPModule

import fsdp_opt
from _fsdp_helpers import TitanArgs, Transformer, batch
from launch.models import GPT, GPTConfig

CFG = GPTConfig(n_layer=4, n_embd=32, n_head=2, vocab_size=128, block_size=16)


pytestmark = pytest.mark.usefixtures("clean_dynamo")


def _gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def _unchanged(model):
    return not any(isinstance(m, FSDPModule) for m in model.modules())


def test_no_process_group_is_a_clear_error():
    model = _gpt()
    with pytest.raises(RuntimeError, match=r"needs a process group.*init_process_group.*mesh="):
        fsdp_opt.apply(model)
    assert _unchanged(model)


def test_blocks_not_found_fails_before_anything_changes(gloo):
    model = _gpt()
    with pytest.raises(ValueError, match=r"\['layers'\] not found in GPT; candidate containers: 'blocks' "
                                         r"\(ModuleList, 4 x Block\).*blocks='blocks'"):
        fsdp_opt.apply(model, blocks="layers")
    with pytest.raises(ValueError, match=r"Unknown|unknown|not a registered|valid"):
        fsdp_opt.apply(model, compile="no_such_backend")
    assert _unchanged(model) and all(b._compiled_call_impl is None for b in model.blocks)


def test_compiled_autograd_is_refused_at_apply(gloo):
    model = _gpt()
    with torch._dynamo.config.patch(compiled_autograd=True):
        with pytest.raises(RuntimeError, match=r"fsdp_opt.apply: compiled autograd is enabled.*wrong losses.*"
                                               r"compiled_autograd = False"):
            fsdp_opt.apply(model)
    assert _unchanged(model)


def test_compiled_autograd_switched_on_later_is_refused_at_forward(gloo):
    model = _gpt()
    fsdp_opt.apply(model)
    x, y = batch(0, 0, CFG.vocab_size, CFG.block_size)
    with torch._dynamo.config.patch(compiled_autograd=True):
        with pytest.raises(RuntimeError, match=r"forward of the FSDP2 model GPT: compiled autograd is enabled"):
            model(x, y)


def test_grouped_units_prefetch_and_per_block_compile_are_wired(gloo):
    model = _gpt()
    ref = copy.deepcopy(model)
    block_mb = sum(p.numel() for p in model.blocks[0].parameters()) * 4 / 2**20
    plan = fsdp_opt.apply(model, compile="eager", shard_unit_mb=1.5 * block_mb, prefetch=2)
    assert [u.blocks for u in plan.units] == [("blocks.0", "blocks.1"), ("blocks.2", "blocks.3")]
    b = model.blocks
    assert isinstance(model, FSDPModule) and all(isinstance(m, FSDPModule) for m in b)
    # a grouped unit is one FSDP state, so one all-gather
    assert b[0]._get_fsdp_state() is b[1]._get_fsdp_state()
    assert b[2]._get_fsdp_state() is not b[0]._get_fsdp_state()
    assert b[0]._get_fsdp_state()._states_to_forward_prefetch == [b[2]._get_fsdp_state()]
    assert b[2]._get_fsdp_state()._states_to_backward_prefetch == [b[0]._get_fsdp_state()]
    assert model._get_fsdp_state()._states_to_forward_prefetch == [b[0]._get_fsdp_state(), b[2]._get_fsdp_state()]
    assert model._get_fsdp_state()._states_to_backward_prefetch == [b[2]._get_fsdp_state(), b[0]._get_fsdp_state()]
    assert all(m._compiled_call_impl is not None for m in b)
    assert model._compiled_call_impl is None
    x, y = batch(0, 0, CFG.vocab_size, CFG.block_size)
    loss, ref_loss = model(x, y)[1], ref(x, y)[1]
    loss.backward(), ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    grad = model.blocks[3].mlp.fc.weight.grad.full_tensor()
    torch.testing.assert_close(grad, ref.blocks[3].mlp.fc.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pinning works with an accelerator")
def test_pinned_cpu_offload_without_accelerator_is_refused(gloo):
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = _gpt()
    with pytest.raises(ValueError, match=r"pin_memory=True\) on a machine without an accelerator.*pin_memory=False"):
        fsdp_opt.apply(model, offload_policy=CPUOffloadPolicy())
    assert _unchanged(model)


def test_applying_twice_is_refused(gloo):
    model = _gpt()
    fsdp_opt.apply(model, prefetch=0)
    with pytest.raises(ValueError, match=r"GPT is already sharded by fully_shard \(at \['\(root\)', 'blocks.0'"):
        fsdp_opt.apply(model)


def test_checkpointing_keeps_parameter_names_in_state_dict(gloo):
    model = _gpt()
    names = list(model.state_dict())
    fsdp_opt.apply(model, checkpointing=True, prefetch=0)
    assert type(model.blocks[0]).__name__.endswith("CheckpointWrapper")
    assert list(model.state_dict()) == names


def test_whole_model_compile_without_fullgraph_warns(gloo, caplog):
    model = _gpt()
    ref = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="fsdp_opt.apply"):
        fsdp_opt.apply(model, compile=fsdp_opt.FSDPCompileConfig(backend="eager", whole_model=True, fullgraph=False))
    assert "top frame runs eagerly" in caplog.text
    assert model._compiled_call_impl is not None
    x, y = batch(0, 0, CFG.vocab_size, CFG.block_size)
    assert model(x, y)[1].item() == pytest.approx(ref(x, y)[1].item(), abs=1e-6)


@pytest.mark.parametrize("policy", ["bf16", "cpu_offload"])
def test_mixed_precision_and_offload_policies_pass_through(gloo, policy):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    model = _gpt()
    ref = copy.deepcopy(model)
    kwargs = (dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
              if policy == "bf16" else dict(offload_policy=CPUOffloadPolicy(pin_memory=False)))
    plan = fsdp_opt.apply(model, **kwargs)
    block_numel = sum(p.numel() for p in ref.blocks[0].parameters())
    assert plan.units[0].size == block_numel * (2 if policy == "bf16" else 4)
    x, y = batch(0, 0, CFG.vocab_size, CFG.block_size)
    loss, ref_loss = model(x, y)[1], ref(x, y)[1]
    loss.backward()
    # bf16 parameters give a bf16 loss (about 3 significant digits)
    assert loss.dtype == (torch.bfloat16 if policy == "bf16" else torch.float32)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=2e-2 if policy == "bf16" else 1e-6)
    assert model.blocks[0].mlp.fc.weight.grad.dtype == torch.float32


# --- one entry point: apply(model, config) or apply(model, **keywords) ------------


def test_config_and_keywords_together_are_refused():
    model = _gpt()
    config = fsdp_opt.FSDPConfig(compile="aot_eager")
    with pytest.raises(ValueError, match=r"fsdp_opt.apply\(model, config, blocks='blocks', prefetch=2\): an "
                                         r"FSDPConfig carries every setting.*silently.*dataclasses.replace\(config, "
                                         r"blocks='blocks', prefetch=2\).*or drop config"):
        fsdp_opt.apply(model, config, blocks="blocks", prefetch=2)
    with pytest.raises(TypeError, match=r"config must be an FSDPConfig or None.*fsdp_opt.apply\(model, "
                                        r"compile='aot_eager'\)"):
        fsdp_opt.apply(model, "aot_eager")
    # keywords left at their defaults are no conflict: this gets as far as the process group
    with pytest.raises(RuntimeError, match=r"needs a process group"):
        fsdp_opt.apply(model, config, blocks="auto", prefetch=1)
    assert _unchanged(model)


def test_the_keywords_are_the_config_fields_and_a_new_field_needs_no_other_edit(monkeypatch):
    import dataclasses
    import importlib
    import inspect

    params = inspect.signature(fsdp_opt.apply).parameters  # what help(fsdp_opt.apply) shows
    assert list(params) == ["model", "config", "mesh", *(f.name for f in dataclasses.fields(fsdp_opt.FSDPConfig))]
    assert all(params[f.name].default == f.default and params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
               for f in dataclasses.fields(fsdp_opt.FSDPConfig))

    @dataclasses.dataclass(frozen=True)
    class WithANewSetting(fsdp_opt.FSDPConfig):
        new_knob: int = 3

    monkeypatch.setattr(importlib.import_module("fsdp_opt.apply"), "FSDPConfig", WithANewSetting)
    model = _gpt()
    with pytest.raises(RuntimeError, match=r"needs a process group"):  # the keyword was taken: on to the mesh
        fsdp_opt.apply(model, new_knob=5)


def test_an_unknown_keyword_names_every_setting_and_changes_nothing():
    model = _gpt()
    with pytest.raises(TypeError, match=r"^fsdp_opt.apply\(\) got an unexpected keyword argument 'prefech': it is not a "
                                        r"setting of fsdp_opt.apply, whose keywords are the fields of fsdp_opt.FSDPConfig "
                                        r"\(strategy, blocks, compile, .*, replicate, memory_budget_mb\), so nothing would "
                                        r"read it\. Did you mean "
                                        r"prefetch=\?$"):
        fsdp_opt.apply(model, prefech=2)
    assert _unchanged(model)


def test_the_old_alias_is_gone():
    assert not hasattr(fsdp_opt, "apply_fsdp") and "apply_fsdp" not in fsdp_opt.__all__
    assert "CompileConfig" not in fsdp_opt.__all__ and "FSDPCompileConfig" in fsdp_opt.__all__


def test_torchtitan_shaped_model_is_sharded_compiled_and_trains_like_eager(gloo):
    args = TitanArgs(n_layers=2)
    torch.manual_seed(0)
    model = Transformer(args)
    ref = copy.deepcopy(model)
    plan = fsdp_opt.apply(model, blocks="auto", compile="aot_eager")
    assert plan.block_names == ["layers.0", "layers.1"]
    assert all(isinstance(b, FSDPModule) and b._compiled_call_impl is not None for b in model.layers.values())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    counters.clear()
    for step in range(2):
        x, y = batch(0, step, args.vocab_size, 8)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        loss.backward(), ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5), f"step {step}"
    # the two blocks share one graph, captured without a break
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_params[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"after 2 steps, {name}: {m}")
