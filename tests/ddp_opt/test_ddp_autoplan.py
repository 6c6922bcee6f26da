"""The cost-model bucket plan (compile_ddp(bucket_cap_mb="auto")): the DP against
brute force on hand-built tables, link fitting, caps that make plan_buckets
reproduce the DP's boundaries on a captured GPT, and compile_ddp's auto arguments on one
rank. Two gloo ranks and the launcher's setting: tests/ddp_opt/test_ddp_autoplan_ranks.py."""

import itertools
import random
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _capture import capture
from ddp_opt import BucketCaps, CostModel, DeviceRates, LinkEstimate, compile_ddp, measure_alignment, plan_buckets
from ddp_opt.planning.solver import NO_HOOK_COMPUTE, HookCompute, UnitCost, simulate, solve
from ddp_opt.planning.cost import measure_link
from ddp_opt.planning.cost import fit_link, node_backward_costs
from ddp_opt.planning.auto import _unit_counts, unit_costs
from launch.models import GPT, GPTConfig

# --- the DP on hand-built tables ---------------------------------------------------


def _brute_force(units, link, gamma, contention=0.0, hook=NO_HOOK_COMPUTE):
    n = len(units)
    best = None
    for cuts in itertools.product((0, 1), repeat=n - 1):
        counts, run = [], 1
        for c in cuts:
            if c:
                counts.append(run)
                run = 0
            run += 1
        counts.append(run)
        t = simulate(units, counts, link, gamma, contention, hook)
        if best is None or t.finish_s < best.finish_s:
            best = t
    return best


