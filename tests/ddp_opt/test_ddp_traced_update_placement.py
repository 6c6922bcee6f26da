"""Where the traced backward runs each bucket's wait and optimizer updates (Note [Traced update]):
two buckets behind its all-reduce unless that would move a write past a read of the same memory, and
the auto plan's buckets cut to an eighth of the gradients with the optimizer in backward."""

import torch
from torch import fx

from _capture import capture
from ddp_opt import BucketCaps, CostModel, DeviceRates, LinkEstimate
from ddp_opt.planning.buckets import split_caps
from ddp_opt.planning.cost import MIN_BUCKET_BYTES
from ddp_opt.strategies.traced.plan import IN_BACKWARD_BUCKETS, TracedPlan
from ddp_opt.strategies.traced.placement import sink_updates
from launch.models import GPT, GPTConfig

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def _backward(buckets=4, late_read_of_first=False):
    """A backward as the traced strategy fuses it: per bucket a gradient, its division into the bucket,
    the in-place all-reduce, then the wait and the update right after (where the fusion leaves them); the
    writes into the parameters at the end, as AOTAutograd writes a graph's input mutations."""
    g = fx.Graph()
    params = [g.placeholder(f"p{k}") for k in range(buckets)]
    h = g.placeholder("grad_out")
    named = {}
    for k in range(buckets):
        h = g.call_function(aten.mul.Tensor, (h, 2.0))  # backward's own work, which every later bucket needs
        grad = g.call_function(aten.mul.Tensor, (h, 0.5))
        part = g.call_function(aten.div.Tensor, (grad, 2))
        cat = g.call_function(aten.cat.default, ([part],))
        reduced = g.call_function(c10d.all_reduce_.default, (cat, "sum", "0"))
        wait = g.call_function(c10d.wait_tensor.default, (reduced,))
        named[f"update{k}"] = g.call_function(aten.sub.Tensor, (params[k], wait))
        named.update({f"div{k}": part, f"reduce{k}": reduced, f"wait{k}": wait})
        if late_read_of_first and k == 2:  # backward reads the first bucket's parameter once bucket 2 is filled
            h = named["late"] = g.call_function(aten.mul.Tensor, (h, g.call_function(aten.t.default, (params[0],))))
    for k in range(buckets):
        named[f"write{k}"] = g.call_function(aten.copy_.default, (params[k], named[f"update{k}"]))
    g.output(h)
    return g, named


def _position(g):
    return {node: k for k, node in enumerate(g.nodes)}


def test_each_bucket_is_waited_for_and_updated_before_the_bucket_two_later_is_filled():
    g, n = _backward()
    assert sink_updates(g) == 4 * 3
    g.lint()
    at = _position(g)
    # bucket 0 runs once bucket 1's all-reduce is issued, just before bucket 2's division
    assert at[n["reduce1"]] < at[n["wait0"]] < at[n["update0"]] < at[n["write0"]] == at[n["div2"]] - 1
    assert at[n["reduce2"]] < at[n["wait1"]] and at[n["write1"]] == at[n["div3"]] - 1
    # the last two buckets have no bucket two later: at the end, after every all-reduce
    output = next(node for node in g.nodes if node.op == "output")
    assert at[n["reduce3"]] < at[n["wait2"]] and at[n["write3"]] == at[output] - 1


def test_a_write_never_moves_above_a_read_of_the_parameter_it_updates():
    g, n = _backward(late_read_of_first=True)
    sink_updates(g)
    g.lint()
    at = _position(g)
    # the read of p0 below bucket 2's fill point still sees the old value: the write goes to the end;
    # what only reads (the wait, the update's arithmetic) still runs early
    assert at[n["div2"]] < at[n["late"]] < at[n["write0"]]
    assert at[n["update0"]] < at[n["div2"]]
    assert at[n["write1"]] == at[n["div3"]] - 1


def test_split_caps_cuts_only_caps_above_the_most_into_equal_pieces():
    assert split_caps((1000, 5000, 2000), 2000) == (1000, 1667, 1667, 1667, 2000)
    assert split_caps((), 10) == ()


def test_with_the_optimizer_in_backward_auto_buckets_hold_at_most_an_eighth_of_the_gradients():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=512, block_size=64))
    slow_link = CostModel(rates=DeviceRates(flops=1e10, bytes=1e10), link=LinkEstimate(5e-3, 2.5e7))
    caps = {}

    def inspect(gm, example_inputs):
        for in_backward in (False, True):
            plan = TracedPlan(BucketCaps(1 << 20), "aot_eager", cost_model=slow_link, auto=True)
            plan.updates_in_backward = in_backward
            plan._plan(gm)
            caps[in_backward] = plan.caps.per_bucket_caps

    capture(model, torch.randint(0, 512, (1, 64)), inspect=inspect)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    most = max(grad_bytes // IN_BACKWARD_BUCKETS, MIN_BUCKET_BYTES)
    assert max(caps[False]) > 2 * most  # a slow link: the time plan makes a few large buckets
    assert max(caps[True]) <= most and sum(caps[True]) >= sum(caps[False])
