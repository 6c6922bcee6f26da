"""fsdp_opt planning without a process group: shard-unit grouping on hand-built
module trees, finding blocks, the plan table, and config validation."""

import ast
import re

import pytest
import torch
from torch import nn

from _fsdp_helpers import Lin, Other, TitanArgs, Transformer, named
from fsdp_opt import (FSDPCompileConfig, FSDPConfig, block_containers, block_lists, find_blocks, format_units,
                      plan_fsdp, plan_shard_units)
from launch.models import GPT, GPTConfig

MiB = 1024 * 1024
QUARTER = MiB // 16  # numel of a 0.25 MiB float32 block


# --- grouping -------------------------------------------------------------------


def test_no_target_gives_one_unit_per_block():
    units = plan_shard_units(named([10, 20, 30]), None)
    assert [u.blocks for u in units] == [("layers.0",), ("layers.1",), ("layers.2",)]
    assert [u.size for u in units] == [40, 80, 120]
    assert all(u.target is None for u in units)


def test_unit_closes_when_it_reaches_the_target():
    # 0.25 MiB blocks, 0.5 MiB target: pairs, and the odd one out alone at the end
    units = plan_shard_units(named([QUARTER] * 5), 0.5)
    assert [u.blocks for u in units] == [("layers.0", "layers.1"), ("layers.2", "layers.3"), ("layers.4",)]
    assert [u.size for u in units] == [MiB // 2, MiB // 2, MiB // 4]
    assert [u.index for u in units] == [0, 1, 2]
    assert units[0].target == MiB // 2


def test_large_block_closes_the_unit_it_joins_or_stands_alone():
    units = plan_shard_units(named([QUARTER, 8 * QUARTER, QUARTER, QUARTER]), 0.5)
    assert [u.blocks for u in units] == [("layers.0", "layers.1"), ("layers.2", "layers.3")]
    units = plan_shard_units(named([8 * QUARTER, QUARTER, QUARTER, QUARTER]), 0.5)
    assert [u.blocks for u in units] == [("layers.0",), ("layers.1", "layers.2"), ("layers.3",)]


def test_huge_target_gives_one_unit():
    units = plan_shard_units(named([QUARTER] * 6), 10_000)
    assert len(units) == 1 and units[0].blocks == tuple(f"layers.{i}" for i in range(6))
    assert units[0].size == 6 * MiB // 4


def test_shared_parameter_is_counted_once_in_its_first_block():
    a, b = Lin(100), Lin(50)
    b.shared = a.w  # registered in both blocks
    units = plan_shard_units([("a", a), ("b", b)], None)
    assert [u.size for u in units] == [400, 200]


def test_mixed_precision_counts_all_gather_dtype():
    block = Lin(100)
    block.register_parameter("idx", nn.Parameter(torch.zeros(10, dtype=torch.int64), requires_grad=False))
    units = plan_shard_units([("b", block)], None, param_dtype=torch.bfloat16)
    assert units[0].size == 100 * 2 + 10 * 8  # floats cast to bf16, ints keep their dtype


def test_empty_blocks_give_no_units():
    assert plan_shard_units([], 1.0) == []


# --- finding blocks -------------------------------------------------------------


class TwoStacks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.enc = nn.ModuleList([Lin(8), Lin(8)])
        self.mixed = nn.ModuleList([Lin(8), Other()])
        self.dec = nn.ModuleList([Other(), Other(), Other()])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)


def test_auto_takes_uniform_module_lists_in_order():
    blocks = find_blocks(TwoStacks())
    assert [n for n, _ in blocks] == ["enc.0", "enc.1", "dec.0", "dec.1", "dec.2"]


def test_auto_skips_lists_nested_inside_blocks():
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList([Lin(2), Lin(2)])

    model = nn.Module()
    model.layers = nn.ModuleList([Inner(), Inner()])
    assert [n for n, _ in find_blocks(model)] == ["layers.0", "layers.1"]


def test_gpt_blocks_are_found():
    blocks = find_blocks(GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2)))
    assert [n for n, _ in blocks] == ["blocks.0", "blocks.1", "blocks.2"]


def test_named_module_list_and_explicit_names():
    model = TwoStacks()
    assert [n for n, _ in find_blocks(model, "mixed")] == ["mixed.0", "mixed.1"]
    # explicit names come back in model order
    assert [n for n, _ in find_blocks(model, ("dec.1", "enc.0"))] == ["enc.0", "dec.1"]