@pytest.mark.parametrize("seed", range(40))
def test_dp_finds_the_brute_force_optimum_on_random_tables(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    units = [UnitCost(rng.uniform(0, 5e-3), rng.randint(1, 4 * 2**20)) for _ in range(n)]
    link = LinkEstimate(rng.choice([0.0, 1e-4, 1e-3, 1e-2]), rng.choice([1e7, 1e8, 1e9, 1e10]))
    gamma = rng.choice([0.0, 2e-4, 1e-3])
    dp, brute = solve(units, link, gamma), _brute_force(units, link, gamma)
    assert dp.finish_s == pytest.approx(brute.finish_s, rel=1e-9, abs=1e-12)
    # the returned timeline is the simulation of the returned split
    assert simulate(units, [b.units for b in dp.buckets], link, gamma) == dp


@pytest.mark.parametrize("seed", range(10))
def test_the_dp_with_contention_finds_the_brute_force_optimum(seed):
    # A bucket's readiness depends on the bytes of the buckets before it (Note [Cost-model bucket plan]).
    rng = random.Random(seed)
    units = [UnitCost(rng.uniform(0.1, 5) * 1e-3, rng.randint(1, 20) * 1000) for _ in range(rng.randint(2, 8))]
    link, kappa = LinkEstimate(rng.uniform(0, 2) * 1e-3, 1e7), rng.uniform(0, 5) * 1e-7
    assert solve(units, link, 1e-4, contention=kappa).finish_s == pytest.approx(
        _brute_force(units, link, 1e-4, kappa).finish_s)


@pytest.mark.parametrize("seed", range(10))
def test_the_dp_with_a_hooks_compute_finds_the_brute_force_optimum(seed):
    # Every bucket a compressing hook sends takes fixed + bytes * per_byte from backward, on top of the
    # graph break and the contention (Note [Cost-model bucket plan]).
    rng = random.Random(seed)
    units = [UnitCost(rng.uniform(0.1, 5) * 1e-3, rng.randint(1, 20) * 1000) for _ in range(rng.randint(2, 8))]
    link, kappa = LinkEstimate(rng.uniform(0, 2) * 1e-3, 1e7), rng.uniform(0, 2) * 1e-7
    hook = HookCompute(rng.uniform(0, 3) * 1e-3, rng.uniform(0, 5) * 1e-7)
    dp = solve(units, link, 1e-4, contention=kappa, hook=hook)
    assert dp.finish_s == pytest.approx(_brute_force(units, link, 1e-4, kappa, hook).finish_s)
    assert dp.hook == hook and dp.as_dict()["hook_fixed_ms"] == pytest.approx(hook.fixed_s * 1e3)


def test_a_hook_that_computes_delays_every_later_bucket_and_the_plan_makes_fewer():
    # Two units of 1 s backward and 1 MB; the link: 0.1 s + 1 MB/s. Without the hook's compute the
    # first bucket's transfer overlaps the second unit's backward; a hook computing 2 s per bucket
    # on backward's cores delays the second unit by 2 s, so one bucket is sooner.
    units = [UnitCost(1.0, 10**6), UnitCost(1.0, 10**6)]
    link = LinkEstimate(0.1, 1e6)
    two = simulate(units, [1, 1], link, hook=HookCompute(2.0, 0.0))
    assert two.buckets[1].ready_s == pytest.approx(2.0 + 2.0)
    assert [b.units for b in solve(units, link).buckets] == [1, 1]
    assert [b.units for b in solve(units, link, hook=HookCompute(2.0, 0.0)).buckets] == [2]
    assert [b.units for b in solve(units, link, hook=HookCompute(0.0, 2e-6)).buckets] == [2]  # per byte alike


@pytest.mark.parametrize("fixed, per_byte", [(-1e-3, 0.0), (0.0, -1e-9), (float("nan"), 0.0)])
def test_a_hook_compute_below_zero_is_refused(fixed, per_byte):
    with pytest.raises(ValueError, match=r"^HookCompute\(fixed_s=.*\): both must be >= 0 \(seconds per bucket and "
                                         r"per gradient byte\); HookCompute\(\) is a hook that computes nothing\.$"):
        HookCompute(fixed, per_byte)


def test_dp_hand_cases():
    # Compute-bound: each unit's transfer (0.9 s) is shorter than its backward (1 s);
    # any merge delays the last bucket, so the finest split is the unique optimum.
    units = [UnitCost(1.0, 9) for _ in range(4)]
    t = solve(units, LinkEstimate(0.0, 10.0))
    assert [b.units for b in t.buckets] == [1, 1, 1, 1]
    assert t.finish_s == pytest.approx(4.9) and t.exposed_s == pytest.approx(0.9)
    # Zero latency, slow link: the finest split reaches the optimum (the link is busy from the first unit on).
    slow = LinkEstimate(0.0, 1.0)
    finest = simulate(units, [1, 1, 1, 1], slow)
    assert solve(units, slow).finish_s == pytest.approx(finest.finish_s) == pytest.approx(1.0 + 36.0)
    # Huge latency: one bucket.
    assert [b.units for b in solve(units, LinkEstimate(100.0, 10.0)).buckets] == [4]
    # A graph break that costs more than anything it could hide: one bucket.
    assert len(solve(units, LinkEstimate(0.0, 10.0), gamma_s=10.0).buckets) == 1
    # Fast link with latency: few buckets, and the bytes/caps come out per bucket.
    fast = solve([UnitCost(1.0, 100) for _ in range(8)], LinkEstimate(0.5, 1e6))
    assert 1 < len(fast.buckets) < 8
    assert fast.caps == tuple(b.nbytes for b in fast.buckets) and sum(fast.caps) == 800


def test_robust_plan_hedges_against_a_wrong_backward_estimate():
    from ddp_opt.planning.solver import solve_robust

    # Comm-bound: 8 units of 1 s backward and 2 s transfer. At the estimate, the exact
    # optimum is indifferent to merging the last units (the link is busy anyway) ...
    units = [UnitCost(1.0, 2) for _ in range(8)]
    link = LinkEstimate(0.0, 1.0)
    scales = (1.0, 3.0)
    robust = solve_robust(units, link, 0.0, scales=scales)
    # ... the robust choice is judged at every scale against that scale's optimum
    worst = max(simulate([UnitCost(u.backward_s * s, u.nbytes) for u in units], [b.units for b in robust.buckets],
                         link).finish_s / solve([UnitCost(u.backward_s * s, u.nbytes) for u in units], link).finish_s
                for s in scales)
    assert robust.extra["regret"] == pytest.approx(worst)
    exact = solve(units, link)
    exact_worst = simulate([UnitCost(3.0, 2) for _ in range(8)], [b.units for b in exact.buckets], link).finish_s / \
        solve([UnitCost(3.0, 2) for _ in range(8)], link).finish_s
    # The exact optimum merges the last units and loses 23% when backward is 3x slower;
    # the robust plan keeps them apart and loses nothing at either scale.
    assert [b.units for b in exact.buckets] != [b.units for b in robust.buckets]
    assert robust.extra["regret"] == pytest.approx(1.0) and exact_worst > 1.2
    assert robust.finish_s == pytest.approx(exact.finish_s)  # still optimal at the estimate here
    # one scale: the exact optimum
    rng = random.Random(1)
    table = [UnitCost(rng.uniform(0, 1e-2), rng.randint(1, 2**22)) for _ in range(7)]
    assert solve_robust(table, LinkEstimate(1e-3, 1e8), 1e-4, scales=(1.0,)).finish_s == \
        pytest.approx(solve(table, LinkEstimate(1e-3, 1e8), 1e-4).finish_s)
    assert "worst-case regret" in __import__("ddp_opt.planning.solver", fromlist=["x"]).format_timeline(robust)


def test_timeline_table_and_dict_name_the_prediction():
    from ddp_opt.planning.solver import format_timeline

    t = simulate([UnitCost(1e-3, 2**20), UnitCost(1e-3, 2**20)], [1, 1], LinkEstimate(1e-3, 1e8, "given"), 5e-4)
    table = format_timeline(t)
    assert "ready ms" in table and "finish ms" in table and "exposed comm (step comm tail)" in table
    d = t.as_dict()
    assert d["predicted_finish_ms"] == pytest.approx(t.finish_s * 1e3)
    assert d["predicted_exposed_comm_ms"] == pytest.approx((t.finish_s - t.backward_s) * 1e3)
    assert [b["mib"] for b in d["buckets"]] == [1.0, 1.0]


def test_link_estimate_rejects_nonsense():
    with pytest.raises(ValueError, match=r"latency must be >= 0 seconds and the bandwidth > 0 bytes/s, e\.g\."):
        LinkEstimate(1e-3, 0.0)


# --- measuring ---------------------------------------------------------------------


def test_fit_link_recovers_alpha_and_bandwidth():
    sizes = [2**16, 2**18, 2**20, 2**22]
    est = fit_link(sizes, [2e-3 + s / 5e8 for s in sizes])
    assert est.alpha_s == pytest.approx(2e-3) and est.bandwidth == pytest.approx(5e8)


class _SleepyLink:
    """A probe whose all-reduce takes alpha + n / bandwidth (a Future completed after sleeping)."""

    def __init__(self, alpha, bandwidth):
        self.alpha, self.bandwidth, self.sizes = alpha, bandwidth, []

    def __call__(self, t):
        nbytes = t.numel() * t.element_size()
        self.sizes.append(nbytes)
        time.sleep(self.alpha + nbytes / self.bandwidth)
        fut = torch.futures.Future()
        fut.set_result(t)
        return fut


def test_measure_link_goes_through_the_probe_and_fits_it():
    probe = _SleepyLink(2e-3, 2e9)
    est = measure_link(probe, reps=3, warmup=1)
    assert probe.sizes[0] == 64 * 1024 and len(probe.sizes) == 1 + 3 * 4
    assert est.source == "measured"
    # Sleeps never end early; load on the machine only adds time (loose upper bound). The exact
    # fit is pinned on noise-free numbers by test_fit_link_recovers_alpha_and_bandwidth.
    modelled = 2e-3 + 4 * 2**20 / 2e9
    assert 0.9 * modelled <= est.transfer_s(4 * 2**20) <= 3 * modelled, est


# --- caps reproduce the DP's plan on a captured graph -------------------------------


def test_auto_caps_make_plan_buckets_reproduce_the_dp_boundaries():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    x = torch.randint(0, 64, (2, 16))
    rates = DeviceRates(flops=1e10, bytes=1e10)
    seen = []

    def inspect(gm, example_inputs):
        units = plan_buckets(gm, BucketCaps(1))
        table = unit_costs(units, node_backward_costs(gm, rates))
        assert len(table) == len(units) > 10
        assert sum(u.nbytes for u in table) == sum(b.size for b in units)
        # matmuls dominate: the unit holding the MLP's fc weight costs more than a LayerNorm's
        fc = next(i for i, b in enumerate(reversed(units)) if any(p.endswith("mlp.fc.weight") for p in b.params))
        ln = next(i for i, b in enumerate(reversed(units)) if any(p.endswith("ln2.weight") for p in b.params))
        assert table[fc].backward_s > 10 * table[ln].backward_s
        for link in (LinkEstimate(1e-3, 1e8), LinkEstimate(1e-4, 1e8), LinkEstimate(0.0, 1e7),
                     LinkEstimate(1e-5, 3e8), LinkEstimate(1.0, 1e9)):
            best = solve(table, link, 1e-5)
            caps = BucketCaps(best.caps[0], per_bucket_caps=best.caps)
            planned = plan_buckets(gm, caps)
            assert _unit_counts(units, planned) == [b.units for b in best.buckets], link
            assert [b.size for b in reversed(planned)] == [b.nbytes for b in best.buckets]
            seen.append(len(planned))

    capture(model, x, inspect=inspect)
    assert len(set(seen)) >= 3, f"the links should give different bucket counts, got {seen}"
    assert seen[-1] == 1


def test_the_default_floor_keeps_every_bucket_but_the_last_at_1_mib_where_single_units_split_below():
    # The measured failure: a link fitted at zero latency, single units -> a LayerNorm's 2 KiB alone
    # (split plan 1.077x ours@1, GPT seq 256 at 200 Mbit). The default CostModel plans over 1 MiB chunks.
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=256, n_head=4, vocab_size=512)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    link, rates = LinkEstimate(0.0, 1e8), DeviceRates(1e10, 1e10)
    seen = {}

    def inspect(gm, example_inputs):
        from ddp_opt.planning.auto import plan_auto

        assert CostModel(link, rates).min_bucket_bytes == 1 << 20
        _, floored, timeline = plan_auto(gm, CostModel(link, rates, 0.0))
        _, single, _ = plan_auto(gm, CostModel(link, rates, 0.0, min_bucket_bytes=0))
        seen["floored"] = [b.size for b in reversed(floored)]  # gradient-ready order
        seen["single"] = [b.size for b in reversed(single)]
        seen["extra"] = timeline.extra["min_bucket_bytes"]

    capture(GPT(cfg), x, inspect=inspect)
    assert min(seen["single"]) <= 2 * 4 * cfg.n_embd, seen["single"]  # a LayerNorm (weight + bias) alone
    assert len(seen["floored"]) >= 2 and all(s >= 1 << 20 for s in seen["floored"][:-1]), seen["floored"]
    assert sum(seen["floored"]) == sum(seen["single"]) and seen["extra"] == 1 << 20


