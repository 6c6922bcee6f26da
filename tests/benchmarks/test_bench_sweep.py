"""benchmarks.studies.sweep: which (mode, cap) pairs a sweep measures, the summary that answers
the sweep's question (ours@auto vs the best fixed cap and builtin), and the tables
(terminal and docs) with an ``auto`` cap. Hand-built rows; one tiny 2-rank smoke run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.studies.ddp_compare import format_table, parse_args
from benchmarks.render.readme_results import results_markdown, update_file
from benchmarks.studies.sweep import format_summary, sweep_runners, sweep_summary

REPO = Path(__file__).resolve().parents[2]


def test_sweep_pairs_every_cap_with_ours_and_builtin_and_auto_with_ours_only():
    assert sweep_runners(("eager", "builtin", "nosplit", "ours"), (1.0, 4.0, "auto")) == [
        ("eager", 25.0), ("builtin", 1.0), ("builtin", 4.0), ("nosplit", 25.0),
        ("ours", 1.0), ("ours", 4.0), ("ours", "auto"),
    ]


def test_caps_parse_auto_and_auto_needs_sweep():
    from benchmarks.studies.ddp_bench import BenchConfig

    args = parse_args(["--sweep", "--caps", "1,4,25,auto"])
    assert args.sweep and args.caps == (1.0, 4.0, 25.0, "auto")
    with pytest.raises(ValueError, match="--caps auto needs --sweep.*Add --sweep, or drop auto"):
        BenchConfig(caps=(1.0, "auto"))
    BenchConfig(caps=(1.0, "auto"), sweep=True)
    with pytest.raises(SystemExit):
        parse_args(["--caps", "1,fast"])


def _row(mode, cap, steps, **extra):
    runner = f"{mode}@{cap if isinstance(cap, str) else format(cap, 'g')}"
    return {
        "mode": mode, "runner": runner, "backend": "eager" if mode == "eager" else "aot_eager", "link": "1ms,100MB/s",
        "bucket_cap_mb": cap, "step_ms_median": sorted(steps)[len(steps) // 2], "step_ms_rounds": steps,
        "ratio_vs_builtin": None, "ratio_q1": None, "ratio_q3": None, "overlap": 0.9, "alignment": 1.0,
        "partitions": 3, "compute_ms": 100.0, "comm_ms": 50.0, "exposed_comm_ms": 5.0, "compile_cold_s": 1.0,
        "compile_warm_s": None, "warm_cache": None, "ddp_buckets": 3, "recompiles": 0, "loss_max_abs_diff": 0.0,
        "mode_order": 0, **extra,
    }


ROWS = [
    _row("builtin", 1.0, [110.0, 120.0, 130.0]),
    _row("builtin", 25.0, [150.0, 150.0, 150.0]),
    _row("ours", 1.0, [100.0, 100.0, 100.0]),
    _row("ours", 25.0, [140.0, 140.0, 140.0]),
    _row("ours", "auto", [102.0, 96.0, 104.0], predicted_exposed_comm_ms=4.0),
]


def test_summary_compares_auto_round_by_round_with_the_best_caps():
    s = sweep_summary(ROWS)
    vs = {v["against"]: v for v in s["vs"]}
    assert vs["best fixed ours"]["runner"] == "ours@1"
    assert vs["best fixed ours"]["ratio"] == pytest.approx(1.02)  # median of 1.02, 0.96, 1.04
    assert vs["builtin default"]["runner"] == "builtin@25"
    assert vs["builtin default"]["ratio"] == pytest.approx(102 / 150)
    assert vs["best builtin"]["runner"] == "builtin@1"
    assert vs["best builtin"]["ratio"] == pytest.approx(0.8)  # 102/120 > 96/120 = 0.8 > 104/130 = 0.8
    assert s["checks"] == {"within 5% of best fixed ours": True, "10% faster than builtin@25": True,
                           "alignment 1.0": True, "overlap >= 0.85": True}
    text = format_summary(s)
    assert "| best fixed ours | ours@1 | 100.0 | 1.020 [" in text
    assert "exposed comm measured 5.0 ms vs predicted 4.0 ms" in text
    assert sweep_summary(ROWS[:4]) is None and format_summary(None) == ""


def test_summary_marks_checks_it_cannot_judge():
    s = sweep_summary([r for r in ROWS if r["runner"] != "builtin@25"])
    assert s["checks"]["10% faster than builtin@25"] is None
    assert "10% faster than builtin@25: n/a" in format_summary(s)


def test_tables_show_the_auto_cap_last_with_its_prediction(tmp_path):
    table = format_table(ROWS)
    assert table.splitlines()[-1].lstrip("| ").startswith("auto") and "4.0" in table.splitlines()[-1]
    md = results_markdown(ROWS)
    lines = next(block for block in md.split("\n\n") if block.startswith("| cap MiB")).splitlines()
    assert "predicted exposed ms" in lines[0]
    assert lines[-1].startswith("| auto | ours |")
    assert "every (mode, cap) pair, `ours@auto` included" in md and "| auto against |" in md
    # one block per JSON file (one sweep per link)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(ROWS))
    b.write_text(json.dumps([dict(r, link="1ms,1GB/s") for r in ROWS]))
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- bench:ddp:start -->\nold\n<!-- bench:ddp:end -->\ny\n")
    update_file([a, b], readme, plot=["a.png", "b.png"])
    text = readme.read_text()
    assert text.index("Link `1ms,100MB/s`") < text.index("Link `1ms,1GB/s`") and "\nold\n" not in text
    assert "![step time vs bucket cap](a.png)" in text and "![step time vs bucket cap](b.png)" in text


@pytest.mark.slow
def test_tiny_sweep_runs_auto_next_to_fixed_caps(tmp_path):
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, "-m", "benchmarks.studies.ddp_compare", "--device", "cpu", "--backend", "aot_eager", "--layers", "2",
           "--embd", "128", "--heads", "2", "--vocab", "1024", "--seq", "16", "--batch", "2", "--caps", "1,auto",
           "--steps", "2", "--warmup", "1", "--link", "1ms,100MB/s", "--sweep", "--modes", "eager,builtin,ours",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert [r["runner"] for r in rows] == ["eager@25", "builtin@1", "ours@1", "ours@auto"]
    by = {r["runner"]: r for r in rows}
    auto = by["ours@auto"]
    assert auto["bucket_cap_mb"] == "auto" and auto["predicted_exposed_comm_ms"] is not None
    # calibrated to the measured rounds' no_sync backward, the row's bwd_ms
    assert auto["measured_backward_ms"] == pytest.approx(auto["bwd_ms"]) and auto["backward_scale"] > 0
    assert auto["calibration_rounds"] == 2
    assert auto["calibrated_predicted_exposed_comm_ms"] is not None and by["ours@1"]["backward_scale"] > 0
    # the contention is fitted on ours@auto and predicts ours@1 with it
    assert auto["contention_fitted_on"] == by["ours@1"]["contention_fitted_on"] == "ours@auto"
    assert by["ours@1"]["contention_ms_per_mib"] == auto["contention_ms_per_mib"] >= 0
    assert auto["alignment"] == 1.0 and by["ours@1"]["alignment"] == 1.0
    assert all(r["loss_max_abs_diff"] < 1e-4 for r in rows)
    assert all(r["device"] == "cpu" and r["peak_mib"] is None for r in rows)
    assert len(auto["step_ms_rounds"]) == 2
    assert "| auto against |" in proc.stdout and "ours@auto plan:" in proc.stderr
