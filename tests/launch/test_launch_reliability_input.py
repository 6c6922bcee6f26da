"""Bad input under torchrun with 2 ranks on gloo: a config error is printed once, by
local rank 0, with exit code 2 and no retry; ranks started with different configs
stop at the start with the keys that differ instead of hanging or training apart."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow

TINY = ["compile.backend=aot_eager", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
        "train.batch_size=2", "train.seq_len=16"]


def _our_lines(stderr: str) -> list[str]:
    """The lines the job printed (torchrun's failure table indents its own copy)."""
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_config_error_is_printed_once_with_exit_2_and_not_retried(tmp_path, torchrun):
    proc = torchrun(tmp_path, *TINY, "train.steps=0", restarts=1, timeout=60)
    assert proc.returncode == 1  # torchrun's own code for any failed worker
    assert _our_lines(proc.stderr) == [
        "error: train.steps=0 is not valid: it must be a positive integer; it is the number of optimizer steps "
        "to run. Set e.g. train.steps=20."], proc.stderr
    # Two attempts (torchrun restarts the group whatever the exit code); each ends with code 2,
    # and the restarted one printed nothing.
    assert len(re.findall(r"failed \(exitcode: 2\)", proc.stderr)) == 2, proc.stderr
    root = proc.stderr.split("Root Cause (first observed failure):")[1]
    assert "exitcode  : 2" in root and "traceback : error: train.steps=0 is not valid" in root, root
    assert not re.search(r'File ".*/launch/', proc.stderr), "a worker printed a traceback"


def test_ranks_with_different_steps_and_lr_stop_at_start_with_the_keys(tmp_path, torchrun):
    # Each rank reads its own RANK into train.steps and train.lr: 40 vs 41 steps, lr 1e-4 vs 1.1e-3.
    proc = torchrun(tmp_path, *TINY, 'train.steps="4${oc.env:RANK}"', 'train.lr="0.00${oc.env:RANK}1"',
                    timeout=60)
    assert proc.returncode == 1
    lines = _our_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: the ranks were started with different configs: train.lr: 0.0001 on rank 0, "
                               "0.0011 on rank 1; train.steps: 40 on rank 0, 41 on rank 1. Every rank must run "
                               "the same config"), lines[0]
    assert "step     1/" not in proc.stdout  # stopped before training