@pytest.mark.parametrize("bad", [-1, 0.5, True, "1MiB"])
def test_a_bad_min_bucket_bytes_says_what_it_expects(bad):
    with pytest.raises(ValueError, match=r"CostModel\(min_bucket_bytes=.*\): expected a whole number of bytes "
                                         r">= 0, .* default is 1 MiB \(1 << 20\), 0 lets it plan over single units"):
        CostModel(LinkEstimate(0.0, 1e8), DeviceRates(1e10, 1e10), min_bucket_bytes=bad)


def test_cost_estimate_adds_no_guards_under_dynamic_shapes(clean_dynamo):
    # Symbolic sizes are read as their hints: planning must not specialise the graph (a recompile per length).
    from ddp_opt.planning.auto import plan_auto

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(plan_auto(gm, CostModel(LinkEstimate(1e-3, 1e8), DeviceRates(1e10, 1e10, 1e-6)))[-1])
        return gm.forward

    compiled = torch.compile(GPT(GPTConfig()), backend=backend, dynamic=True)
    compiled(torch.randint(0, 64, (2, 16)))
    compiled(torch.randint(0, 64, (2, 12)))
    assert len(graphs) == 1 and graphs[0].backward_s > 0


# --- compile_ddp arguments ---------------------------------------------------------


