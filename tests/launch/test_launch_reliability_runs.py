"""The main job under torchrun with 2 ranks on gloo, stopped on purpose: SIGTERM to
the torchrun agent (what a scheduler sends), to one rank, SIGINT to the whole
process group (Ctrl-C); and an error on rank 0 alone, which must end the job
promptly every time (Note [Exit on error] in ``launch.runtime.dist``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _jobs import REFERENCE, REFERENCE_STEPS
from _torchrun import FAULT_JOB, metrics as _metrics, ok as _ok
from launch.runtime.preempt import EXIT_PREEMPTED

pytestmark = pytest.mark.slow

SMALL = [*REFERENCE, "train.timeout_s=60"]  # the shared reference run's job
STEPS, STOP_AT = REFERENCE_STEPS, 3
STOPPED = f"preempted: stopped after step {STOP_AT} on SIGTERM/SIGINT (preemption): saved checkpoints/step_000003"


class _Job:
    """torchrun in its own session, its stdout read line by line (to signal it at a
    known step), its stderr into a file."""

    def __init__(self, cwd: Path, *overrides: str, fault: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(FAULT_JOB), fault, *SMALL, *overrides]
        self.err_path = cwd / f"stderr_{time.monotonic_ns()}.txt"
        self._err = open(self.err_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def wait_for(self, needle: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not any(needle in line for line in list(self.lines)):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                pytest.fail(f"{needle!r} not printed\nstdout:\n{self.stdout[-4000:]}\nstderr:\n{self.stderr[-4000:]}")
            time.sleep(0.1)

    def finish(self, timeout: float = 60) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {timeout}s of the signal\nstdout:\n{self.stdout[-4000:]}\n"
                        f"stderr:\n{self.stderr[-4000:]}")
        self._reader.join(10)
        self._err.close()
        return code

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)

    @property
    def stdout(self) -> str:
        return "".join(self.lines)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()


def _published(cwd: Path) -> list[str]:
    return sorted(p.name for p in (cwd / "checkpoints").iterdir() if p.name.startswith("step_"))


def _before_torchruns_table(stderr: str) -> str:
    """What the ranks and the agent printed before torchrun's failure table, which repeats each failed
    rank's last lines from its error file (Note [A failed rank's last line] in launch.runtime.worker_error)."""
    return re.split(r"^=+\n.* FAILED\n-+\n", stderr, maxsplit=1, flags=re.M)[0]


def _assert_stopped_and_saved(job: _Job, cwd: Path) -> None:
    out = job.stdout + _before_torchruns_table(job.stderr)
    assert out.count(STOPPED) == 1, f"stdout:\n{job.stdout[-4000:]}\nstderr:\n{job.stderr[-4000:]}"
    assert f"step     {STOP_AT + 1}/" not in job.stdout, "a rank went on past the step the job stopped at"
    # No worker's traceback (the agent, when signalled, prints its own SignalException's).
    assert "Traceback" not in job.stdout and not any(f'{name}", line' in job.stderr
                                                     for name in ("launch/train.py", "tests/_fault_job.py"))
    assert _published(cwd) == [f"step_{STOP_AT:06d}"]


def test_sigterm_to_the_agent_saves_and_the_resumed_run_is_bit_equal(tmp_path, torchrun, reference_run):
    common = [f"train.steps={STEPS}", "train.checkpoint_every=100"]
    job = _Job(tmp_path, *common, "hydra.run.dir=first", fault=f"{STOP_AT}:0:PAUSE")
    job.wait_for(f"paused at step {STOP_AT}")
    t0 = time.monotonic()
    os.kill(job.proc.pid, signal.SIGTERM)  # the agent only, as a scheduler does
    code = job.finish()
    print(f"agent exit code {code}, {time.monotonic() - t0:.1f}s after SIGTERM")
    assert code == 1  # torchrun's own code when it was signalled (an uncaught SignalException)
    _assert_stopped_and_saved(job, tmp_path)
    assert "SignalException: Process" in job.stderr and "got signal: 15" in job.stderr  # the agent

    resumed = torchrun(tmp_path, *SMALL, *common, "train.resume=true", "hydra.run.dir=second", timeout=120)
    _ok(resumed)
    got, want = _metrics(tmp_path / "second"), _metrics(reference_run / "run")
    assert got["start_step"] == STOP_AT
    assert got["losses"] == want["losses"][STOP_AT:]  # exactly equal, not within a tolerance


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, torchrun):
    proc = torchrun(tmp_path, *SMALL, f"train.steps={STEPS}", "train.checkpoint_every=100", "hydra.run.dir=run",
                    fault=f"{STOP_AT}:1:TERM", timeout=120)
    assert proc.returncode == 1, proc.stderr  # the agent: a worker failed (with max-restarts 0)
    assert proc.stderr.count(f"exitcode  : {EXIT_PREEMPTED}") >= 1  # torchrun's failure table
    job = type("Done", (), {"stdout": proc.stdout, "stderr": proc.stderr})
    _assert_stopped_and_saved(job, tmp_path)


def test_sigint_to_the_process_group_saves(tmp_path):
    job = _Job(tmp_path, f"train.steps={STEPS}", "train.checkpoint_every=100", "hydra.run.dir=run",
               fault=f"{STOP_AT}:0:PAUSE")
    job.wait_for(f"paused at step {STOP_AT}")
    os.killpg(job.proc.pid, signal.SIGINT)  # Ctrl-C: the agent and every worker, and the agent forwards it again
    assert job.finish() == 1
    _assert_stopped_and_saved(job, tmp_path)


def test_an_error_on_rank_0_ends_the_job_promptly_every_time(tmp_path, torchrun):
    # Rank 0 raises at the start of step 3 (after the step-2 checkpoint) while rank 1 goes on into
    # step 3's collectives: the exception path used to hang in ~Reducer -> ~ProcessGroupGloo about one
    # try in four; an unwritable checkpoint_dir is refused before the group starts, so the error is
    # injected by a step callback instead).
    for attempt in range(3):
        t0 = time.monotonic()
        proc = torchrun(tmp_path, *SMALL, "train.steps=4", "train.checkpoint_every=2",
                        f"train.checkpoint_dir=ckpt{attempt}", f"hydra.run.dir=try{attempt}", fault="3:0:RAISE",
                        timeout=50)
        took = time.monotonic() - t0
        print(f"try {attempt}: exit {proc.returncode} in {took:.1f}s")
        assert proc.returncode == 1, proc.stderr
        line = "RuntimeError: fault 3:0:RAISE: injected error on rank 0 at step 3"
        assert _before_torchruns_table(proc.stderr).count(line) == 1, proc.stderr[-4000:]  # said once by the rank
        assert "traceback : Traceback" in proc.stderr and proc.stderr.count(line) == 2  # and in torchrun's table
        assert "step     2/4" in proc.stdout and "step     3/4" not in proc.stdout
