"""The main job with a fault installed, for the restart and resume tests:

    torchrun ... tests/_fault_job.py STEP[:RANK[:ACTION]] [overrides]

At the start of STEP, on the first attempt only (TORCHELASTIC_RESTART_COUNT unset
or 0), through the loop's step callbacks, RANK (default 0) does ACTION: KILL (the
default) SIGKILLs itself, TERM or INT sends itself that signal, PAUSE prints
"paused at step STEP" and waits until the process is signalled (for a test to
signal the agent or the process group at a known step; 120 s at most), RAISE
raises a RuntimeError (an error on one rank while the others go on);
everything else is ``python -m launch.train [overrides]``."""

from __future__ import annotations

import os
import signal
import sys
import time

from launch.runtime.dist import restarted_by_torchrun
from launch.train import Job, main


def kill_at(spec: str):
    """A step callback that does ACTION at the start of the step ``spec`` names."""
    parts = spec.split(":")
    fault_step, fault_rank, action = parts[0], (parts[1:2] or ["0"])[0], (parts[2:3] or ["KILL"])[0]

    def fault(job: Job, step: int) -> None:
        rank = job.env.rank
        if step != int(fault_step) or rank != int(fault_rank or 0) or restarted_by_torchrun():
            return
        if action == "PAUSE":
            print(f"[rank {rank}] paused at step {step}", flush=True)
            deadline = time.monotonic() + 120
            while not job.preemption.requested and time.monotonic() < deadline:
                time.sleep(0.05)
            return
        if action == "RAISE":
            raise RuntimeError(f"fault {spec}: injected error on rank {rank} at step {step}")
        what = "killing myself" if action == "KILL" else f"sending myself SIG{action}"
        print(f"[rank {rank}] fault {spec}: {what} at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), getattr(signal, f"SIG{action}"))

    return fault


if __name__ == "__main__":
    spec = sys.argv.pop(1)
    main(step_callbacks=[kill_at(spec)])
