"""The doctor entry point: the launcher's diagnose=true, and python -m launch.doctor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launch.config.schema import CompileConfig, ConfigError, DDPConfig, JobConfig, ParallelConfig
from launch.doctor import DEFAULT_STEPS, doctor_argv
from launch.train import run
from _jobs import tiny_job


def _job(tmp_path, **kw) -> JobConfig:
    return tiny_job(tmp_path, **kw)


def test_doctor_argv_sets_diagnose_a_short_run_and_the_json_path():
    assert doctor_argv(["compile=aot_eager", "--json", "d.json"]) == [
        "compile=aot_eager", "diagnose_json=d.json", f"train.steps={DEFAULT_STEPS}", "diagnose=true"]
    assert doctor_argv(["train.steps=2", "--json=x.json"]) == ["train.steps=2", "diagnose_json=x.json", "diagnose=true"]


def test_diagnose_reports_ddp_partitions_as_intended_and_writes_json(tmp_path, capsys, one_thread, clean_dynamo):
    cfg = _job(tmp_path, compile=CompileConfig(backend="aot_eager"), ddp=DDPConfig(bucket_cap_mb=0.1), diagnose=True)
    metrics = run(cfg, output_dir=str(tmp_path))
    out = capsys.readouterr().out
    assert "== compile diagnosis (rank 0) ==" in out
    assert "partitions (intended splits at DDP bucket boundaries)" in out and "graph breaks (accidental)" not in out
    saved = json.loads((tmp_path / "diagnosis.json").read_text())
    assert saved == metrics["diagnosis"]
    assert len(saved["graphs"]) == 1 and saved["breaks"] == [] and saved["recompiles"] == []
    assert saved["exposed_comm_ms"] >= 0.0 and saved["compute_ms"] > 0.0  # measured, values not asserted
    # Repeated: the median and the spread of the rounds (PROBE_ROUNDS of each), said beside it.
    low, high = saved["compute_range_ms"]
    assert low <= saved["compute_ms"] <= high
    assert "communication left exposed:" in out and f"median of rounds from {low:.1f} to {high:.1f} ms" in out
    assert len(saved["partitions"]) == len(metrics["buckets"]) > 1
    assert any("fullgraph=True" in a for a in saved["advice"])


def test_diagnose_reports_poor_alignment_with_a_bucket_cap_suggestion(tmp_path, capsys, one_thread, clean_dynamo):
    # Without realignment DDP's rebuilt buckets straddle partitions.
    cfg = _job(tmp_path, compile=CompileConfig(backend="aot_eager"), ddp=DDPConfig(bucket_cap_mb=0.1, align_buckets=False),
               diagnose=True, train=dict(steps=4, checkpoint_dir=str(tmp_path / "c")))
    metrics = run(cfg, output_dir=str(tmp_path))
    d = metrics["diagnosis"]
    assert d["alignment"] == metrics["alignment"] < 1.0
    assert any("bucket_cap_mb_list=[" in a for a in d["advice"])
    assert "alignment of DDP's runtime buckets with the partitions" in capsys.readouterr().out


@pytest.mark.parametrize("kw, match", [
    (dict(compile=CompileConfig(backend="eager")), r"diagnose=true with compile.backend=eager: there is no compile"),
    (dict(parallel=ParallelConfig(name="fsdp")), r"diagnose=true is not supported with parallel=fsdp yet"),
])
def test_diagnose_refuses_what_it_cannot_see(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        run(_job(tmp_path, diagnose=True, **kw))


@pytest.mark.slow
def test_python_m_launch_doctor_runs_and_writes_the_report(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "launch.doctor", "compile=aot_eager", "model.n_layer=2", "train.steps=3",
         "--json", str(tmp_path / "d.json"), f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== compile diagnosis (rank 0) ==" in proc.stdout and "advice:" in proc.stdout
    assert json.loads((tmp_path / "d.json").read_text())["graphs"]


@pytest.mark.slow  # busy neighbour processes, and half a minute for the load average to rise
def test_a_busy_neighbour_is_named_beside_the_doctors_figures(tmp_path, capsys, one_thread, clean_dynamo, busy_machine):
    cfg = _job(tmp_path, compile=CompileConfig(backend="aot_eager"), ddp=DDPConfig(bucket_cap_mb=0.1), diagnose=True)
    metrics = run(cfg, output_dir=str(tmp_path))
    (note,) = metrics["diagnosis"]["timing_notes"]
    assert note.startswith(f"the machine is oversubscribed (load average ") and "measure when the other work" in note
    out = capsys.readouterr().out
    assert f"note: {note}" in out
