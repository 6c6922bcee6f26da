"""benchmarks.compile_time: the done-when ratios and the README section it regenerates."""

import json

import pytest

from benchmarks.compile_time import END, START, render, results_markdown, summarize


def _row(mode, phase, first, step):
    return {"mode": mode, "phase": phase, "first_step_s": first, "step_ms_median": step, "process_wall_s": first + 5}


ROWS = [_row("nosplit", "cold", 50.0, 300.0), _row("nosplit", "warm", 4.0, 300.0),
        _row("ours", "cold", 60.0, 280.0), _row("ours", "warm", 3.0, 280.0),
        _row("whole8", "cold", 100.0, 500.0), _row("whole8", "warm", 6.0, 500.0),
        _row("regional8", "cold", 25.0, 510.0), _row("regional8", "warm", 2.0, 510.0)]


def test_summary_ratios_follow_the_issue_targets():
    s = summarize(ROWS)
    assert s["ours_warm_over_cold"] == pytest.approx(3.0 / 60.0)
    assert s["ours_warm_over_nosplit_warm"] == pytest.approx(3.0 / 4.0)
    assert s["whole8_cold_over_regional8_cold"] == pytest.approx(4.0)
    assert s["regional8_step_over_whole8_step"] == pytest.approx(510.0 / 500.0)
    assert s["ours_cache_warm_over_cold"] is None  # mode not run


def test_render_replaces_only_the_compile_section(tmp_path):
    result = {"backend": "inductor", "nproc": 2, "steps": 8, "command": "python -m benchmarks.compile_time",
              "rows": ROWS, "summary": summarize(ROWS)}
    (tmp_path / "r.json").write_text(json.dumps(result))
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{START}\nold table\n{END}\nafter\n")
    render(tmp_path / "r.json", readme)
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n" + START) and text.endswith(END + "\nafter\n")
    assert "old table" not in text
    assert "| ours | warm | 3.0 | 280.0 | 8.0 |" in text
    assert "| whole8 cold / regional8 cold | 4.00 | >= 2 |" in text
    assert "Command: `python -m benchmarks.compile_time`" in text