def test_compile_ddp_rejects_bad_auto_arguments(gloo):
    ddp = DDP(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"bucket_cap_mb=4\): expected None .* or 'auto' .* "
                                         r"DistributedDataParallel\(model, bucket_cap_mb=4\)"):
        compile_ddp(ddp, backend="eager", bucket_cap_mb=4)
    with pytest.raises(ValueError, match=r"compile_ddp\(link=..., strategy='whole'\): the cost model chooses \(or "
                                         r"predicts\)"):
        compile_ddp(ddp, backend="eager", link=LinkEstimate(1e-3, 1e8), strategy="whole")
    with pytest.raises(ValueError, match="bucket_cap_mb='auto', strategy='whole'\\): the cost model chooses"):
        compile_ddp(ddp, backend="eager", bucket_cap_mb="auto", strategy="whole")
    with pytest.raises(ValueError, match="strategy='regional'\\): the cost model chooses .*Drop one"):
        compile_ddp(ddp, backend="eager", bucket_cap_mb="auto", strategy="regional")


def test_a_cost_model_without_auto_predicts_the_plan_at_ddp_caps(gloo, clean_dynamo):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64, bias=False) for _ in range(4)))
    cost = CostModel(LinkEstimate(1e-3, 1e8), DeviceRates(1e9, 1e9), gamma_s=0.0)
    compiled = compile_ddp(DDP(model, bucket_cap_mb=2 * 64 * 64 * 4 / 2**20), backend="eager", link=cost)
    compiled(torch.randn(2, 64)).sum().backward()
    assert [b.size for b in compiled.buckets] == [2 * 16384, 2 * 16384]  # DDP's caps, not the DP's
    pred = compiled.prediction
    assert [b.nbytes for b in pred.buckets] == [2 * 16384, 2 * 16384] and [b.units for b in pred.buckets] == [2, 2]
    assert pred.buckets[1].finish_s == pytest.approx(pred.buckets[1].start_s + 1e-3 + 2 * 16384 / 1e8)


