"""Checkpoints under torchrun with 2 ranks on gloo (Note [Resume policy] in
``launch.checkpoint.resume``): a restart never adopts another run's checkpoint, a corrupt newest
checkpoint falls back to the intact earlier one and the resumed losses equal an
uninterrupted run's, and a resume with another model shape (and world size) is one
message, exit 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _jobs import REFERENCE, REFERENCE_RUN, REFERENCE_STEPS
from _torchrun import metrics as _metrics, ok as _ok
from launch.config.schema import CompileConfig, JobConfig, ModelConfig, TrainConfig
from launch.train import run

pytestmark = pytest.mark.slow



def _copy(reference: Path, tmp_path: Path) -> Path:
    shutil.copytree(reference / "checkpoints", tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


def test_corrupt_newest_checkpoint_falls_back_to_the_intact_one_with_same_losses(reference_run, tmp_path, torchrun):
    reference = reference_run
    ckpt = _copy(reference, tmp_path)
    for later in ("step_000006", "step_000008"):  # as if killed at step 5
        shutil.rmtree(ckpt / later)
    shard = sorted((ckpt / "step_000004").glob("*.distcp"))[-1]
    raw = bytearray(shard.read_bytes())
    raw[200:216] = bytes(b ^ 0xFF for b in raw[200:216])  # 16 flipped bytes
    shard.write_bytes(bytes(raw))
    proc = torchrun(tmp_path, *REFERENCE_RUN, "train.resume=true", "hydra.run.dir=second", timeout=120)
    _ok(proc)
    assert (f"warning: checkpoint checkpoints/step_000004 is corrupt ({shard.name} does not match its crc32 in "
            "the manifest (the bytes changed after writing)): falling back to an earlier one") in proc.stdout
    assert "resumed from checkpoints/step_000002 at step 2" in proc.stdout
    ref, got = _metrics(reference / "run"), _metrics(tmp_path / "second")
    assert got["start_step"] == 2 and [s for s, _ in got["losses"]] == list(range(3, REFERENCE_STEPS + 1))
    ref_losses = dict(ref["losses"])
    for step, loss in got["losses"]:
        assert loss == pytest.approx(ref_losses[step], rel=1e-6, abs=1e-7), f"loss differs at step {step}"


def test_resume_with_another_model_shape_is_one_message(reference_run, tmp_path):
    # One process (torchrun turns a worker's exit code 2 into its own 1): the refusal comes
    # before any process group, from the checkpoint's identity.json.
    _copy(reference_run, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "launch.train", *[o for o in REFERENCE_RUN if not o.startswith("model.n_layer")],
         "model.n_layer=1", "train.resume=true", "hydra.run.dir=second"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert ("error: train.resume=true but the latest checkpoint checkpoints/step_000008 was written by a run with "
            "another config: model.n_layer 2 in the checkpoint, 1 now. Resuming it would continue another "
            "training trajectory.") in proc.stderr  # the world size (2, now 1) may change under parallel=ddp


def test_torchrun_restart_does_not_adopt_another_runs_checkpoint(tmp_path, torchrun):
    # Another config's checkpoint at step 4 in ./checkpoints, written by one rank in this process.
    other = JobConfig(model=ModelConfig(n_layer=2, n_embd=64, n_head=2), compile=CompileConfig(backend="eager"),
                      train=TrainConfig(steps=4, batch_size=4, seq_len=32, seed=7, checkpoint_every=4,
                                        checkpoint_dir=str(tmp_path / "checkpoints")))
    run(other)
    assert (tmp_path / "checkpoints" / "step_000004" / "manifest.json").is_file()
    # This run writes no checkpoints; rank 0 is killed at the start of step 3, and torchrun restarts it.
    proc = torchrun(tmp_path, *REFERENCE, "train.steps=5", "hydra.run.dir=run", fault="3", restarts=1, timeout=120)
    _ok(proc)
    assert "fault 3: killing myself at step 3" in proc.stderr
    assert ("warning: torchrun restart: ignoring 1 checkpoint(s) in checkpoints written by another run or torchrun "
            "invocation (latest: checkpoints/step_000004)") in proc.stdout
    assert "resumed from" not in proc.stdout
    got = _metrics(tmp_path / "run")
    assert got["start_step"] == 0 and [s for s, _ in got["losses"]] == [1, 2, 3, 4, 5]
