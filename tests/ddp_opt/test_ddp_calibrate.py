"""Calibrating the cost model's prediction to a measured backward (ddp_opt.planning.calibrate):
the scale, the re-predicted timeline by hand, the re-plan under the plan's own rules,
and CompiledDDP.calibrate's errors and result on a compiled model."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_opt import CostModel, DeviceRates, LinkEstimate, compile_ddp
from ddp_opt.planning.solver import UnitCost, simulate
from ddp_opt.planning.calibrate import calibrate, calibrated_model, fit_contention
from ddp_opt.planning.auto import chunk_units, solve_table

MS = 1e-3
LINK = LinkEstimate(0.0, 1e6)  # 1 MB/s: 10 ms per 10 kB


def test_the_same_plan_is_re_predicted_on_the_backward_scaled_to_the_measured_one():
    table = [UnitCost(10 * MS, 10_000), UnitCost(10 * MS, 10_000), UnitCost(10 * MS, 10_000)]
    prediction = simulate(table, [1, 2], LINK, gamma_s=1 * MS)  # backward 30 ms + 1 ms for the second bucket
    assert prediction.backward_s == pytest.approx(31 * MS)
    result = calibrate(prediction, 61 * MS)  # measured: 60 ms of compute + the same 1 ms graph break
    assert result.scale == pytest.approx(2.0) and result.measured_backward_s == 61 * MS
    cur = result.current
    assert cur.counts == (1, 2) and cur.backward_s == pytest.approx(61 * MS)
    # bucket 0 ready at 20 ms, sent 20..30; bucket 1 ready at 60 + 1 ms, sent 61..81
    assert [b.ready_s for b in cur.buckets] == pytest.approx([20 * MS, 61 * MS])
    assert cur.finish_s == pytest.approx(81 * MS) and cur.exposed_s == pytest.approx(20 * MS)
    assert result.as_dict()["calibrated_predicted_exposed_comm_ms"] == pytest.approx(20.0)


def test_a_measured_backward_equal_to_the_estimate_keeps_the_prediction_and_the_plan():
    table = [UnitCost(5 * MS, 4000), UnitCost(20 * MS, 30_000), UnitCost(5 * MS, 8000), UnitCost(1 * MS, 2000)]
    planned = solve_table(table, LINK, 0.0)
    result = calibrate(planned, planned.backward_s)
    assert result.scale == pytest.approx(1.0) and result.current.finish_s == pytest.approx(planned.finish_s)
    assert not result.changes_plan and result.gain_s == pytest.approx(0.0)


def test_a_much_longer_backward_re_plans_to_the_optimum_of_the_scaled_table():
    # Fast compute: everything is link-bound, one bucket per unit pays no latency here (alpha 0)...
    table = [UnitCost(1 * MS, 10_000) for _ in range(4)]
    link = LinkEstimate(5 * MS, 1e6)  # ... but 5 ms per message: few buckets at the estimate
    planned = solve_table(table, link, 0.0)
    result = calibrate(planned, 400 * MS)  # backward 100x the estimate: compute-bound, the tail matters
    scaled = [UnitCost(100 * MS, 10_000) for _ in range(4)]
    assert result.scale == pytest.approx(100.0)
    assert result.best.counts == solve_table(scaled, link, 0.0).counts != planned.counts
    assert result.changes_plan and result.gain_s > 0
    assert result.gain_s == pytest.approx(simulate(scaled, planned.counts, link).finish_s - result.best.finish_s)
    assert result.as_dict()["calibrated_plan_changes"] is True


def test_the_re_plan_keeps_the_traced_plans_chunks_and_its_first_chunk_alone():
    table = [UnitCost(2 * MS, 3000) for _ in range(12)]
    planned = solve_table(table, LinkEstimate(0.0, 1e6), 0.0, min_bucket_bytes=9000)
    assert planned.extra["min_bucket_bytes"] == 9000
    chunks = chunk_units(table, 9000)  # 3 units each
    for measured in (1 * MS, 24 * MS, 2400 * MS):
        best = calibrate(planned, measured).best
        assert best.counts[0] == chunks[0] and all(b.nbytes >= 9000 for b in best.buckets[:-1]), best.counts


def test_contention_delays_each_bucket_by_the_bytes_sent_before_it():
    table = [UnitCost(10 * MS, 10_000)] * 3
    t = simulate(table, [1, 1, 1], LINK, contention=1e-6)  # 10 kB sent before: 10 ms more backward
    assert [b.ready_s for b in t.buckets] == pytest.approx([10 * MS, 30 * MS, 50 * MS])
    assert t.finish_s == pytest.approx(60 * MS) and t.backward_s == pytest.approx(30 * MS)  # without contention
    assert t.exposed_s == pytest.approx(30 * MS) and t.as_dict()["contention_ms_per_mib"] == pytest.approx(2**20 * 1e-3)


def test_a_measured_exposed_comm_fits_the_contention_that_predicts_it():
    table = [UnitCost(rng_ms * MS, 200_000) for rng_ms in (3, 8, 5, 9, 4, 6)]
    link = LinkEstimate(0.5 * MS, 1e8)
    truth = simulate(table, [2, 2, 2], link, contention=3e-8)
    assert truth.exposed_s > simulate(table, [2, 2, 2], link).exposed_s
    result = calibrate(simulate(table, [2, 2, 2], link), truth.backward_s, truth.exposed_s)
    assert result.scale == pytest.approx(1.0)
    assert result.current.contention_s_per_byte == pytest.approx(3e-8, rel=1e-6)
    assert result.current.exposed_s == pytest.approx(truth.exposed_s)
    assert result.as_dict()["contention_ms_per_mib"] == pytest.approx(3e-8 * 2**20 * 1e3, rel=1e-6)
    # Less exposed than the link alone predicts, or one bucket (nothing in flight during backward): none fitted.
    assert fit_contention(table, (2, 2, 2), link, 0.0, 0.1 * truth.exposed_s) == 0.0
    assert fit_contention(table, (6,), link, 0.0, 10 * truth.exposed_s) == 0.0
    # Link-bound (every bucket after the first waits for the link): nothing to fit on.
    slow = LinkEstimate(0.5 * MS, 1e6)
    assert all(b.start_s > b.ready_s for b in simulate(table, (2, 2, 2), slow).buckets[1:])
    assert fit_contention(table, (2, 2, 2), slow, 0.0, 2 * simulate(table, (2, 2, 2), slow).exposed_s) == 0.0


def test_calibrate_rejects_a_timeline_without_a_table_and_a_nonsense_measurement():
    prediction = simulate([UnitCost(1 * MS, 10)], [1], LINK)
    with pytest.raises(ValueError, match=r"measured backward must be > 0 seconds, got 0.0\. Measure it after "
                                         r"warm-up as forward\+backward minus forward of a no_sync step"):
        calibrate(prediction, 0.0)
    bare = type(prediction)(prediction.buckets, prediction.backward_s, prediction.finish_s, LINK)
    with pytest.raises(ValueError, match="needs a prediction made by simulate"):
        calibrate(bare, 1 * MS)


# --- CompiledDDP.calibrate ------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(64, 64, bias=False) for _ in range(4)))


def test_compiled_calibrate_returns_the_calibrated_prediction_of_the_running_plan(gloo, clean_dynamo):
    cost = CostModel(LinkEstimate(1e-3, 1e8), DeviceRates(1e9, 1e9), gamma_s=0.0)
    compiled = compile_ddp(DDP(_model()), backend="eager", bucket_cap_mb="auto", link=cost)
    compiled(torch.randn(2, 64)).sum().backward()
    prediction = compiled.prediction
    result = compiled.calibrate(3 * prediction.backward_s)
    assert result.scale == pytest.approx(3.0) and result.current.counts == prediction.counts
    assert result.current.backward_s == pytest.approx(3 * prediction.backward_s)
    assert compiled.prediction is prediction  # the running plan is left as it is


def test_the_calibrated_cost_model_plans_the_calibrated_plan_in_the_next_compile(gloo, clean_dynamo):
    # Fast compute against a 1 ms latency: one bucket. At 10^4 x the backward, compute-bound: more buckets.
    cost = CostModel(LinkEstimate(1e-3, 1e8), DeviceRates(1e9, 1e9), gamma_s=0.0, min_bucket_bytes=0)
    first = compile_ddp(DDP(_model()), backend="eager", bucket_cap_mb="auto", link=cost)
    first(torch.randn(2, 64)).sum().backward()
    result = first.calibrate(1e4 * first.prediction.backward_s)
    assert result.changes_plan and len(first.prediction.buckets) == 1 < len(result.best.buckets)
    torch._dynamo.reset()
    again = compile_ddp(DDP(_model()), backend="eager", bucket_cap_mb="auto", link=result.cost_model)
    again(torch.randn(2, 64)).sum().backward()
    assert again.prediction.counts == result.best.counts
    assert again.prediction.finish_s == pytest.approx(result.best.finish_s)


def test_the_calibrated_cost_model_carries_the_fitted_contention_into_the_plan(gloo, clean_dynamo):
    table = [UnitCost(5 * MS, 200_000) for _ in range(6)]
    link = LinkEstimate(0.5 * MS, 1e8)
    measured = simulate(table, [2, 2, 2], link, contention=3e-8)
    result = calibrate(simulate(table, [2, 2, 2], link), measured.backward_s, measured.exposed_s)
    cost = CostModel(link, DeviceRates(1e9, 2e9, 1e-6), gamma_s=0.0)
    model = calibrated_model(cost, result)
    assert model.contention_s_per_byte == pytest.approx(3e-8, rel=1e-6) and model.link == link
    assert model.rates == DeviceRates(1e9 / result.scale, 2e9 / result.scale, 1e-6 * result.scale)
    compiled = compile_ddp(DDP(_model()), backend="eager", bucket_cap_mb="auto", link=model)
    compiled(torch.randn(2, 64)).sum().backward()
    assert compiled.prediction.contention_s_per_byte == model.contention_s_per_byte  # planned with it


def test_compiled_calibrate_without_a_prediction_says_how_to_get_one(gloo, clean_dynamo):
    compiled = compile_ddp(DDP(_model()), backend="eager")  # DDP's caps, no cost model
    compiled(torch.randn(2, 64)).sum().backward()
    with pytest.raises(RuntimeError, match=r"no cost-model prediction to calibrate\. .*Compile with "
                                           r"bucket_cap_mb='auto' and call calibrate after a warm-up step"):
        compiled.calibrate(0.01)


class _TwoGraphs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def test_compiled_calibrate_refuses_a_model_captured_as_several_graphs(gloo, clean_dynamo):
    cost = CostModel(LinkEstimate(1e-3, 1e8), DeviceRates(1e9, 1e9), gamma_s=0.0)
    compiled = compile_ddp(DDP(_TwoGraphs()), backend="eager", bucket_cap_mb="auto", link=cost)
    compiled(torch.randn(2, 64)).sum().backward()
    assert compiled.splitter.planned_graphs == 2
    with pytest.raises(RuntimeError, match=r"captured as 2 graphs with parameters \(graph breaks\), and the "
                                           r"prediction covers only the last one.*Remove the graph breaks"):
        compiled.calibrate(0.01)

