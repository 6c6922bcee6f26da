"""The main job when a rank dies or stops in the middle of the first compile (compile.share
on, the default), with ranks started by hand as on two machines (no agent to stop the
survivor): the survivor ends within train.timeout_s plus a margin with one line, not after
share_timeout_s (two hours), and SIGTERM ends its wait within its 10 s grace (Note [Peer liveness])."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import _dist

REPO = Path(__file__).resolve().parents[2]
FAULT_JOB = REPO / "tests" / "_fault_job.py"
TIMEOUT_S = 10  # train.timeout_s: the process group's timeout, and the silence after which a peer is dead

pytestmark = pytest.mark.slow


def _ranks(tmp_path: Path, action: str, timeout_s: int = TIMEOUT_S) -> list[subprocess.Popen]:
    port = _dist.free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen(
            [sys.executable, str(FAULT_JOB), f"compile:1:{action}", "compile.backend=fault_aot_eager",
             "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "train.batch_size=2", "train.seq_len=16",
             "train.steps=3", "ddp.bucket_cap_mb=0.01", f"train.timeout_s={timeout_s}",
             f"hydra.run.dir={tmp_path / 'run'}", f"train.checkpoint_dir={tmp_path / 'ckpt'}"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True))
    return procs


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _wait_for_fault(rank1: subprocess.Popen, action: str) -> None:
    """Until rank 1 reports its fault (it is then dead or stopped in its first compile)."""
    line = ""
    deadline = time.monotonic() + 240
    while f"SIG{action} in the first compile" not in line and time.monotonic() < deadline:
        line = rank1.stderr.readline() or line
        if rank1.poll() is not None and not line:
            break
    assert f"SIG{action} in the first compile" in line, "rank 1 never reached its first compile"


@pytest.mark.alone  # the peer's silence and the process group's timeout are both 10 s: the line says which came first
@pytest.mark.parametrize("action", ["KILL", "STOP"])
def test_the_survivor_of_a_rank_killed_or_stopped_in_the_first_compile_ends_with_one_line(tmp_path, action):
    procs = _ranks(tmp_path, action)
    try:
        _wait_for_fault(procs[1], action)
        t0 = time.monotonic()
        out, err = procs[0].communicate(timeout=TIMEOUT_S + 120)  # the old behaviour: 7200 s
        waited = time.monotonic() - t0
    finally:
        _end(procs)
    assert procs[0].returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "but rank 1 has been silent for" in lines[0], err[-3000:]
    assert "it died or was stopped" in lines[0] and f"process group's timeout ({TIMEOUT_S}s" in lines[0]
    print(f"rank 0 ended {waited:.1f}s after rank 1's SIG{action} (train.timeout_s={TIMEOUT_S})")


def test_sigterm_ends_the_wait_for_a_stopped_peer_after_its_grace(tmp_path):
    procs = _ranks(tmp_path, "STOP", timeout_s=300)  # liveness alone would wait 300 s
    try:
        _wait_for_fault(procs[1], "STOP")
        time.sleep(2)  # rank 0 is now waiting for rank 1's compile
        os.kill(procs[0].pid, signal.SIGTERM)
        t0 = time.monotonic()
        out, err = procs[0].communicate(timeout=60)
        print(f"rank 0 ended {time.monotonic() - t0:.1f}s after SIGTERM")
    finally:
        _end(procs)
    assert procs[0].returncode == 75, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("preempted: ")]
    assert len(lines) == 1 and "stopped waiting for" in lines[0] and "SIGTERM (preemption)" in lines[0], err[-3000:]


def test_sigterm_during_a_first_compile_longer_than_torchruns_grace_is_said(tmp_path):
    # torchrun SIGKILLs its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s; 3 here) after forwarding a
    # SIGTERM: a compile still running then ends without a checkpoint, and rank 0 says so when the signal comes.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(FAULT_JOB),
           "compile:0:SLEEP", "compile.backend=fault_aot_eager", "model.n_layer=2", "model.n_embd=32",
           "model.n_head=2", "train.batch_size=2", "train.seq_len=16", "train.steps=3", "hydra.run.dir=run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"}
    agent = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        _wait_for_line(agent, "a 120 s compile")
        os.kill(agent.pid, signal.SIGTERM)  # what a scheduler sends
        _, err = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    assert err.count("rank 0: SIGTERM received: the run stops after the current step") == 1, err[-3000:]
    assert "a step or a compile still running then ends without one" in err


def _wait_for_line(proc: subprocess.Popen, needle: str) -> None:
    line, deadline = "", time.monotonic() + 120
    while needle not in line and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stderr.readline()
    assert needle in line, f"{needle!r} never printed"
