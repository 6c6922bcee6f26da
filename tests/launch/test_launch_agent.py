"""Workers die with their torchrun agent (Note [Workers die with their agent]): SIGKILL to the
agent alone (not its workers) leaves no worker running 10 s later; before, they trained on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _torchrun import FAULT_JOB

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_killing_the_agent_ends_every_worker_within_10_s(tmp_path: Path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(FAULT_JOB),
           "3:0:PAUSE", "compile.backend=aot_eager", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
           "train.batch_size=4", "train.seq_len=32", "train.steps=20", "train.checkpoint_every=1",
           "hydra.run.dir=run"]
    agent = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             start_new_session=True)
    workers: list[int] = []
    try:
        line, deadline = "", time.monotonic() + 120
        while "paused at step 3" not in line and time.monotonic() < deadline and agent.poll() is None:
            line = agent.stdout.readline()
        assert "paused at step 3" in line, "the job never reached step 3"
        workers = _children(agent.pid)
        assert len(workers) == 2, workers
        os.kill(agent.pid, signal.SIGKILL)  # the agent alone: its workers are in process groups of their own
        agent.wait()
        t0 = time.monotonic()
        while any(_alive(w) for w in workers) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        left = [w for w in workers if _alive(w)]
        print(f"workers ended {time.monotonic() - t0:.2f}s after the agent's SIGKILL")
        assert left == [], f"workers {left} outlived their agent by 10 s"
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert steps[-1] <= "step_000002", steps  # nothing saved after the agent died at step 3