def test_a_one_bucket_auto_plan_is_realigned_too(gloo, clean_dynamo):
    # DDP's default caps give 2 runtime buckets here; the DP's single bucket is a choice, so it is enforced.
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=128, n_head=2, vocab_size=1024)
    ddp = DDP(GPT(cfg))
    # a graph break costs 1 s; no 1 MiB floor on this small model (it would make the first chunk a bucket alone)
    cost = CostModel(LinkEstimate(1e-3, 1e8), DeviceRates(1e11, 1e10), gamma_s=1.0, min_bucket_bytes=0)
    compiled = compile_ddp(ddp, backend="aot_eager", bucket_cap_mb="auto", link=cost)
    for step in range(3):
        x = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(step))
        compiled(x, x)[1].backward()
    assert len(compiled.buckets) == 1 and compiled.aligned_caps == (compiled.buckets[0].size,)
    assert measure_alignment(ddp, compiled.buckets).fraction == 1.0


def test_a_hook_on_backwards_own_cores_gets_one_bucket_where_the_dp_makes_more():
    # Note [Cost-model bucket plan]: on the CPU the hooks took 2 to 4 times the probe's times in a step,
    # and the DP's plans measured slower than one bucket; there "auto" makes one bucket.
    from ddp_opt.planning.auto import solve_table
    from ddp_opt.planning.solver import format_timeline

    units = [UnitCost(1.0, 10**6), UnitCost(1.0, 10**6)]
    link = LinkEstimate(0.1, 1e6)
    apart = solve_table(units, link, 0.0, hook=HookCompute(0.01, 0.0))
    shared = solve_table(units, link, 0.0, hook=HookCompute(0.01, 0.0, shares_cores=True))
    assert apart.counts == (1, 1) and "one_bucket" not in apart.extra
    assert shared.counts == (2,) and shared.extra["one_bucket"] is True
    assert shared.finish_s == pytest.approx(simulate(units, [2], link, hook=HookCompute(0.01, 0.0)).finish_s)
    assert "one bucket: the hook computes on backward's own cores" in format_timeline(shared)
    assert "one bucket" not in format_timeline(apart)


