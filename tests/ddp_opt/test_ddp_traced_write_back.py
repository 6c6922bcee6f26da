"""The traced backward's write-back order (Note [Traced strategy], ``delay_write_back``): what
reads an all-reduced bucket waits until its first real use, so backward runs on while the
bucket crosses the link. Hand-built graphs, no process group."""

import operator

import torch
from torch import fx
from torch.fx.passes.shape_prop import TensorMetadata

from ddp_opt import BucketCaps
from ddp_opt.strategies.traced.plan import FuseByPlan, TracedPlan, delay_write_back

aten, prims, c10d = torch.ops.aten, torch.ops.prims, torch.ops._c10d_functional


def _meta(node: fx.Node, shape: tuple[int, ...], dtype: torch.dtype) -> fx.Node:
    node.meta["tensor_meta"] = TensorMetadata(torch.Size(shape), dtype, False, (1,) * len(shape),
                                              torch.contiguous_format, False, {})
    return node


def _fused_bucket_then_more_backward() -> tuple[fx.Graph, fx.Node]:
    """A backward as Inductor's fusion pass leaves it (the generated code of a 4-layer GPT's bucket):
    two bf16 gradients concatenated into one all-reduce, its wait, split and the copies back into
    the gradients right after it; then more backward (``later``) that needs none of it."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    grad1 = g.call_function(aten.mm.default, (x, w))
    grad2 = g.call_function(aten.mm.default, (grad1, w))
    casts = [g.call_function(prims.convert_element_type.default, (grad, torch.bfloat16)) for grad in (grad1, grad2)]
    flat = g.call_function(aten.cat, ([g.call_function(aten.flatten.using_ints, (c,)) for c in casts],))
    div = _meta(g.call_function(aten.div.Tensor, (flat, 2)), (32,), torch.bfloat16)
    comm = _meta(g.call_function(c10d.all_reduce.default, (div, "sum", "0")), (32,), torch.bfloat16)
    wait = g.call_function(c10d.wait_tensor.default, (comm,))
    split = g.call_function(aten.split, (wait, [16, 16]))
    copies = [g.call_function(aten.copy.default, (grad, g.call_function(aten.reshape, (
        g.call_function(operator.getitem, (split, k)), (4, 4))))) for k, grad in enumerate((grad1, grad2))]
    later = g.call_function(aten.mm.default, (grad2, w))
    g.output((*copies, later))
    return g, later


def _position(g: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(g.nodes)}


def test_a_fused_bucket_is_waited_for_after_the_rest_of_backward():
    # The wait, delayed only to its first use (a copy right after it), stopped backward until the
    # bucket had crossed the link: a traced plan lost its overlap by where its boundaries fell.
    g, later = _fused_bucket_then_more_backward()
    FuseByPlan(TracedPlan(BucketCaps(1 << 30), backend_fn=None))(g)
    g.lint()
    at = _position(g)
    [comm] = [n for n in g.nodes if n.target in (c10d.all_reduce.default, c10d.all_reduce_.default)]
    [wait] = [n for n in g.nodes if n.target is c10d.wait_tensor.default]
    copies = [n for n in g.nodes if n.target is aten.copy.default]
    assert at[comm] < at[later] < at[wait], "the wait comes after the backward that does not need it"
    assert all(at[later] < at[c] for c in copies), "the write-back comes after it too"


def test_a_fused_bucket_is_one_buffer_reduced_in_place():
    # The fusion divides the concatenation and all-reduces the quotient, which Inductor lowers with a copy: the
    # gradients, the concatenation and the copy were live at once. Now each gradient is divided into its slice.
    g, _ = _fused_bucket_then_more_backward()
    FuseByPlan(TracedPlan(BucketCaps(1 << 30), backend_fn=None))(g)
    g.lint()
    [comm] = [n for n in g.nodes if n.target is c10d.all_reduce_.default]
    assert not [n for n in g.nodes if n.target is c10d.all_reduce.default]
    cat = comm.args[0]
    assert cat.target is aten.cat and comm.args[1:] == ("sum", "0")
    assert [(part.target, part.args[1]) for part in cat.args[0]] == [(aten.div.Tensor, 2)] * 2
    assert [part.args[0].target for part in cat.args[0]] == [aten.flatten.using_ints] * 2
    assert list(cat.users) == [comm], "nothing else reads the buffer the all-reduce writes"


def test_a_write_back_moves_past_another_buckets_in_place_all_reduce_but_not_past_a_write_to_what_it_reads():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    first = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce_.default, (x, "sum", "0")),))
    back = g.call_function(aten.mul.Tensor, (first, 0.5))
    reads_w = g.call_function(aten.add.Tensor, (first, w))
    second = g.call_function(c10d.all_reduce_.default, (w, "sum", "0"))
    later = g.call_function(aten.mm.default, (x, x))
    g.output((back, reads_w, g.call_function(c10d.wait_tensor.default, (second,)), later))
    delay_write_back(g)
    g.lint()
    at = _position(g)
    assert at[later] < at[back], "another bucket's in-place all-reduce writes only its own buffer"
    assert at[reads_w] < at[second], "never past a write to what it reads"


def test_what_feeds_a_collective_or_follows_a_mutation_stays():
    # PowerSGD's P all-reduce feeds its Q: its wait must stay where the next stage starts. A write-back
    # never moves past an op that may write to memory it reads.
    g = fx.Graph()
    x, w, memory = g.placeholder("x"), g.placeholder("w"), g.placeholder("memory")
    p = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (x, "sum", "0")),))
    q = g.call_function(aten.mm.default, (p, w))
    q_wait = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (q, "sum", "0")),))
    back = g.call_function(aten.mul.Tensor, (q_wait, 0.5))
    write = g.call_function(aten.copy_.default, (memory, x))
    tail = g.call_function(aten.mm.default, (x, w))
    g.output((back, write, tail))
    before = [n.name for n in g.nodes]
    moved = delay_write_back(g)
    g.lint()
    at = _position(g)
    assert [n.name for n in g.nodes][:6] == before[:6], "P's wait and the stage it feeds keep their places"
    assert at[back] < at[write], "nothing moves past the in-place copy"
    assert moved == 0


def test_a_write_back_moves_to_just_before_its_first_user():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    wait = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (x, "sum", "0")),))
    part = g.call_function(operator.getitem, (g.call_function(aten.split, (wait, [2])), 0))
    work = g.call_function(aten.mm.default, (x, w))
    use = g.call_function(aten.add.Tensor, (work, part))
    more = g.call_function(aten.mm.default, (use, w))
    g.output((more,))
    assert delay_write_back(g) == 3
    g.lint()
    names = [n.name for n in g.nodes]
    assert names.index("mm_default") < names.index("wait_tensor_default") < names.index("add_tensor")


def test_the_ops_the_pass_reads_are_recognised_on_this_torch():
    # The private accesses of ddp_opt.strategies.traced._torch_internals, on the ops Inductor's fusion pass writes.
    from ddp_opt.strategies.traced._torch_internals import comm_role, mutates

    g = fx.Graph()
    x = g.placeholder("x")
    call = {t: g.call_function(t, (x,)) for t in (c10d.all_reduce.default, c10d.wait_tensor.default, aten.split,
                                                  aten.cat, aten.copy.default, aten.copy_.default, aten.add_)}
    assert [comm_role(n) for n in call.values()][:3] == ["collective", "wait", None]
    assert [mutates(n) for n in call.values()] == [False, False, False, False, False, True, True]
    assert mutates(g.call_function(aten.cat, (x,), {"out": x}))


def _bucket_updated_then_more_backward() -> tuple[fx.Graph, fx.Node, fx.Node]:
    """A bucket's all-reduce, its wait and the traced update of its parameter right after it (the
    optimizer in backward), then more backward (``later``) that needs none of it."""
    g = fx.Graph()
    x, w, p = g.placeholder("x"), g.placeholder("w"), g.placeholder("p")
    grad = g.call_function(aten.mm.default, (x, w))
    div = _meta(g.call_function(aten.div.Tensor, (grad, 2)), (4, 4), torch.float32)
    comm = _meta(g.call_function(c10d.all_reduce.default, (div, "sum", "0")), (4, 4), torch.float32)
    wait = g.call_function(c10d.wait_tensor.default, (comm,))
    update = g.call_function(aten.sub_.Tensor, (p, g.call_function(aten.mul.Tensor, (wait, 0.1))))
    later = g.call_function(aten.mm.default, (grad, w))
    g.output((later,))
    return g, update, later


def test_with_the_update_in_backward_the_waits_and_updates_move_after_the_rest_of_backward():
    g, update, later = _bucket_updated_then_more_backward()
    plan = TracedPlan(BucketCaps(1 << 30), backend_fn=None)
    plan.updates_in_backward = True
    FuseByPlan(plan)(g)
    g.lint()
    at = _position(g)
    [comm] = [n for n in g.nodes if n.target is c10d.all_reduce.default]
    [wait] = [n for n in g.nodes if n.target is c10d.wait_tensor.default]
    [update] = [n for n in g.nodes if n.target is aten.sub_.Tensor]
    assert at[comm] < at[later] < at[wait] < at[update], "backward runs on while the bucket crosses the link"