def test_blocks_not_found_lists_the_candidate_containers_and_names_that_work():
    model = nn.Module()
    model.mixed = nn.ModuleList([Lin(8), Other()])
    model.empty = nn.ModuleList()
    with pytest.raises(ValueError, match=r"found no repeated blocks.*'mixed' \(ModuleList, 2 x Lin/Other\).*"
                                         r"'empty' \(ModuleList, empty\).*blocks='mixed'.*blocks=\('mixed.0', "
                                         r"'mixed.1'\)") as info:
        find_blocks(model)
    _suggestions_work(model, str(info.value))
    with pytest.raises(ValueError, match=r"no nn.ModuleList, nn.ModuleDict or nn.Sequential.*Linear has no "
                                         r"submodules with parameters.*compile or shard the model whole"):
        find_blocks(nn.Linear(2, 2))


def test_unknown_block_name_lists_candidates():
    with pytest.raises(ValueError, match=r"\['layers'\] not found in TwoStacks; candidate containers: "
                                         r"'enc' \(ModuleList, 2 x Lin\).*blocks='enc'"):
        find_blocks(TwoStacks(), "layers")
    with pytest.raises(ValueError, match=r"names a Linear, not an nn.ModuleList, nn.ModuleDict or nn.Sequential"):
        find_blocks(TwoStacks(), "embed")
    with pytest.raises(ValueError, match=r"'enc' and 'enc.0' overlap"):
        find_blocks(TwoStacks(), ("enc", "enc.0"))


# --- blocks found the way models are written --------------------------


def _suggestions_work(model, message):
    """Every ``blocks=...`` the message's fix suggests finds blocks in ``model``."""
    fix = message.split("Name the blocks explicitly:")[1]
    suggested = [ast.literal_eval(s) for s in re.findall(r"blocks=('[^']+'|\([^)]*\))", fix)]
    assert suggested, message
    for blocks in suggested:
        assert find_blocks(model, blocks), blocks


def test_torchtitan_module_dict_layers_are_found_by_auto_and_by_name():
    model = Transformer(TitanArgs(n_layers=4))
    names = [f"layers.{i}" for i in range(4)]
    assert [n for n, _ in find_blocks(model)] == names
    assert [n for n, _ in find_blocks(model, "layers")] == names
    assert [b for _, b in find_blocks(model)] == list(model.layers.values())
    assert [n for n, _ in block_containers(model)] == ["layers"]
    with pytest.raises(ValueError, match=r"\['blocks'\] not found in Transformer; candidate containers: 'layers' "
                                         r"\(ModuleDict, 4 x TransformerBlock\).*blocks='auto' \(finds layers.0 .. "
                                         r"layers.3\), or blocks='layers'") as info:
        find_blocks(model, "blocks")
    _suggestions_work(model, str(info.value))


def test_a_tied_head_is_left_out_of_the_names_suggested():
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2))
    with pytest.raises(ValueError, match=r"blocks=\('wte', 'wpe', 'blocks', 'ln_f'\) \(any disjoint") as info:
        find_blocks(model, "ln_f")
    _suggestions_work(model, str(info.value))


def test_sequential_of_repeated_blocks_is_found_and_a_mixed_one_is_not():
    model = nn.Sequential(Block(), Block(), Block())
    assert [n for n, _ in find_blocks(model)] == ["0", "1", "2"]
    outer = nn.Module()
    outer.stem = nn.Sequential(nn.Linear(4, 4))  # one child: not a stack
    outer.stage = nn.Sequential(Block(), Block())
    assert [n for n, _ in find_blocks(outer)] == ["stage.0", "stage.1"]
    assert [n for n, _ in find_blocks(outer, "stem")] == ["stem.0"]  # by name, any non-empty container
    with pytest.raises(ValueError, match=r"found no repeated blocks in Sequential.*\(the model itself\) "
                                         r"\(Sequential, 3 x Linear/ReLU\).*blocks=\('0', '2'\)"):
        find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))


def test_repeated_children_are_found_when_there_is_no_container():
    class TwoBlocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.block_a = Block()
            self.act = nn.ReLU()  # repeated below, but no parameters
            self.block_b = Block()
            self.act2 = nn.ReLU()
            self.head = Head()  # its fc1/fc2 repeat deeper down: the outermost parent wins

    assert [n for n, _ in find_blocks(TwoBlocks())] == ["block_a", "block_b"]


def test_a_container_inside_a_chosen_block_is_not_taken():
    class WithHeads(Block):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList([Lin(4), Lin(4)])

    titan = Transformer(TitanArgs(n_layers=2))
    titan.layers["0"].feed_forward.experts = nn.ModuleList([Lin(4), Lin(4)])
    assert [n for n, _ in find_blocks(titan)] == ["layers.0", "layers.1"]
    plain = nn.Module()
    plain.block_a, plain.block_b = WithHeads(), WithHeads()
    assert [n for n, _ in find_blocks(plain)] == ["block_a", "block_b"]


