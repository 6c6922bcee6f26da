"""The main job with a fault installed, for the restart and resume tests:

    torchrun ... tests/_fault_job.py STEP[:RANK] [overrides]

RANK (default 0) SIGKILLs itself at the start of STEP, on the first attempt only
(TORCHELASTIC_RESTART_COUNT unset or 0), through the loop's step callbacks;
everything else is ``python -m launch.train [overrides]``."""

from __future__ import annotations

import os
import signal
import sys

from launch.dist import restarted_by_torchrun
from launch.train import Job, main


def kill_at(spec: str):
    """A step callback that kills this process at the start of the step ``spec`` names."""
    fault_step, _, fault_rank = spec.partition(":")

    def fault(job: Job, step: int) -> None:
        rank = job.env.rank
        if step == int(fault_step) and rank == int(fault_rank or 0) and not restarted_by_torchrun():
            print(f"[rank {rank}] fault {spec}: killing myself at step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return fault


if __name__ == "__main__":
    spec = sys.argv.pop(1)
    main(step_callbacks=[kill_at(spec)])
