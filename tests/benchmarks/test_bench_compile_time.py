"""benchmarks.studies.compile_time: the done-when ratios and the docs section it regenerates."""

import json

import pytest

from benchmarks.studies.compile_time import END, START, render, results_markdown, summarize


def _row(mode, phase, first, step, run=0):
    return {"mode": mode, "phase": phase, "run": run, "first_step_s": first, "step_ms_median": step,
            "process_wall_s": first + 5}


# ours has three warm restarts: the summary takes their median (3.0), not the last or the mean
ROWS = [_row("nosplit", "cold", 50.0, 300.0), _row("nosplit", "warm", 4.0, 300.0),
        _row("ours", "cold", 60.0, 280.0), _row("ours", "warm", 9.0, 280.0), _row("ours", "warm", 3.0, 280.0, 1),
        _row("ours", "warm", 2.0, 280.0, 2),
        _row("whole8", "cold", 100.0, 500.0), _row("whole8", "warm", 6.0, 500.0),
        _row("regional8", "cold", 25.0, 510.0), _row("regional8", "warm", 2.0, 510.0)]


def _step_row(mode, rounds, cold):
    """A ddp_compare row (baseline nosplit) as interleaved_steps returns it."""
    nosplit = [100.0, 110.0, 120.0, 130.0]
    ratios = sorted(a / b for a, b in zip(rounds, nosplit))
    return {"mode": mode, "step_ms_rounds": rounds, "step_ms_median": sorted(rounds)[1], "compile_cold_s": cold,
            "ratio_vs_builtin": (ratios[1] + ratios[2]) / 2, "ratio_q1": ratios[0], "ratio_q3": ratios[3],
            "rounds": 4, "command": "python -m benchmarks.studies.ddp_compare --modes nosplit,ours,regional"}


STEPS = [_step_row("nosplit", [100.0, 110.0, 120.0, 130.0], 60.0),
         _step_row("ours", [90.0, 99.0, 108.0, 117.0], 64.0),
         _step_row("regional", [102.0, 112.2, 122.4, 132.6], 15.0)]


def test_summary_ratios_follow_the_issue_targets():
    s = summarize(ROWS, STEPS)
    assert s["ours_warm_over_cold"] == pytest.approx(3.0 / 60.0)
    assert s["ours_warm_over_nosplit_warm"] == pytest.approx(3.0 / 4.0)
    assert s["whole8_cold_over_regional8_cold"] == pytest.approx(4.0)
    assert s["ours_cache_warm_over_cold"] is None  # mode not run
    # step ratios come from the interleaved job, never from the separate restarts (510 / 500 there)
    assert s["regional8_step_over_whole8_step"] == pytest.approx(1.02)
    assert s["regional8_step_over_ours8_step"] == pytest.approx(1.02 / 0.9)
    assert s["regional8_step_over_ours8_step_iqr"] == pytest.approx([1.02 / 0.9] * 2)
    assert s["whole8_cold_over_regional8_cold_one_process"] == pytest.approx(4.0)
    assert summarize(ROWS)["regional8_step_over_whole8_step"] is None  # no interleaved job: no step ratio


def test_render_replaces_only_the_compile_section(tmp_path):
    result = {"backend": "inductor", "nproc": 2, "steps": 8, "command": "python -m benchmarks.studies.compile_time",
              "rows": ROWS, "steps_interleaved": STEPS, "summary": summarize(ROWS, STEPS)}
    (tmp_path / "r.json").write_text(json.dumps(result))
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{START}\nold table\n{END}\nafter\n")
    render(tmp_path / "r.json", readme)
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n" + START) and text.endswith(END + "\nafter\n")
    assert "old table" not in text
    assert "| ours | 60.0 | 3.0 [2.0, 9.0] | 3 | 65.0 / 8.0 |" in text
    assert "| whole8 cold / regional8 cold (restarts) | 4.00 | >= 2 |" in text
    assert "| regional | 15.0 | 112.2 | 1.020 [1.020, 1.020] |" in text
    assert "| regional8 / whole8 (nosplit) step, interleaved [IQR] | 1.020 [1.020, 1.020] | < 1.05 |" in text
    assert "Command: `python -m benchmarks.studies.compile_time`" in text


