"""benchmarks.render.ablation: each lever's ratio between runners of one sweep, or its ceiling."""

import json

import pytest

from benchmarks.render.ablation import ablation_markdown, ablation_rows
from benchmarks.render.readme_results import END, START, main


def _row(mode, cap, steps, **more):
    runner = f"{mode}@{cap if isinstance(cap, str) else int(cap)}"
    return {"mode": mode, "bucket_cap_mb": cap, "runner": runner, "step_ms_rounds": steps,
            "step_ms_median": sorted(steps)[len(steps) // 2], "opt_ms": 4.0, **more}


SWEEP = [
    _row("builtin", 1.0, [100, 100, 100]),
    _row("builtin", 25.0, [150, 150, 150]),
    _row("compiled_autograd", 4.0, [110, 100, 105]),
    _row("ours", 1.0, [104, 98, 100]),
    _row("ours", 4.0, [120, 120, 120]),
    _row("ours", "auto", [102, 100, 99], predicted_exposed_comm_ms=30.0, exposed_comm_ms=20.0),
    _row("ours_traced", 4.0, [121, 100, 105]),
    _row("ours_traced", "auto", [96, 98, 100], predicted_exposed_comm_ms=22.0, exposed_comm_ms=20.0),
]


def _by_lever(rows):
    return {(r["lever"], r["comparison"]): r for r in rows}


def test_each_lever_is_a_ratio_of_two_runners_of_the_same_rounds():
    found = _by_lever(ablation_rows(SWEEP))
    plan = found[("1 cost-model plan", "ours@auto / ours@1")]  # ours' best fixed cap is 1 (100 ms median)
    assert plan["ratio"] == pytest.approx(0.99)  # per round 102/104, 100/98, 99/100
    assert plan["note"] == "exposed comm predicted 30.0 ms, measured 20.0 ms (1.50x)"
    traced_plan = found[("1 cost-model plan", "ours_traced@auto / ours_traced@4")]
    assert traced_plan["ratio"] == pytest.approx(sorted([96 / 121, 98 / 100, 100 / 105])[1])
    traced = found[("2 traced strategy", "ours_traced@auto / ours@auto")]
    assert traced["ratio"] == pytest.approx(sorted([96 / 102, 98 / 100, 100 / 99])[1])
    assert (traced["ratio_q1"], traced["ratio_q3"]) == pytest.approx(
        ((96 / 102 + 98 / 100) / 2, (98 / 100 + 100 / 99) / 2))
    first = found[("4 first bucket <= 1 MiB", "ours_traced@4 / compiled_autograd@4")]
    assert first["ratio"] == pytest.approx(1.0) and first["note"] == ""  # no earlier sweep given


def test_levers_not_built_get_their_ceiling_and_the_result_row_the_best_peer():
    found = _by_lever(ablation_rows(SWEEP))
    optimizer = found[("3 optimizer under the link", "ceiling on ours_traced@auto")]  # the faster auto row
    assert optimizer["ratio"] == pytest.approx((98 - 4) / 98) and optimizer["ratio_q1"] is None
    assert optimizer["note"] == "optimizer step 4.0 ms of a 98.0 ms step"
    auto = found[("5 strategy=auto", "ceiling over ours_traced@auto")]
    assert auto["ratio"] == 1.0  # split is slower by median: picking a strategy gains nothing over traced
    assert auto["note"].startswith("split / traced at auto: 1.020 ")
    result = found[("result", "ours_traced@auto / builtin@1")]
    assert result["ratio"] == pytest.approx(0.98)
    faster_split = [dict(r, step_ms_rounds=[90, 90, 90], step_ms_median=90) if r["runner"] == "ours@auto" else r
                    for r in SWEEP]
    auto = _by_lever(ablation_rows(faster_split))[("5 strategy=auto", "ceiling over ours_traced@auto")]
    assert auto["ratio"] == pytest.approx(90 / 98)


def test_the_plan_row_quotes_the_calibrated_prediction_and_whether_the_plan_would_change():
    calibrated = dict(backward_scale=1.4, calibrated_predicted_exposed_comm_ms=21.0, calibrated_plan_changes=False,
                      calibrated_plan_gain_ms=0.0, calibrated_plan_mib=[1.0, 3.0], contention_ms_per_mib=2.5,
                      calibration_rounds=3)
    rows = [dict(r, **calibrated) if r["runner"] == "ours@auto" else r for r in SWEEP]
    plan = _by_lever(ablation_rows(rows))[("1 cost-model plan", "ours@auto / ours@1")]
    assert plan["note"] == ("exposed comm predicted 30.0 ms, measured 20.0 ms (1.50x); calibrated (backward x1.40, "
                            "contention 2.50 ms/MiB, on 3 rounds): 21.0 ms (1.05x), keeps the plan")
    rows = [dict(r, calibrated_plan_changes=True, calibrated_plan_gain_ms=2.5) if r["runner"] == "ours@auto" else
            dict(r, calibrated_predicted_exposed_comm_ms=33.0, exposed_comm_ms=30.0) if r["runner"] == "ours@4" else r
            for r in rows]
    plan = _by_lever(ablation_rows(rows))[("1 cost-model plan", "ours@auto / ours@1")]
    assert plan["note"].endswith("(1.05x), re-plans to 2 buckets, 2.5 ms sooner; fixed caps calibrated alike: @4 1.10x")


def test_the_first_bucket_row_quotes_the_earlier_sweep_and_rows_without_ours_give_nothing():
    before = [dict(r, step_ms_rounds=[130, 130, 130]) if r["runner"] == "ours_traced@4" else r for r in SWEEP]
    first = _by_lever(ablation_rows(SWEEP, before))[("4 first bucket <= 1 MiB", "ours_traced@4 / compiled_autograd@4")]
    assert first["note"] == "before the cap (4 MiB first bucket, earlier sweep): 1.238 [1.210, 1.269]"
    peers_only = [r for r in SWEEP if not r["mode"].startswith("ours")]
    assert ablation_rows(peers_only) == [] and ablation_markdown(peers_only) == ""


def test_the_readme_block_of_a_limited_sweep_carries_the_ablation(tmp_path):
    limit = dict(limit_ms=80.0, limit_fwd_ms=20.0, limit_bwd_ms=50.0, limit_comm_ms=55.0, limit_opt_ms=5.0,
                 best_peer="builtin@1", net="shaped:800mbit", link="none", backend="inductor", world_size=2,
                 rounds=3, ratio_vs_builtin=1.0, ratio_q1=1.0, ratio_q3=1.0, step_over_limit=1.2)
    rows = [dict(r, **limit) for r in SWEEP]
    data, earlier, readme = tmp_path / "rows.json", tmp_path / "before.json", tmp_path / "README.md"
    data.write_text(json.dumps(rows))
    earlier.write_text(json.dumps([dict(r, step_ms_rounds=[130, 130, 130]) if r["runner"] == "ours_traced@4" else r
                                   for r in rows]))
    readme.write_text(f"{START}\n{END}\n")
    assert main([str(data), str(readme), "--before", str(earlier)]) == 0
    text = readme.read_text()
    assert "Lever by lever" in text and "| 2 traced strategy | traced vs split, both planned |" in text
    assert "before the cap (4 MiB first bucket, earlier sweep): 1.238" in text
    assert main([str(data), str(readme), "--before", "-"]) == 0
    assert "Lever by lever" in readme.read_text() and "earlier sweep" not in readme.read_text()
