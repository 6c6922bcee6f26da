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


def _without_nproc(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def relaunch(module: str, argv: Sequence[str], nproc: int, command_env: str) -> int:
    """Start ``python -m module argv`` on ``nproc`` local ranks; return torchrun's exit code.

    The user's own command line is passed to the workers in ``command_env`` so that
    the results can record how to reproduce them. ``--nproc`` is the launcher's, not the
    workers': torchrun's parser takes it for an abbreviation of its own ``--nproc-per-node``
    and stops, so it is left out of the workers' arguments."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, *_without_nproc(argv)]
    print(f"launching: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    env = dict(os.environ, **{command_env: shlex.join(["python", "-m", module, *argv])})
    return subprocess.call(cmd, env=env)
