"""compile_ddp(strategy="traced") (Note [Traced strategy]): the bucket grouping, the settings
it refuses, its fallbacks to the split strategy, and two gloo ranks training like eager DDP
step by step (aot_eager: one all-reduce per gradient; inductor: fused by our plan)."""

import copy
import re
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _graph_caches import compile_every_graph

from compiler import SettingError
from ddp_opt import BucketCaps, CostModel, DDPCompileConfig, DeviceRates, LinkEstimate, compile_ddp
from ddp_opt._torch_internals import registered_hook_name, runtime_buckets
from ddp_opt.planning.buckets import group_by_caps
from ddp_opt.strategies.traced.plan import TracedPlan
from launch.models import GPT, GPTConfig

STEPS = 4


# --- the grouping, no process group -----------------------------------------------------


def test_group_by_caps_closes_each_bucket_at_its_cap():
    # First bucket capped at 100 bytes, then 250: closes when the bytes reach the cap.
    assert group_by_caps([60, 50, 100, 100, 100, 10], BucketCaps(250, 100)) == [2, 3, 1]
    # Per-bucket caps, the last repeating.
    assert group_by_caps([10, 10, 10, 10, 10], BucketCaps(10, per_bucket_caps=(20, 10))) == [2, 1, 1, 1]
    # One gradient larger than its cap is a bucket alone; what is left is the last bucket.
    assert group_by_caps([500, 1, 1], BucketCaps(100)) == [1, 2]
    assert group_by_caps([], BucketCaps(100)) == []


def test_a_backward_that_all_reduces_compiles_in_graph_order_and_a_no_sync_one_does_not():
    # Inductor's peak-memory reordering pulled each wait up to its all-reduce where the backward adds to
    # existing gradients (Note [Traced strategy]); a no_sync backward has nothing to overlap and keeps it.
    seen = []

    def backend(gm, example_inputs):
        seen.append(torch._inductor.config.reorder_for_peak_memory)
        return gm.forward

    def graph(all_reduce):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        y = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
        if all_reduce:
            y = g.call_function(torch.ops._c10d_functional.all_reduce.default, (y, "sum", "0"))
            y = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (y,))
        g.output(y)
        return torch.fx.GraphModule(torch.nn.Module(), g)

    plan = TracedPlan(BucketCaps(2**20), backend)
    default = torch._inductor.config.reorder_for_peak_memory
    plan._backward_backend(graph(all_reduce=True), [])
    plan._backward_backend(graph(all_reduce=False), [])
    assert seen == [False, default] and torch._inductor.config.reorder_for_peak_memory == default


