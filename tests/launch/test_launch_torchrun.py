"""The main job under torchrun with 2 ranks on gloo: the end-to-end run exits on
its own, a run killed mid-way and resumed matches an uninterrupted one, and under
``--max-restarts 1`` a killed rank restarts the job, which resumes by itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _jobs import REFERENCE_RUN, REFERENCE_STEPS
from _torchrun import final_params as _final_params, metrics as _metrics, ok as _ok

pytestmark = pytest.mark.slow

STEPS, KILL_AT = REFERENCE_STEPS, 8  # checkpoints after steps 2, 4, 6, 8; a rank dies at the start of step 8


def _assert_same_training(ref: dict, got: dict, ref_ckpt: Path, got_ckpt: Path, from_step: int) -> None:
    ref_losses = {s: loss for s, loss in ref["losses"]}
    for step, loss in got["losses"]:
        torch.testing.assert_close(loss, ref_losses[step], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, step=step: f"loss differs at step {step}: {m}")
    assert [s for s, _ in got["losses"]] == list(range(from_step + 1, STEPS + 1))
    ref_p, got_p = _final_params(ref_ckpt), _final_params(got_ckpt)
    assert ref_p.keys() == got_p.keys()
    for name in ref_p:
        torch.testing.assert_close(got_p[name], ref_p[name], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, name=name: f"final parameter {name} differs: {m}")


def test_two_ranks_end_to_end_prints_table_and_steps_and_exits(tmp_path, torchrun):
    # The documented two-rank command, verbatim.
    proc = torchrun(tmp_path, "compile.backend=aot_eager", "train.steps=5", "ddp.bucket_cap_mb=1",
                    "hydra.run.dir=run", timeout=240)
    _ok(proc)
    out = proc.stdout
    assert "distcompile main job: 2 rank(s), cpu + gloo" in out
    assert "DDP buckets = graph partitions" in out and "first .. last parameter" in out
    assert "partition 1/" in out and "elapsed" in out  # compile progress, rank 0 only
    assert out.count("partition 1/") == 1
    for step in range(1, 6):
        assert f"step     {step}/5  loss" in out and "tokens/s" in out
    assert "done: steps 1..5" in out
    # Note [In control, once]: rank 0 alone says it, once
    assert out.count("ddp_opt in control (launch.train): strategy=split, backend=aot_eager; ") == 1, out
    metrics = _metrics(tmp_path / "run")
    assert metrics["world_size"] == 2 and len(metrics["losses"]) == 5 and len(metrics["buckets"]) > 1
    assert not any(p.name != "run" for p in tmp_path.iterdir() if p.is_dir())  # rank 1 wrote no run dir


def test_killed_run_resumes_to_the_same_losses_and_parameters(reference_run, tmp_path, torchrun):
    reference = reference_run
    died = torchrun(tmp_path, *REFERENCE_RUN, "hydra.run.dir=first", fault=f"{KILL_AT}:1")
    assert died.returncode != 0, "the injected fault did not kill the job"
    assert not (tmp_path / "checkpoints" / f"step_{STEPS:06d}").exists()
    _ok(torchrun(tmp_path, *REFERENCE_RUN, "train.resume=true", "hydra.run.dir=second"))
    resumed = _metrics(tmp_path / "second")
    assert resumed["start_step"] == 6
    _assert_same_training(_metrics(reference / "run"), resumed, reference / "checkpoints" / f"step_{STEPS:06d}",
                          tmp_path / "checkpoints" / f"step_{STEPS:06d}", from_step=6)


def test_rank_killed_under_max_restarts_resumes_by_itself(reference_run, tmp_path, torchrun):
    reference = reference_run
    proc = torchrun(tmp_path, *REFERENCE_RUN, "hydra.run.dir=run", fault=f"{KILL_AT}:0", restarts=1, timeout=400)
    _ok(proc)
    assert "killing myself at step 8" in proc.stderr
    assert "resumed from checkpoints/step_000006 at step 6" in proc.stdout
    _assert_same_training(_metrics(reference / "run"), _metrics(tmp_path / "run"),
                          reference / "checkpoints" / f"step_{STEPS:06d}",
                          tmp_path / "checkpoints" / f"step_{STEPS:06d}", from_step=6)
