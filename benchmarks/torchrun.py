"""Run a benchmark module under torchrun when it was started as a plain script."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from typing import Sequence

__all__ = ["inside_torchrun", "relaunch"]


def inside_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ


def relaunch(module: str, argv: Sequence[str], nproc: int, command_env: str) -> int:
    """Start ``python -m module argv`` on ``nproc`` local ranks; return torchrun's exit code.

    The user's own command line is passed to the workers in ``command_env`` so that
    the results can record how to reproduce them."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, *argv]
    print(f"launching: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    env = dict(os.environ, **{command_env: shlex.join(["python", "-m", module, *argv])})
    return subprocess.call(cmd, env=env)