def test_traced_first_bucket_is_small_unless_ddp_was_given_a_list():
    mib = 2**20
    assert TracedPlan(BucketCaps(4 * mib, 4 * mib), "aot_eager").caps == BucketCaps(4 * mib, mib)
    assert TracedPlan(BucketCaps(mib // 100, mib // 100), "aot_eager").caps.cap_for(0) == mib // 100
    listed = BucketCaps(4 * mib, per_bucket_caps=(4 * mib, 8 * mib))
    assert TracedPlan(listed, "aot_eager").caps == listed


def test_strategy_settings_refused_before_anything_runs():
    with pytest.raises(SettingError, match=r"strategy='pipelined'.*expected one of 'split': .*'traced': ") as e:
        DDPCompileConfig(backend="aot_eager", strategy="pipelined")
    assert e.value.setting == "strategy"
    assert DDPCompileConfig(backend="aot_eager", strategy="traced").cache_settings()["strategy"] == "traced"


# --- two gloo ranks ------------------------------------------------------------------------


def _batch(rank, step, vocab, batch=4, seq=16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _traced_rank(rank, world_size, backend, cfg, bucket_cap_mb, auto_model, accumulate=True, device="cpu"):
    """compile_ddp(strategy="traced") and eager DDP side by side; each step accumulates one
    micro-batch under no_sync (with ``accumulate``), then one synchronised; losses and
    gradients compared. ``device``: where the models and batches live (``cuda:0`` for ranks sharing
    one GPU over gloo)."""
    compile_every_graph()  # the fusion is recorded when the pass runs (Note [Graph caches off, kernel files kept])
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    ref_model = copy.deepcopy(model)
    ddp, ref = DDP(model, bucket_cap_mb=bucket_cap_mb), DDP(ref_model, bucket_cap_mb=bucket_cap_mb)
    more = dict(bucket_cap_mb="auto", link=auto_model) if auto_model is not None else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*strategy='traced'")  # no fallback, no plain-backward warning
        compiled = compile_ddp(ddp, backend=backend, strategy="traced", **more)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        losses = []
        for step in range(STEPS):
            (x0, y0), (x1, y1) = (tuple(t.to(device) for t in _batch(rank, 2 * step + i, cfg.vocab_size))
                                  for i in (0, 1))
            if accumulate:
                with compiled.no_sync():
                    compiled.backward(compiled(x0, y0)[1])
                with ref.no_sync():
                    ref(x0, y0)[1].backward()
            loss, ref_loss = compiled(x1, y1)[1], ref(x1, y1)[1]
            compiled.backward(loss)
            ref_loss.backward()
            for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"rank {rank} step {step} grad {name}: {m}")
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
            losses.append((loss.item(), ref_loss.item()))
    with pytest.raises(RuntimeError, match=r"strategy='traced'.*calls a hook per gradient with \(grad, param\): a DDP bucket hook cannot take that.*strategy='split'.*reduce_dtype=torch.bfloat16"):
        compiled.register_comm_hook(None, lambda state, bucket: None)
    # A plain loss.backward() still all-reduces (eagerly, one gradient at a time) and is warned about.
    plain = compiled(x1, y1)[1]
    plain.backward()
    ref(x1, y1)[1].backward()
    torch.testing.assert_close(model.lm_head.weight.grad, ref_model.lm_head.weight.grad, rtol=1e-4, atol=1e-5)
    with pytest.warns(UserWarning, match=r"a forward ran again without compiled.backward\(loss\)"):
        compiled(x1, y1)
    grads = [p.numel() * p.element_size() for p in model.parameters()]
    calibration = None
    if compiled.prediction is not None:  # the traced plan has no graph-break cost: the scale is the ratio
        cal = compiled.calibrate(2 * compiled.prediction.backward_s)
        calibration = (cal.scale, cal.current.counts == compiled.prediction.counts, cal.cost_model.gamma_s)
    return dict(losses=losses, strategy=compiled.strategy, fused=compiled.traced.fused,
                caps=compiled.traced.caps, grad_bytes=sum(grads),
                predicted=compiled.prediction is not None, calibration=calibration)


def _check_parity(results):
    for rank, r in enumerate(results):
        assert r["strategy"] == "traced"
        for step, (loss, ref_loss) in enumerate(r["losses"]):
            assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), f"rank {rank} step {step}"
    if len(results) > 1:  # ranks saw different data, DDP kept them in sync
        assert results[0]["losses"][0] != results[1]["losses"][0]


def _check_fused_by_caps(r, cap_mb):
    fused = r["fused"][0]  # the synchronised backward (the no_sync one has no all-reduce)
    assert len(r["fused"]) == 1 and sum(fused) == r["grad_bytes"], r["fused"]
    assert len(fused) > 1 and all(b >= int(cap_mb * 2**20) for b in fused[:-1]), fused  # each closed at DDP's cap


@pytest.mark.slow
def test_two_rank_traced_aot_eager_matches_eager_ddp_with_accumulation(run_ranks):
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=2, vocab_size=128, block_size=16, tie_weights=True)
    results = run_ranks(_traced_rank, "aot_eager", cfg, 0.05, None)
    _check_parity(results)
    assert results[0]["fused"] == []  # no Inductor, no fusion pass: one all-reduce per gradient


def _traced_inductor_rank(rank, world_size, cfg, auto_model):
    """DDP's caps with accumulation, then the auto plan without it (its no_sync backward would be
    one more Inductor compile of what the first run checks): one spawn for both. Each run also
    returns what the code of its compiled backwards runs in order (``_collective_orders``)."""
    from torch._inductor.utils import run_and_get_code  # every graph Inductor compiles while fn runs

    by_caps, codes = run_and_get_code(_traced_rank, rank, world_size, "inductor", cfg, 0.01, None)
    auto, auto_codes = run_and_get_code(_traced_rank, rank, world_size, "inductor", cfg, 0.01, auto_model,
                                        accumulate=False)
    return (by_caps, _collective_orders(codes)), (auto, _collective_orders(auto_codes))


_CALLS = re.compile(r"^\s*(?:torch\.ops\._c10d_functional\.(all_reduce_|wait_tensor)\.default\(|"
                    r"(cpp_fused\w*\(|extern_kernels\.\w+\(|\w+\.run\())", re.M)


def _collective_orders(codes):
    """Per compiled graph with all-reduces, what its code runs in order: "A" an all-reduce issued,
    "W" a wait, "K" a compute kernel."""
    orders = ["".join({"all_reduce_": "A", "wait_tensor": "W"}.get(op, "K") for op, _ in _CALLS.findall(code))
              for code in codes]
    return [o for o in orders if "A" in o]


