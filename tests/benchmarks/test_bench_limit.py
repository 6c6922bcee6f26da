"""The physical limit's arithmetic and the best-peer ratio (benchmarks.harness.limit), on hand-made rows."""

import pytest
import torch

from benchmarks.harness.limit import (FSDPLimitParts, LimitParts, add_limit_columns, against_peers, limit_parts,
                                      measure_powersgd_compute, powersgd_shapes)


def _row(mode, runner, steps, fwd, bwd, opt):
    return {"mode": mode, "runner": runner, "step_ms_rounds": steps, "step_ms_median": sorted(steps)[len(steps) // 2],
            "fwd_ms": fwd, "bwd_ms": bwd, "opt_ms": opt}


def test_limit_is_forward_plus_the_longer_of_backward_and_link_plus_optimizer():
    assert LimitParts(fwd_s=0.01, bwd_s=0.03, opt_s=0.002, comm_s=0.05).limit_s == pytest.approx(0.062)
    assert LimitParts(fwd_s=0.01, bwd_s=0.03, opt_s=0.002, comm_s=0.02).limit_s == pytest.approx(0.042)
    cols = LimitParts(0.01, 0.03, 0.002, 0.05).columns()
    assert cols["link_bound"] is True and cols["limit_comm_ms"] == pytest.approx(50.0)


def test_limit_takes_the_fastest_compute_of_any_mode():
    rows = [_row("eager", "eager", [100, 110, 120], fwd=12, bwd=30, opt=3),
            _row("ours", "ours@4", [80, 90, 85], fwd=10, bwd=25, opt=4)]
    parts = limit_parts(rows, comm_s=0.040)
    assert (parts.fwd_s, parts.bwd_s, parts.opt_s) == pytest.approx((0.010, 0.025, 0.003))
    assert parts.limit_s == pytest.approx(0.053)
    with pytest.raises(ValueError, match="at least one mode"):
        limit_parts([], comm_s=0.04)


def test_the_limits_optimizer_step_is_of_the_modes_that_step_after_backward():
    # under the optimizer in backward the step after backward finds no gradients: its 0.1 ms is no optimizer step
    rows = [_row("eager", "eager", [100, 110, 120], fwd=12, bwd=30, opt=3),
            {**_row("ours_traced_oib", "ours_traced_oib@auto", [80, 90, 85], fwd=10, bwd=25, opt=0.1),
             "optimizer_in_backward": True}]
    parts = limit_parts(rows, comm_s=0.040)
    assert (parts.fwd_s, parts.bwd_s, parts.opt_s) == pytest.approx((0.010, 0.025, 0.003))


def test_rows_get_step_over_limit_and_the_ratio_to_the_fastest_peer():
    rows = [_row("eager", "eager", [120, 130, 140], 10, 20, 2),
            _row("builtin", "builtin@1", [100, 100, 100], 10, 20, 2),
            _row("builtin", "builtin@25", [110, 110, 110], 10, 20, 2),
            _row("ours", "ours@auto", [90, 95, 100], 10, 20, 2)]
    add_limit_columns(rows, limit_parts(rows, comm_s=0.050))
    assert all(r["limit_ms"] == pytest.approx(62.0) for r in rows)
    ours = rows[-1]
    assert ours["best_peer"] == "builtin@1"
    assert ours["ratio_vs_best_peer"] == pytest.approx(0.95)  # median of 0.90, 0.95, 1.00
    assert (ours["ratio_vs_best_peer_q1"], ours["ratio_vs_best_peer_q3"]) == pytest.approx((0.925, 0.975))
    assert ours["step_over_limit"] == pytest.approx(95 / 62)
    assert rows[1]["ratio_vs_best_peer"] == pytest.approx(1.0)


def test_without_a_peer_there_is_no_peer_ratio_but_still_a_limit():
    rows = [_row("ours", "ours@1", [90, 95, 100], 10, 20, 2), _row("nosplit", "nosplit", [100, 100, 100], 9, 22, 2)]
    add_limit_columns(rows, limit_parts(rows, comm_s=0.010))
    assert rows[0]["best_peer"] is None and rows[0]["ratio_vs_best_peer"] is None
    assert rows[0]["limit_ms"] == pytest.approx(9 + 20 + 2)


def test_fsdp_limit_charges_two_all_gathers_and_a_reduce_scatter_and_no_scatter_before_forward_ends():
    compute_bound = FSDPLimitParts(fwd_s=0.03, bwd_s=0.06, opt_s=0.001, ag_s=0.02, rs_s=0.02)
    assert compute_bound.limit_s == pytest.approx(0.091) and compute_bound.columns()["link_bound"] is False
    link_bound = FSDPLimitParts(fwd_s=0.03, bwd_s=0.06, opt_s=0.001, ag_s=0.05, rs_s=0.05)
    assert link_bound.limit_s == pytest.approx(0.151) and link_bound.columns()["link_bound"] is True
    late_scatter = FSDPLimitParts(fwd_s=0.08, bwd_s=0.01, opt_s=0.0, ag_s=0.01, rs_s=0.05)
    assert late_scatter.limit_s == pytest.approx(0.13)  # the reduce-scatter cannot start before forward ends
    rows = [_row("per_block", "per_block", [200, 210, 220], 0, 0, 0), _row("grouped", "grouped", [190, 190, 190], 0, 0, 0)]
    add_limit_columns(rows, link_bound, peers=("eager", "per_block"))
    assert rows[1]["best_peer"] == "per_block" and rows[1]["ratio_vs_best_peer"] == pytest.approx(190 / 210)
    assert rows[1]["limit_allgather_ms"] == pytest.approx(50.0)


def test_our_auto_rows_against_each_peer_at_its_default_and_its_best_cap():
    def row(mode, cap, steps):
        r = _row(mode, f"{mode}@{cap}", steps, fwd=1, bwd=1, opt=1)
        r["bucket_cap_mb"] = cap
        return r

    rows = [row("builtin", 1.0, [100, 100, 100]), row("builtin", 25.0, [200, 200, 200]),
            row("compiled_autograd", 25.0, [120, 120, 120]), row("ours", 1.0, [95, 95, 95]),
            dict(row("ours_traced", "auto", [90, 96, 110]), step_over_limit=1.02)]
    found = {(v["ours"], v["peer"], v["which"]): v for v in against_peers(rows)}
    assert set(found) == {("ours_traced@auto", "builtin@25.0", "default"), ("ours_traced@auto", "builtin@1.0", "best"),
                          ("ours_traced@auto", "compiled_autograd@25.0", "default"),
                          ("ours_traced@auto", "compiled_autograd@25.0", "best")}  # no eager row, no ours@auto row
    best = found[("ours_traced@auto", "builtin@1.0", "best")]
    assert best["ratio"] == pytest.approx(0.96) and (best["ratio_q1"], best["ratio_q3"]) == pytest.approx((0.93, 1.03))
    assert found[("ours_traced@auto", "builtin@25.0", "default")]["ratio"] == pytest.approx(0.48)
    assert best["step_over_limit"] == 1.02


def test_a_bf16_row_is_held_to_the_limit_of_its_bytes_and_to_peers_that_send_bf16_too():
    rows = [_row("compiled_autograd", "compiled_autograd@1", [100, 100, 100], 10, 20, 2),
            _row("builtin_bf16", "builtin_bf16@1", [70, 70, 70], 10, 20, 2),
            _row("eager_bf16", "eager_bf16", [80, 80, 80], 10, 20, 2),
            _row("ours_bf16", "ours_bf16@auto", [63, 56, 70], 10, 20, 2),
            _row("ours", "ours@auto", [95, 95, 95], 10, 20, 2)]
    for r in rows:
        r["reduce_dtype"] = "bf16" if r["mode"].endswith("_bf16") else "fp32"
        r["bucket_cap_mb"] = r["runner"].partition("@")[2] or 25.0
    parts = {"fp32": limit_parts(rows, comm_s=0.080), "bf16": limit_parts(rows, comm_s=0.040)}
    add_limit_columns(rows, parts)
    ours_bf16, ours = rows[3], rows[4]
    assert ours_bf16["limit_ms"] == pytest.approx(52.0) and ours["limit_ms"] == pytest.approx(92.0)
    assert ours_bf16["limit_comm_ms"] == pytest.approx(40.0)
    assert ours_bf16["best_peer"] == "builtin_bf16@1" and ours_bf16["ratio_vs_best_peer"] == pytest.approx(0.9)
    assert ours_bf16["best_fp32_peer"] == "compiled_autograd@1"
    assert ours_bf16["ratio_vs_best_fp32_peer"] == pytest.approx(0.63)
    assert ours["best_peer"] == "compiled_autograd@1" and "ratio_vs_best_fp32_peer" not in ours
    paired = {(p["ours"], p["peer"]) for p in against_peers(rows)}
    assert ("ours_bf16@auto", "builtin_bf16@1") in paired and ("ours_bf16@auto", "compiled_autograd@1") not in paired
    assert ("ours@auto", "compiled_autograd@1") in paired and ("ours@auto", "builtin_bf16@1") not in paired


def test_the_power_iteration_adds_to_backward_not_to_the_link():
    # PowerSGD's matmuls run on backward's device: with them the compressed step is compute-bound here.
    parts = LimitParts(fwd_s=0.03, bwd_s=0.057, opt_s=0.002, comm_s=0.014, compress_s=0.015)
    assert parts.limit_s == pytest.approx(0.03 + 0.057 + 0.015 + 0.002)
    cols = parts.columns()
    assert cols["limit_compress_ms"] == pytest.approx(15.0) and cols["link_bound"] is False
    rows = [_row("eager_powersgd", "eager_powersgd@25", [120, 121, 122], 30, 57, 2),
            _row("ours_traced_powersgd", "ours_traced_powersgd@auto", [110, 110, 110], 31, 58, 2)]
    for r in rows:
        r["compression"] = "powersgd:4:2"
    add_limit_columns(rows, {"fp32": limit_parts(rows, 0.550), "powersgd:4:2": limit_parts(rows, 0.014, 0.015)})
    assert rows[1]["limit_ms"] == pytest.approx(30 + 57 + 15 + 2)
    assert rows[1]["step_over_limit"] == pytest.approx(110 / 104)
    # Without compression nothing changes: the link still overlaps backward alone.
    assert limit_parts(rows, 0.014).limit_s == pytest.approx(0.030 + 0.057 + 0.002)


def test_powersgd_shapes_are_the_matrices_pytorchs_rule_compresses():
    params = [torch.empty(512, 256), torch.empty(256), torch.empty(8, 8), torch.empty(1024, 256)]
    assert powersgd_shapes(params, "powersgd:4:2") == [(512, 256, 4), (1024, 256, 4)]
    assert powersgd_shapes(params, None) == []
    assert measure_powersgd_compute([(16, 8, 2)], torch.device("cpu"), repeats=2) > 0


def test_the_power_iteration_in_backward_runs_on_each_compressed_gradient_as_it_is_made(monkeypatch):
    # Each round runs forward and backward with the iteration in a post-accumulate-grad hook on the
    # compressed matrices only, and times it there; the hooks are gone afterwards.
    from benchmarks.harness import limit

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 2))

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x, y):
            out = self.net(x)
            return out, torch.nn.functional.cross_entropy(out, y)

    seen = []
    real = limit._power_iteration

    def iteration(grad, error, q):
        seen.append(tuple(grad.shape))
        real(grad, error, q)

    monkeypatch.setattr(limit, "_power_iteration", iteration)
    batch = (torch.randn(4, 64), torch.tensor([0, 1, 0, 1]))
    seconds = limit.measure_powersgd_in_backward(WithLoss(), batch, "powersgd:2:2", torch.device("cpu"), repeats=3)
    assert seconds > 0
    # powersgd:2 compresses the 32x64 and 64x32 weights ((n + m) * 2 * 2 < n * m), not 2x64 nor the biases.
    assert sorted(seen) == sorted([(32, 64), (64, 32)] * 4)  # one warm-up round and 3 measured ones
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
