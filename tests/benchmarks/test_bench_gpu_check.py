"""benchmarks.studies.gpu_check on this CPU machine: the refusal without CUDA, the JUnit reader,
the merge of a check run in several calls, and the docs section rendered from it."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks.studies import gpu_check

REPO = Path(__file__).resolve().parents[2]

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_gpu_ddp" name="test_a" time="1.5"/>
<testcase classname="tests.test_gpu_ddp" name="test_b" time="2.0">
  <failure message="AssertionError: 1 bucket&#10;second line">trace</failure></testcase>
<testcase classname="tests.test_gpu_train" name="test_c[fused]" time="0.1">
  <skipped message="no CUDA"/></testcase>
</testsuite></testsuites>
"""


def _check_json(path: Path, env: dict, **steps) -> Path:
    path.write_text(json.dumps({"command": f"python -m benchmarks.studies.gpu_check ({path.stem})",
                                "started": "2026-11-22 18:00:00 UTC", "env": env, **steps}))
    return path


ENV = {"gpu": "NVIDIA H200", "capability": "sm_90", "gpu_mib": 143155, "torch": "2.11.0+cu130", "cuda": "13.0",
       "triton": "3.6.0", "python": "3.12.3"}
TESTS = {"status": "ok", "seconds": 3.6, "command": "pytest -m gpu", "counts": {"passed": 1, "failed": 0, "error": 0,
                                                                             "skipped": 0},
         "cases": [{"test": "test_gpu_ddp::test_a", "outcome": "passed", "seconds": 1.5, "message": None}]}
DDP = {"status": "ok", "seconds": 60.0, "command": "python -m benchmarks.studies.ddp_compare --device cuda", "rows": [
    {"mode": "builtin", "step_ms_median": 12.8, "ratio_vs_builtin": 1.0, "peak_mib": 1514.0, "compile_cold_s": 16.9,
     "compile_warm_s": 2.9, "partitions": 3, "loss_max_abs_diff": 9.5e-7},
    {"mode": "ours", "step_ms_median": 12.79, "ratio_vs_builtin": 1.001, "peak_mib": 1514.0, "compile_cold_s": 7.4,
     "compile_warm_s": 0.5, "partitions": 2, "loss_max_abs_diff": 9.5e-7}]}


def test_read_junit_gives_one_row_per_case_with_outcome_and_first_message_line(tmp_path):
    (tmp_path / "r.xml").write_text(JUNIT)
    rows = gpu_check.read_junit(tmp_path / "r.xml")
    assert [(r["test"], r["outcome"], r["seconds"]) for r in rows] == [
        ("test_gpu_ddp::test_a", "passed", 1.5), ("test_gpu_ddp::test_b", "failed", 2.0),
        ("test_gpu_train::test_c[fused]", "skipped", 0.1)]
    assert [r["message"] for r in rows] == [None, "AssertionError: 1 bucket", "no CUDA"]


def test_merge_keeps_each_steps_own_check_command_and_renders_it(tmp_path):
    a = _check_json(tmp_path / "bench.json", ENV, ddp=DDP)
    b = _check_json(tmp_path / "tests.json", ENV, tests=TESTS)
    merged = gpu_check.merge([a, b])
    assert merged["env"] == ENV and set(merged) == {"env", "ddp", "tests"}
    assert merged["ddp"]["check"]["command"].endswith("(bench)")
    assert merged["tests"]["check"]["command"].endswith("(tests)")
    text = gpu_check.results_markdown(merged)
    assert "NVIDIA H200 (sm_90, 143155 MiB), torch 2.11.0+cu130" in text
    assert "(bench)`, 2026-11-22 18:00:00 UTC): ok in 60 s" in text
    assert "| ours | 12.79 | 1.001 | 1514 | 7.4 | 0.5 | 2 | 9.5e-07 |" in text
    assert "1 passed, 0 failed, 0 skipped" in text and "| test_gpu_ddp::test_a | passed | 1.5 |  |" in text


def test_merge_refuses_runs_of_different_environments(tmp_path):
    a = _check_json(tmp_path / "a.json", ENV, ddp=DDP)
    b = _check_json(tmp_path / "b.json", {**ENV, "torch": "2.13.0+cu130"}, tests=TESTS)
    with pytest.raises(ValueError, match=r"b.json was run in another environment .* Merge only the runs of one"):
        gpu_check.merge([a, b])


def test_render_fills_only_the_gpu_section(tmp_path):
    json_path = _check_json(tmp_path / "c.json", ENV, ddp=DDP)
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{gpu_check.START}\nSTALE-TABLE\n{gpu_check.END}\nafter\n")
    assert gpu_check.main(["--render", str(json_path), str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "STALE-TABLE" not in text
    assert "| builtin | 12.80 | 1.000 | 1514 | 16.9 | 2.9 | 3 | 9.5e-07 |" in text


def test_the_docs_gpu_section_is_rendered_from_the_committed_json(tmp_path):
    page = tmp_path / "gpu.md"
    page.write_text((REPO / "docs" / "gpu.md").read_text())
    gpu_check.render(REPO / "benchmarks/results/gpu_check.json", page)
    assert page.read_text() == (REPO / "docs" / "gpu.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_check_says_what_why_and_how_and_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU machine, and on a GPU one too
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--json", str(tmp_path / "x.json"), "--work", str(tmp_path / "w")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU is visible" in err and "Run it on one" in err
    assert not (tmp_path / "x.json").exists()


def test_unknown_steps_are_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--steps", "env,bench"])
    assert e.value.code == 2
    assert "unknown step(s) ['bench']: the check has the steps env, tests, ddp, fsdp" in capsys.readouterr().err