def _check_overlap_scheduled(orders):
    # Every wait after the last all-reduce is issued (Inductor's schedule_comm_wait put each at its first
    # use, the end of backward), and with several buckets backward computes while they are in flight:
    # between the first all-reduce and the first wait run more kernels than the copies into the later
    # buckets. Inductor's peak-memory reordering broke each: waits pulled up to their all-reduces, or
    # every all-reduce issued after the last gradient was computed (Note [Traced strategy]).
    assert orders, "no compiled graph issued an all-reduce"
    for order in orders:
        collectives = order.replace("K", "")
        assert "W" in collectives and "A" not in collectives[collectives.index("W"):], order
        in_flight = order[order.index("A"):order.index("W")]
        buckets = in_flight.count("A")
        assert buckets == 1 or in_flight.count("K") > buckets - 1, order


@pytest.mark.slow
def test_two_rank_traced_inductor_fuses_by_ddp_caps_and_by_the_auto_plan(run_ranks):
    cfg = GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    # The auto plan: a slow link and a fast device make the DP choose few, large buckets; the fusion follows it.
    slow = CostModel(LinkEstimate(5e-3, 1e6), DeviceRates(1e12, 1e11))
    both = run_ranks(_traced_inductor_rank, cfg, slow, timeout=900)
    results = [by_caps for (by_caps, _), _ in both]
    _check_parity(results)
    # The synchronised backward adds to the no_sync step's gradients (a graph copying into them), where
    # Inductor's peak-memory reordering pulled each wait up to its all-reduce (Note [Traced strategy]).
    for (_, orders), _ in both:
        _check_overlap_scheduled(orders)
    for r in results:
        _check_fused_by_caps(r, 0.01)
    results = [auto for _, (auto, _) in both]
    _check_parity(results)
    for _, (_, orders) in both:
        _check_overlap_scheduled(orders)
    for r in results:
        caps = r["caps"].per_bucket_caps
        assert r["predicted"] and caps, r
        assert len(r["fused"][0]) == len(caps) and r["fused"][0] == list(caps), r
        scale, same_plan, gamma = r["calibration"]
        assert scale == pytest.approx(2.0) and same_plan and gamma == 0.0


def _fallback_rank(rank, world_size, why):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if why == "unused":
        ddp = DDP(model, find_unused_parameters=True)
    else:
        ddp = DDP(model)
        ddp.register_comm_hook(None, lambda state, bucket: _allreduce_future(bucket))
    with pytest.warns(UserWarning, match=r"strategy='traced'\) runs the split strategy instead: (.*)") as caught:
        compiled = compile_ddp(ddp, backend="aot_eager", strategy="traced", align_buckets=False)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    compiled.backward(compiled(x).sum())  # the split strategy: a plain backward through DDP's reducer
    return compiled.strategy, str(caught[0].message), model[0].weight.grad.clone()


def _allreduce_future(bucket):
    import torch.distributed as dist

    t = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


@pytest.mark.slow
@pytest.mark.parametrize("why, reason", [("unused", "find_unused_parameters=True"), ("hook", "comm hook")])
def test_traced_falls_back_to_split_with_a_warning(run_ranks, why, reason):
    results = run_ranks(_fallback_rank, why)
    for strategy, message, _ in results:
        assert strategy == "split"
        assert reason in message and "pass strategy='split'" in message
    torch.testing.assert_close(results[0][2], results[1][2])  # still all-reduced


def test_calling_the_ddp_model_itself_gets_the_traced_checks(gloo, clean_dynamo):
    # Either handle works: the check that backward ran in compiled.backward runs from DDP's own forward.
    torch.manual_seed(0)
    ddp = DDP(GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2)), bucket_cap_mb=1)
    compiled = compile_ddp(ddp, backend="aot_eager", strategy="traced")
    assert compiled.strategy == "traced"
    x = torch.randint(0, 512, (2, 8))
    ddp(x, x)[1].backward()
    with pytest.warns(UserWarning, match=r"a forward ran again without compiled.backward\(loss\)"):
        ddp(x, x)


def test_traced_frees_the_detached_c_reducers_bucket_buffers_and_still_trains(gloo, clean_dynamo):
    # The C++ reducer's buffers are one more copy of every gradient, never written under the python
    # reducer: compile_ddp re-creates it over one placeholder element, so only 4 bytes stay bucketed.
    torch.manual_seed(0)
    ddp = DDP(GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2)), bucket_cap_mb=1)
    grad_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters())
    assert sum(n for bucket in runtime_buckets(ddp) for _, n in bucket) == grad_bytes
    reference = copy.deepcopy(ddp.module)
    compiled = compile_ddp(ddp, backend="aot_eager", strategy="traced")
    assert [n for bucket in runtime_buckets(ddp) for _, n in bucket] == [4]
    assert registered_hook_name(ddp) is None  # DDP's logger answers, from the new reducer
    x = torch.randint(0, 512, (2, 8))
    compiled.backward(compiled(x, x)[1])
    reference(x, x)[1].backward()  # one rank: the all-reduce of the mean is the gradient itself
    for p, q in zip(ddp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
