"""Running the main job under torchrun from a test: 2 ranks, an optional fault
(``tests/_fault_job.py``), a hard timeout that kills the workers too, and readers
for what the job wrote."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

FAULT_JOB = Path(__file__).resolve().parent / "_fault_job.py"


def torchrun(cwd: Path, *overrides: str, fault: str | None = None, restarts: int = 0, timeout: float = 300,
             nproc: int = 2):
    """``torchrun --standalone --nproc-per-node NPROC -m launch.train overrides`` in ``cwd``; with
    ``fault="STEP[:RANK]"``, ``tests/_fault_job.py`` instead, which kills that rank at that step."""
    job = [str(FAULT_JOB), fault] if fault else ["-m", "launch.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", str(restarts), *job, *overrides]
    # Own session, so that a timeout kills the workers too, not only torchrun.
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        # A hung exit lands here: the job must end by itself.
        pytest.fail(f"torchrun did not end within {timeout}s\nstdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class CliResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def cli_in_process(capfd, argv: list[str]) -> CliResult:
    """``python -m launch.train ARGV`` run in this process (``launch.config.shell.run_cli``
    with ``launch.train.run``), its output captured at the file descriptors; the logging
    handlers Hydra installs are removed afterwards so that no later test writes to this
    test's capture."""
    from launch.config.shell import run_cli
    from launch.train import run

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    capfd.readouterr()
    try:
        code = run_cli(argv, run)
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        root.setLevel(level)
    out, err = capfd.readouterr()
    return CliResult(code, out, err)


def ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def final_params(ckpt: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters of a DCP checkpoint, as one state dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)["model"]
