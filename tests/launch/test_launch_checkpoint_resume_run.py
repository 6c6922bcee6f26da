"""A damaged newest checkpoint under torchrun with 2 ranks on gloo (Note [Checkpoint integrity] in
``launch.checkpoint.integrity``): its identity.json deleted and a shard damaged, the resume
names it and why it is skipped in one line, takes the intact older one, and ends with exit 0
and the losses of an uninterrupted run."""

from __future__ import annotations

import shutil

import pytest

from _jobs import REFERENCE_RUN
from _torchrun import metrics as _metrics, ok as _ok

pytestmark = pytest.mark.slow


def test_a_newest_checkpoint_without_identity_and_with_a_damaged_shard_resumes_the_older_one(
        reference_run, tmp_path, torchrun):
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(reference_run / "checkpoints", ckpt)
    (ckpt / "step_000008" / "identity.json").unlink()
    shard = sorted((ckpt / "step_000008").glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    proc = torchrun(tmp_path, *REFERENCE_RUN, "train.resume=true", "hydra.run.dir=second", timeout=120)
    _ok(proc)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.count("skipping checkpoint") == 1, proc.stdout
    assert ("warning: skipping checkpoint checkpoints/step_000008: it has no identity.json (the run that wrote it): "
            "deleted or lost after writing; a damaged checkpoint is never loaded") in proc.stdout
    assert "resumed from checkpoints/step_000006 at step 6" in proc.stdout
    ref, got = dict(_metrics(reference_run / "run")["losses"]), _metrics(tmp_path / "second")
    assert got["start_step"] == 6 and [s for s, _ in got["losses"]] == [7, 8]
    for step, loss in got["losses"]:
        assert loss == pytest.approx(ref[step], rel=1e-6, abs=1e-7), f"loss differs at step {step}"
