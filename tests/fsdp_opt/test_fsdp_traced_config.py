"""``strategy="traced"`` settings: what FSDPConfig and fsdp_opt.apply refuse, each in one
message that names the fix, before anything is sharded."""

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy

import fsdp_opt
from compiler import SettingError
from fsdp_opt import FSDPCompileConfig, FSDPConfig
from fsdp_opt.traced import traced_refusal
from launch.models import GPT, GPTConfig


def test_an_unknown_strategy_names_the_valid_ones():
    with pytest.raises(SettingError, match=r"strategy='tracde' is not one of \['per_block', 'traced'\]"):
        FSDPConfig(strategy="tracde")


def test_shard_unit_mb_takes_auto_a_size_or_none():
    assert FSDPConfig().shard_unit_mb == "auto"
    FSDPConfig(shard_unit_mb=4), FSDPConfig(shard_unit_mb=None)
    with pytest.raises(SettingError, match=r"'auto' \(the default: the toolkit plans them\)"):
        FSDPConfig(shard_unit_mb="big")


def test_a_memory_budget_belongs_to_traced():
    FSDPConfig(strategy="traced", memory_budget_mb=64)
    with pytest.raises(SettingError, match="the budget bounds traced FSDP's plan.*Set strategy='traced'"):
        FSDPConfig(memory_budget_mb=64)
    with pytest.raises(SettingError, match="must be a positive number"):
        FSDPConfig(strategy="traced", memory_budget_mb=0)


@pytest.mark.parametrize("settings, words", [
    (dict(compile=None), "compile=None turns compile off. Give compile='inductor' or compile='aot_eager'"),
    (dict(compile="eager"), "with compile backend 'eager'.*'aot_eager' or 'inductor' only"),
    (dict(compile=FSDPCompileConfig(backend="inductor", mode="reduce-overhead")), "CUDA graphs cannot hold"),
    (dict(compile="aot_eager", replicate=True), "replicate=True keeps them whole. Use strategy='per_block'"),
    (dict(compile="aot_eager", offload_policy=CPUOffloadPolicy(pin_memory=False)), "Drop offload_policy"),
    (dict(compile="aot_eager", reshard_after_forward=2), "FSDP2's hybrid mode.*Use True or False"),
])
def test_what_traced_refuses_says_why_and_the_fix(settings, words):
    why = traced_refusal(FSDPConfig(strategy="traced", **settings), None)
    assert why is not None
    assert "strategy='traced'" in why
    import re
    assert re.search(words, why), why


def test_apply_refuses_before_anything_is_sharded(gloo):
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=8))
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"^fsdp_opt.apply: strategy='traced' compiles the whole model"):
        fsdp_opt.apply(model, strategy="traced")
    assert all(type(p) is torch.nn.Parameter and torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_scalar_parameter_is_refused_with_the_fix(gloo):
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=8))
    model.register_parameter("temperature", torch.nn.Parameter(torch.tensor(1.0)))
    with pytest.raises(ValueError, match=r"\['temperature'\] have no dimension to shard.*shape \(1,\)"):
        fsdp_opt.apply(model, strategy="traced", compile="aot_eager", shard_unit_mb=None)