def test_nothing_repeated_names_module_names_that_work():
    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.conv = nn.Conv1d(8, 8, 1)

    class Single(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.body = Body()
            self.norm = nn.LayerNorm(8)
            self.mix = nn.Sequential(nn.Linear(8, 8), nn.GELU())

    model = Single()
    with pytest.raises(ValueError, match=r"found no repeated blocks in Single.*'mix' \(Sequential, 2 x GELU/Linear\)"
                                         r".*blocks='mix'.*blocks=\('embed', 'body', 'norm', 'mix'\)") as info:
        find_blocks(model)
    _suggestions_work(model, str(info.value))
    with pytest.raises(ValueError, match=r"blocks='body' names a Body, not an nn.ModuleList, nn.ModuleDict or "
                                         r"nn.Sequential: .*blocks=\('body.fc', 'body.conv'\)") as info:
        find_blocks(model, "body")
    _suggestions_work(model, str(info.value))


def test_block_lists_keeps_to_module_lists_and_block_containers_lists_every_kind():
    model = TwoStacks()
    model.table = nn.ModuleDict({"a": Lin(2)})
    model.pipe = nn.Sequential(Lin(2), Other())
    assert [n for n, _ in block_lists(model)] == ["enc", "mixed", "dec"]
    assert [n for n, _ in block_containers(model)] == ["enc", "mixed", "dec", "table", "pipe"]


# --- the whole plan and its table -----------------------------------------------


def test_plan_of_gpt_and_its_table_lists_every_block():
    model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2))
    block_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    plan = plan_fsdp(model, FSDPConfig(shard_unit_mb=1.5 * block_bytes / MiB))
    assert [u.blocks for u in plan.units] == [("blocks.0", "blocks.1"), ("blocks.2", "blocks.3")]
    total = sum(p.numel() for p in model.parameters()) * 4  # tied head counted once
    assert plan.root_bytes == total - 4 * block_bytes
    table = format_units(plan.units, plan.root_bytes)
    assert table == plan.table()
    for i in range(4):
        assert f"blocks.{i}" in table
    assert "root" in table.splitlines()[-1]
    header = table.splitlines()[0].split()
    assert header[:3] == ["unit", "n", "bytes"]


# --- config validation ----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prefetch=-1), r"prefetch=-1: the prefetch depth .* non-negative int.*0 to leave"),
        (dict(prefetch=True), r"prefetch=True"),
        (dict(shard_unit_mb=0), r"shard_unit_mb=0: .* positive number of MiB.*'auto'.*or None to make each block its own unit"),
        (dict(shard_unit_mb="big"), r"shard_unit_mb='big'"),
        (dict(reshard_after_forward=1), r"reshard_after_forward=1: expected True, False, or an int"),
        (dict(blocks=()), r"non-empty sequence of module names"),
        (dict(compile=3), r"compile=3: expected None, a backend name"),
        (dict(mp_policy=torch.bfloat16), r"expected a torch.distributed.fsdp.MixedPrecisionPolicy"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FSDPConfig(**kwargs)


def test_compile_spec_is_normalized():
    assert FSDPConfig(compile="aot_eager").compile == FSDPCompileConfig(backend="aot_eager")
    assert FSDPConfig(compile=None).compile is None
    assert FSDPConfig(blocks=["a", "b"]).blocks == ("a", "b")


def test_whole_model_fullgraph_is_refused_with_why_and_what_to_use():
    with pytest.raises(ValueError, match=r"whole_model=True, fullgraph=True.*dynamo.*Attempted to call function "
                                         r"marked as skipped.*per-block compile.*compile=None"):
        FSDPCompileConfig(backend="aot_eager", whole_model=True, fullgraph=True)
    FSDPCompileConfig(backend="aot_eager", whole_model=True)  # fullgraph=False, the default: allowed, warned at apply


def test_compiled_autograd_request_is_refused():
    with pytest.raises(ValueError, match=r"compiled_autograd=True.*wrong losses.*drop the sharding.*Leave compiled_autograd=False"):
        FSDPCompileConfig(compiled_autograd=True)


def test_each_bad_fsdp_setting_is_a_setting_error_naming_its_field():
    # One error type per rule, as DDPCompileConfig's: a SettingError (a ValueError) whose .setting names it.
    from compiler import SettingError
    from fsdp_opt import FSDPCompileConfig, FSDPConfig

    cases = [(lambda: FSDPCompileConfig(share_timeout_s=0), "share_timeout_s"),
             (lambda: FSDPCompileConfig(compiled_autograd=True), "compiled_autograd"),
             (lambda: FSDPCompileConfig(whole_model=True, fullgraph=True), "whole_model"),
             (lambda: FSDPConfig(prefetch=-1), "prefetch"),
             (lambda: FSDPConfig(shard_unit_mb=0), "shard_unit_mb"),
             (lambda: FSDPConfig(reshard_after_forward=1), "reshard_after_forward")]
    for build, field in cases:
        with pytest.raises(SettingError) as e:
            build()
        assert e.value.setting == field
