"""Note [Traced FSDP plan], pure: the simulated step, the chosen units within the memory
budget, and the plan's table. No process group, nothing measured."""

import pytest

from compiler.ranks.link import LinkEstimate
from fsdp_opt.traced.plan import CollectiveLink, TracedPlan, TracedUnit, choose_units, format_plan, simulate
from fsdp_opt.traced.schedule import Placement

MiB = 1 << 20


def _link(alpha_s: float, mb_per_s: float) -> CollectiveLink:
    fit = LinkEstimate(alpha_s, mb_per_s * 1e6, "given")
    return CollectiveLink(fit, fit)


def _blocks(n: int, nbytes: int = MiB, fwd_s: float = 0.01) -> list[TracedUnit]:
    return [TracedUnit(i + 1, (f"blocks.{i}",), nbytes, fwd_s, 2 * fwd_s) for i in range(n)]


ROOT = TracedUnit(0, (), MiB // 4, 0.001, 0.002, resharded=False)


def test_a_compute_bound_step_costs_its_compute_plus_the_first_gather_and_the_last_reduce_scatter():
    link = _link(0.0, 1e4)  # 10 GB/s: every collective of 1 MiB takes 0.1 ms
    units = [ROOT] + _blocks(4)
    seconds, peak = simulate(units, link, prefetch=1)
    compute = sum(u.fwd_s + u.bwd_s for u in units)
    transfer = MiB / 1e10
    assert compute < seconds < compute + 4 * transfer
    assert peak == ROOT.nbytes + 2 * MiB  # the root, the unit in use and the next one


def test_a_link_bound_step_costs_every_byte_on_the_link():
    link = _link(0.0, 10.0)  # 10 MB/s: 0.1 s per MiB, far above the compute
    units = [ROOT] + _blocks(4)
    seconds, _ = simulate(units, link, prefetch=1)
    gathers = (ROOT.nbytes + 4 * MiB) + 4 * MiB  # forward, and the blocks again in backward
    reduces = ROOT.nbytes + 4 * MiB
    assert seconds == pytest.approx((gathers + reduces) / 10e6, rel=0.05)


def test_keeping_the_last_unit_gathered_saves_its_backward_gather():
    link = _link(0.0, 10.0)
    blocks = _blocks(4)
    kept_last = [ROOT] + blocks[:-1] + [TracedUnit(4, ("blocks.3",), MiB, 0.01, 0.02, resharded=False)]
    regathered, _ = simulate([ROOT] + blocks, link, prefetch=1)
    kept, peak = simulate(kept_last, link, prefetch=1)
    assert regathered - kept == pytest.approx(MiB / 10e6, rel=0.05)


def test_with_fsdp2s_budget_the_plan_keeps_the_last_unit_and_one_block_per_unit():
    units, seconds, peak = choose_units(ROOT, _blocks(6), _link(1e-4, 100.0), prefetch=1,
                                        budget_bytes=ROOT.nbytes + 2 * MiB)
    assert [u.blocks for u in units[1:]] == [(f"blocks.{i}",) for i in range(6)]
    assert [u.resharded for u in units] == [False, True, True, True, True, True, False]
    assert peak <= ROOT.nbytes + 2 * MiB


def test_a_high_latency_link_with_room_groups_blocks_into_bigger_units():
    # 20 ms per collective against 1 ms per MiB: fewer, bigger collectives win once the budget allows them
    units, _, _ = choose_units(ROOT, _blocks(8, fwd_s=0.001), _link(0.02, 1000.0), prefetch=1,
                               budget_bytes=64 * MiB)
    assert len(units) - 1 < 8


def test_the_plan_never_breaks_the_budget_except_with_one_block_per_unit():
    tight = ROOT.nbytes + MiB  # below even one block per unit with prefetch
    units, _, _ = choose_units(ROOT, _blocks(4), _link(1e-4, 100.0), prefetch=1, budget_bytes=tight)
    assert [u.blocks for u in units[1:]] == [(f"blocks.{i}",) for i in range(4)]
    assert all(u.resharded for u in units[1:])


def test_the_table_names_units_and_where_each_collective_is_issued_and_awaited():
    plan = TracedPlan(units=[ROOT] + _blocks(2), prefetch=1, how="auto", link=_link(1e-4, 100.0),
                      budget_bytes=3 * MiB, predicted_s=0.05, peak_bytes=2 * MiB)
    plan.placements["forward"] = [Placement("all-gather", 1, 262144, "mm0 (blocks.0.mlp)", "mm1 (blocks.1.mlp)")]
    text = format_plan(plan)
    assert "traced FSDP plan (auto; prefetch 1; gradients by reduce-scatter; predicted 50.0 ms" in text
    assert "(root)" in text and "blocks.1" in text and "kept" in text
    assert "link: all-gather 0.100 ms + 100 MB/s" in text
    assert "forward graph collectives:" in text and "mm0 (blocks.0.mlp)" in text
