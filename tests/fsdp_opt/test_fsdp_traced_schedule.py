"""Note [Traced FSDP schedule] on hand-built graphs: where each all-gather and
reduce-scatter is issued and awaited, and which nodes the re-gather tags reach. No
process group: the collectives are graph nodes only, never run."""

import operator

import pytest
import torch
from torch import fx

from fsdp_opt.traced.schedule import apply_schedule, plan_schedule, tag_regathers

C = torch.ops._c10d_functional
A = torch.ops.aten


def _node(g: fx.Graph, target, args, shape, name):
    n = g.call_function(target, args, name=name)
    n.meta["val"] = torch.empty(shape, device="meta")
    return n


def _forward_graph(activation: int = 64) -> fx.GraphModule:
    """Two units, gathered one after the other at the start (as dynamo traces them), then used;
    each unit's compute saves an activation of ``activation`` x 4 elements for backward (the graph's
    outputs), so that memory grows along forward as it does in a model's."""
    g = fx.Graph()
    x = g.placeholder("x")
    shards = [g.placeholder(f"shard{i}") for i in range(2)]
    full = []
    for i, s in enumerate(shards):
        cat = _node(g, A.cat.default, ([s],), (8,), f"cat{i}")
        ag = _node(g, C.all_gather_into_tensor.default, (cat, 2, "0"), (16,), f"ag{i}")
        ag.meta["custom"] = {"fsdp_unit": i}
        w = _node(g, C.wait_tensor.default, (ag,), (16,), f"wait{i}")
        full.append(_node(g, A.view.default, (w, [4, 4]), (4, 4), f"view{i}"))
    h, saved = x, []
    for i, f in enumerate(full):
        h = _node(g, A.mm.default, (h, f), (4, 4), f"mm{i}")
        saved.append(_node(g, A.repeat.default, (h, [activation // 4, 1]), (activation, 4), f"act{i}"))
    g.output((h, *saved))
    return fx.GraphModule(torch.nn.Module(), g)


def _names(gm):
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def test_each_all_gather_is_issued_one_unit_ahead_and_awaited_at_its_first_use():
    gm = _forward_graph()
    schedule = plan_schedule(gm, prefetch=1)
    apply_schedule(gm, schedule)
    # unit 1's gather leaves before unit 0 is awaited, so it crosses the link while unit 0 computes
    assert _names(gm) == ["cat0", "ag0", "cat1", "ag1", "wait0", "view0", "mm0", "act0", "wait1", "view1", "mm1",
                          "act1"]
    first, second = schedule.placements
    assert (first.kind, first.unit, first.numel, first.issued_before) == ("all-gather", 0, 16, "start")
    assert first.awaited_before == "mm0"
    assert (second.unit, second.issued_before, second.awaited_before) == (1, "mm0", "mm1")


def test_without_prefetch_each_gather_waits_for_its_own_unit():
    gm = _forward_graph()
    apply_schedule(gm, plan_schedule(gm, prefetch=0))
    assert _names(gm) == ["cat0", "ag0", "wait0", "view0", "mm0", "act0", "cat1", "ag1", "wait1", "view1", "mm1",
                          "act1"]


def test_a_gather_is_not_issued_early_where_it_would_raise_the_graphs_peak():
    # with no activation saved, the most memory is held at the end, while unit 1 is gathered and used:
    # gathering it earlier, while unit 0's gathered parameters are alive, would hold both at once
    gm = _forward_graph(activation=0)
    schedule = plan_schedule(gm, prefetch=1)
    apply_schedule(gm, schedule)
    assert _names(gm).index("ag1") > _names(gm).index("mm0")
    assert schedule.placements[1].issued_before == "mm1"


def _backward_graph() -> fx.GraphModule:
    """A gradient ready early whose reduce-scatter AOTAutograd placed after all of backward's compute."""
    g = fx.Graph()
    grad_out, w = g.placeholder("grad_out"), g.placeholder("w")
    grad_w = _node(g, A.mm.default, (grad_out, w), (4, 4), "grad_w")
    rest = _node(g, A.mm.default, (grad_out, grad_w), (4, 4), "rest_of_backward")
    more = _node(g, A.mm.default, (rest, rest), (4, 4), "more_backward")
    flat = _node(g, A.view.default, (grad_w, [16]), (16,), "flat")
    div = _node(g, A.div.Tensor, (flat, 2), (16,), "div")
    rs = _node(g, C.reduce_scatter_tensor.default, (div, "sum", 2, "0"), (8,), "rs")
    rs.meta["custom"] = {"fsdp_unit": 3}
    wait = _node(g, C.wait_tensor.default, (rs,), (8,), "wait")
    shard = _node(g, A.view.default, (wait, [2, 4]), (2, 4), "shard_grad")
    g.output((shard, more))
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_reduce_scatter_is_issued_as_soon_as_its_gradients_exist_and_awaited_at_the_end():
    gm = _backward_graph()
    schedule = plan_schedule(gm)
    apply_schedule(gm, schedule)
    assert _names(gm) == ["grad_w", "flat", "div", "rs", "rest_of_backward", "more_backward", "wait", "shard_grad"]
    (rs,) = schedule.placements
    assert (rs.kind, rs.unit, rs.numel, rs.issued_before, rs.awaited_before) == (
        "reduce-scatter", 3, 8, "rest_of_backward", "output")


def test_the_reordered_graph_computes_what_the_original_did():
    # the same nodes and edges, only reordered: a graph without collectives runs to the same values
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    x = g.call_function(torch.mm, (a, b))
    y = g.call_function(torch.add, (x, a))
    z = g.call_function(operator.mul, (y, 2))
    g.output((z,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    ins = (torch.randn(3, 3), torch.randn(3, 3))
    want = gm(*ins)
    apply_schedule(gm, plan_schedule(gm))
    assert torch.equal(gm(*ins)[0], want[0])


def test_regather_tags_reach_the_gather_and_its_views_but_not_a_checkpointed_regions_nodes():
    gm = _forward_graph()
    region_view = next(n for n in gm.graph.nodes if n.name == "view1")
    region_view.meta["recompute"] = "a checkpointed region's own tag"
    assert tag_regathers(gm, resharded=[True, True]) == 2
    tags = {n.name: n.meta.get("recompute") for n in gm.graph.nodes}
    for name in ("cat0", "ag0", "wait0", "view0", "ag1", "wait1"):
        assert tags[name] == torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE, name
    assert tags["view1"] == "a checkpointed region's own tag"
    assert tags["mm0"] is None and tags["mm1"] is None  # the compute that uses them is not recomputed


def test_a_unit_kept_gathered_is_not_tagged():
    gm = _forward_graph()
    assert tag_regathers(gm, resharded=[False, True]) == 1
    tags = {n.name: n.meta.get("recompute") for n in gm.graph.nodes}
    assert tags["ag0"] is None and tags["ag1"] is not None


def _two_reductions() -> fx.GraphModule:
    """Two units' gradients ready one after the other, each reduced by an all-to-all and a sum."""
    g = fx.Graph()
    grad_out, w = g.placeholder("grad_out"), g.placeholder("w")
    h, outs = grad_out, []
    for i in range(2):
        grad = _node(g, A.mm.default, (h, w), (4, 4), f"grad{i}")
        h = _node(g, A.mm.default, (grad, w), (4, 4), f"next{i}")
        flat = _node(g, A.view.default, (grad, [16]), (16,), f"flat{i}")
        a2a = _node(g, C.all_to_all_single.default, (flat, [8, 8], [8, 8], "0"), (16,), f"a2a{i}")
        wait = _node(g, C.wait_tensor.default, (a2a,), (16,), f"wait{i}")
        rows = _node(g, A.view.default, (wait, [2, 8]), (2, 8), f"rows{i}")
        outs.append(_node(g, A.sum.dim_IntList, (rows, [0]), (8,), f"sum{i}"))
    g.output((*outs, h))
    gm = fx.GraphModule(torch.nn.Module(), g)
    # as AOTAutograd leaves it: the reductions after all of backward's compute
    for name in ("flat0", "a2a0", "wait0", "rows0", "sum0", "flat1", "a2a1", "wait1", "rows1", "sum1"):
        gm.graph.output_node().prepend(next(n for n in gm.graph.nodes if n.name == name))
    gm.recompile()
    return gm


def test_a_reduction_is_awaited_before_the_next_one_is_issued_so_one_is_in_flight_at_a_time():
    gm = _two_reductions()
    schedule = plan_schedule(gm, reduce_inflight=1)
    apply_schedule(gm, schedule)
    # unit 0's reduction crosses the link while unit 1's gradients compute
    assert _names(gm) == ["grad0", "flat0", "a2a0", "next0", "grad1", "flat1", "wait0", "rows0", "sum0", "a2a1",
                          "next1", "wait1", "rows1", "sum1"]
    first, second = schedule.placements
    assert first.kind == "all-to-all (reduce)" and first.awaited_before == "before a2a1 is issued"
    assert second.awaited_before == "output"  # the last one: at the end of the graph


def test_with_more_in_flight_the_waits_move_later():
    gm = _two_reductions()
    apply_schedule(gm, plan_schedule(gm, reduce_inflight=2))
    assert _names(gm).index("wait0") > _names(gm).index("next1")
    with pytest.raises(ValueError, match="reduce_inflight=0: at least the reduction being issued"):
        plan_schedule(_two_reductions(), reduce_inflight=0)


def test_a_memory_budget_above_the_peak_lets_the_gather_go_ahead():
    gm = _forward_graph(activation=0)
    schedule = plan_schedule(gm, prefetch=1, extra_bytes=64)  # one gathered unit's bytes (16 float32)
    apply_schedule(gm, schedule)
    assert schedule.placements[1].issued_before == "mm0"
