"""fsdp_opt planning without a process group: shard-unit grouping on hand-built
module trees, finding blocks, the plan table, and config validation."""

import pytest
import torch
from torch import nn

from _fsdp_helpers import Lin, Other, named
from fsdp_opt import CompileConfig, FSDPConfig, find_blocks, format_units, plan_fsdp, plan_shard_units
from models import GPT, GPTConfig

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


def test_blocks_not_found_lists_the_candidate_module_lists():
    model = nn.Module()
    model.mixed = nn.ModuleList([Lin(8), Other()])
    model.empty = nn.ModuleList()
    with pytest.raises(ValueError, match=r"found no repeated blocks.*'mixed' \(2 x Lin/Other\).*'empty'.*blocks='layers'"):
        find_blocks(model)
    with pytest.raises(ValueError, match=r"no nn.ModuleList at all"):
        find_blocks(nn.Linear(2, 2))


def test_unknown_block_name_lists_candidates():
    with pytest.raises(ValueError, match=r"\['layers'\] not found in TwoStacks; candidate ModuleLists: 'enc' \(2 x Lin\)"):
        find_blocks(TwoStacks(), "layers")
    with pytest.raises(ValueError, match=r"names a Linear, not a non-empty nn.ModuleList"):
        find_blocks(TwoStacks(), "embed")
    with pytest.raises(ValueError, match=r"'enc' and 'enc.0' overlap"):
        find_blocks(TwoStacks(), ("enc", "enc.0"))


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
        (dict(shard_unit_mb=0), r"shard_unit_mb=0: .* positive number of MiB.*shard_unit_mb=None"),
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
    assert FSDPConfig(compile="aot_eager").compile == CompileConfig(backend="aot_eager")
    assert FSDPConfig(compile=None).compile is None
    assert FSDPConfig(blocks=["a", "b"]).blocks == ("a", "b")


def test_whole_model_fullgraph_is_refused_with_why_and_what_to_use():
    with pytest.raises(ValueError, match=r"whole_model=True, fullgraph=True.*dynamo.*Attempted to call function "
                                         r"marked as skipped.*per-block compile.*compile=None"):
        CompileConfig(backend="aot_eager", whole_model=True)
    CompileConfig(backend="aot_eager", whole_model=True, fullgraph=False)  # allowed, with a warning at apply


def test_compiled_autograd_request_is_refused():
    with pytest.raises(ValueError, match=r"compiled_autograd=True.*wrong losses.*drop the sharding.*Leave compiled_autograd=False"):
        CompileConfig(compiled_autograd=True)