def test_restarts_run_every_mode_cold_then_warm_in_rotating_order(monkeypatch, tmp_path):
    import benchmarks.studies.compile_time as ct

    calls = []
    monkeypatch.setattr(ct, "run_mode", lambda mode, out, phase, run=0, **kw: calls.append((mode, phase, run)) or
                        {"mode": mode, "phase": phase, "run": run})
    rows = ct.run_restarts(["a", "b", "c"], tmp_path, warm_runs=3, backend="aot_eager", nproc=1, steps=2)
    assert calls == [("a", "cold", 0), ("b", "cold", 0), ("c", "cold", 0),
                     ("a", "warm", 0), ("b", "warm", 0), ("c", "warm", 0),
                     ("b", "warm", 1), ("c", "warm", 1), ("a", "warm", 1),
                     ("c", "warm", 2), ("a", "warm", 2), ("b", "warm", 2)]
    assert len(rows) == 12


def test_only_quick_narrows_the_model(monkeypatch, tmp_path):
    # A real run measures the launcher's own model; --quick (a smoke run) narrows it.
    import benchmarks.studies.compile_time as ct

    calls = []
    monkeypatch.setattr(ct, "run_restarts", lambda modes, out, **kw: calls.append(kw) or [])
    json_path = str(tmp_path / "r.json")
    assert ct.main(["--modes", "ours", "--json", json_path, "data.seed=3"]) == 0
    assert ct.main(["--modes", "ours", "--json", json_path, "--quick"]) == 0
    real, quick = calls
    assert real["extra"] == ["data.seed=3"] and real["warm_runs"] == 3 and real["backend"] == "inductor"
    assert quick["extra"] == ct.QUICK_OVERRIDES and quick["warm_runs"] == 1 and quick["backend"] == "aot_eager"


def test_the_wider_step_job_gets_its_own_ratios_and_table(tmp_path):
    wide = [dict(r, model="GPT(layers=8, embd=256)") for r in STEPS]
    wide[2] = dict(_step_row("regional", [101.0, 111.1, 121.2, 131.3], 16.0), model="GPT(layers=8, embd=256)")
    s = summarize(ROWS, STEPS, wide)
    assert s["regional8_step_over_whole8_step"] == pytest.approx(1.02)
    assert s["regional8_step_over_whole8_step_wide"] == pytest.approx(1.01)
    assert s["regional8_step_over_ours8_step_wide"] == pytest.approx(1.01 / 0.9)
    assert summarize(ROWS, STEPS)["regional8_step_over_whole8_step_wide"] is None
    result = {"backend": "inductor", "nproc": 2, "steps": 8, "command": "c", "rows": ROWS, "steps_interleaved": STEPS,
              "steps_interleaved_wide": wide, "summary": s}
    text = results_markdown(result)
    assert "The same job on a wider model (`GPT(layers=8, embd=256)`)" in text
    assert "| regional | 16.0 | 111.1 | 1.010 [1.010, 1.010] |" in text
    assert "| regional8 / whole8 (nosplit) step, wider model [IQR] | 1.010 [1.010, 1.010] | < 1.05 |" in text
    assert "| regional8 / ours8 step, wider model [IQR] | 1.122 [1.122, 1.122] | < 1.05 |" in text


def test_update_re_measures_some_modes_keeps_the_others_and_says_so():
    from benchmarks.studies.compile_time import merge_update

    old = {"backend": "inductor", "nproc": 2, "steps": 8, "warm_runs": 3, "command": "python -m benchmarks.studies.compile_time",
           "rows": ROWS, "steps_interleaved": STEPS, "steps_interleaved_wide": []}
    fresh = [_row("ours", "cold", 70.0, 280.0), _row("ours", "warm", 7.0, 280.0)]
    new = dict(old, command="python -m benchmarks.studies.compile_time --modes ours --update", warm_runs=1, rows=fresh,
               steps_interleaved=[])
    merged = merge_update(old, new, ["ours"])
    assert [r for r in merged["rows"] if r["mode"] == "ours"] == fresh
    assert [r for r in merged["rows"] if r["mode"] != "ours"] == [r for r in ROWS if r["mode"] != "ours"]
    assert merged["steps_interleaved"] == STEPS  # not re-run: kept
    assert summarize(merged["rows"])["ours_warm_over_cold"] == pytest.approx(0.1)
    merged["summary"] = summarize(merged["rows"], merged["steps_interleaved"])
    assert ("Command: `python -m benchmarks.studies.compile_time`; rows of `ours` re-measured later by "
            "`python -m benchmarks.studies.compile_time --modes ours --update` (1 warm run(s))") in results_markdown(merged)
    with pytest.raises(SystemExit, match=r"measured with nproc=2 and this run with 4; rows of both would not compare"):
        merge_update(old, dict(new, nproc=4), ["ours"])