def test_compile_ddp_realigns_to_one_bucket_under_a_hook_on_backwards_cores(gloo, clean_dynamo):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=128, n_head=2, vocab_size=1024)
    buckets = {}
    for shares in (False, True):
        ddp = DDP(GPT(cfg))
        cost = CostModel(LinkEstimate(1e-4, 1e6), DeviceRates(1e9, 1e9), gamma_s=0.0, min_bucket_bytes=0,
                         hook=HookCompute(1e-5, 0.0, shares_cores=shares))
        compiled = compile_ddp(ddp, backend="aot_eager", bucket_cap_mb="auto", link=cost)
        for step in range(3):
            x = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(step))
            compiled(x, x)[1].backward()
        buckets[shares] = len(compiled.buckets)
    assert buckets[False] >= 2 and buckets[True] == 1, buckets
    assert compiled.aligned_caps == (compiled.buckets[0].size,)  # DDP's reducer runs the one bucket
    assert measure_alignment(ddp, compiled.buckets).fraction == 1.0


@pytest.mark.parametrize("seed", range(12))
def test_dp_with_a_pinned_first_bucket_finds_the_best_such_plan(seed):
    from ddp_opt.planning.solver import solve_robust

    rng = random.Random(100 + seed)
    n = rng.randint(2, 8)
    units = [UnitCost(rng.uniform(0, 5e-3), rng.randint(1, 4 * 2**20)) for _ in range(n)]
    link = LinkEstimate(rng.choice([0.0, 1e-4, 1e-3]), rng.choice([1e7, 1e8, 1e9]))
    first = rng.randint(1, n)
    best = None
    for cuts in itertools.product((0, 1), repeat=max(n - first - 1, 0)):  # every plan with that first bucket
        counts, run = [first], 1
        for c in cuts:
            if c:
                counts.append(run)
                run = 0
            run += 1
        if first < n:
            counts.append(run)
        t = simulate(units, counts, link)
        best = t if best is None or t.finish_s < best.finish_s else best
    dp = solve(units, link, first=first)
    assert dp.buckets[0].units == first and dp.finish_s == pytest.approx(best.finish_s, rel=1e-9, abs=1e-12)
    assert solve_robust(units, link, first=first).buckets[0].units == first
    with pytest.raises(ValueError, match="first bucket must hold between 1 and"):
        solve(units, link, first=n + 1)


def test_a_plan_over_chunks_keeps_every_bucket_but_the_last_at_the_minimum_and_the_first_alone():
    from ddp_opt.planning.auto import chunk_units, plan_auto

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    x = torch.randint(0, 64, (2, 16))
    seen = {}

    def inspect(gm, example_inputs):
        units = plan_buckets(gm, BucketCaps(1))
        total = sum(b.size for b in units)
        minimum = total // 6
        table = unit_costs(units, node_backward_costs(gm, DeviceRates(1e10, 1e10)))
        chunks = chunk_units(table, minimum)
        assert sum(chunks) == len(units) and len(chunks) > 2
        for link in (LinkEstimate(0.0, 1e6), LinkEstimate(0.0, 1e8), LinkEstimate(1e-3, 1e8), LinkEstimate(1.0, 1e9)):
            caps, planned, timeline = plan_auto(gm, CostModel(link, DeviceRates(1e10, 1e10), 0.0,
                                                          min_bucket_bytes=minimum))
            sizes = [b.size for b in reversed(planned)]  # gradient-ready order
            assert sum(sizes) == total and all(s >= minimum for s in sizes[:-1]), (link, sizes)
            assert _unit_counts(units, planned)[0] == chunks[0]  # the first chunk is a bucket alone
            seen[link] = len(planned)
        # Without the minimum, the zero-latency link splits below it (the first LayerNorm alone).
        _, unchunked, _ = plan_auto(gm, CostModel(LinkEstimate(0.0, 1e8), DeviceRates(1e10, 1e10), 0.0,
                                                    min_bucket_bytes=0))
        seen["unchunked"] = [b.size for b in reversed(unchunked)]
        seen["chunks"], seen["minimum"] = len(chunks), minimum

    capture(model, x, inspect=inspect)
    assert min(seen["unchunked"][:-1]) < seen["minimum"]
    assert seen[LinkEstimate(0.0, 1e8)] == seen["chunks"]  # zero latency: one bucket per chunk
    assert seen[LinkEstimate(1.0, 1e9)] == 2  # a huge latency: the first chunk, then all the rest
