"""``distcompile-train``: check the job, then run torchrun's agent in this process.

    distcompile-train --standalone --nproc-per-node 2 [overrides]     # one machine, 2 ranks
    distcompile-train --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT [overrides]

Under torchrun (``LOCAL_RANK`` set) it is the worker entry point, ``launch.train.main``, as in
``torchrun --standalone --nproc-per-node 2 --no-python distcompile-train [overrides]``.

Note [Checks before the ranks start]

Background
    Under ``torchrun ... -m launch.train`` every rank finds a bad setting, local rank 0
    prints it (Note [Config errors under torchrun]) and torchrun adds its own traceback and
    failure table and exits 1: 46 to 57 lines for a typo, and a value of the wrong type
    (``train.steps=abc``) came out as Hydra's raw report once per rank. A worker cannot
    change what torchrun prints; the process that starts the ranks can.

Algorithm
    1. Split the command line: torchrun's own flags first (every flag its parser has, but
       those that name the program), then the job's arguments (``launch.runtime.elastic``).
    2. Compose the config in this process as the ranks will (``launch.config.compose``:
       Note [Command line before Hydra], Note [Hydra's errors in our words]) and run
       ``launch.checks.validate`` for every world size the flags allow, with
       ``LOCAL_WORLD_SIZE`` as the ranks will see it. These are the checks that need no
       process group; the ranks run them again, and those that need the group.
    3. A bad setting: one line on stderr, exit code 2, no rank started.
    4. Otherwise run torchrun's agent here (``torch.distributed.run.run``), each rank
       running this console script as the worker entry point (or ``python -u -m
       launch.train`` when not started as the script). A failed rank is told in one line:
       the rank that failed first, its exit code, its own last line and where its error file
       keeps its last lines (Note [A failed rank's last line]); the launcher exits with that
       rank's code (1 for a signal), 75 when the agent itself was signalled.

Notes
    Hydra's flags other than the config folder and name (``--multirun``, ``--cfg``, ...)
    are refused: they are for ``python -m launch.train``, which runs in one process.
    ``torchrun ... -m launch.train`` keeps working as before.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Sequence

from . import train
from .checks.validate import validate
from .config.bad_input import report_config_error
from .config.compose import compose_job
from .config.schema import ConfigError
from .runtime.dist import exit_now
from .runtime.elastic import run_agent, split_argv, torchrun_namespace, world_sizes, worker_command

__all__ = ["main", "launch", "check"]

# Hydra's flags the parent composes with; its others are for python -m launch.train.
_HYDRA_FLAGS_KEPT = ("--config-path", "-cp", "--config-dir", "-cd", "--config-name", "-cn", "-v", "--verbose")

USAGE = """\
usage: distcompile-train [torchrun's flags] [overrides]

Checks the job's config, then starts its ranks with torchrun's agent in this process:
  distcompile-train --standalone --nproc-per-node 2 compile.backend=aot_eager train.steps=50
torchrun's flags: torchrun --help (all but -m, --no-python and --run-path). Overrides and
config groups: docs/main-job.md, or python -m launch.train --help. Exit codes: 0 done,
2 bad input (one line, no rank started), else the first failed rank's own code."""


def main() -> None:
    """Entry point of the ``distcompile-train`` console script: the launcher, or under torchrun
    (``LOCAL_RANK`` set) the worker entry point ``launch.train.main``."""
    if "LOCAL_RANK" in os.environ:
        train.main()
        return
    exit_now(launch(sys.argv[1:]))


def launch(argv: Sequence[str], *, worker: Sequence[str] | None = None) -> int:
    """What ``distcompile-train ARGV`` does outside torchrun, up to its exit code (see the Note).

    Args:
        argv: torchrun's flags, then the job's overrides.
        worker: the program each rank runs, given the job's arguments after it (default:
            :func:`launch.runtime.elastic.worker_command`); an entry module of one's own that
            calls ``launch.train.main``, as ``tests/_fault_job.py`` does.

    Returns:
        0 when every rank finished; 2 for a bad setting, found before any rank started; else
        the first failed rank's code (1 for a signal), or 75 when the agent was signalled.
    """
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        args = check(argv, worker or worker_command())
    except ConfigError as e:
        return report_config_error(str(e))  # one line, exit code 2 (outside torchrun: no marker)
    return run_agent(args)


def check(argv: Sequence[str], worker: Sequence[str]):
    """torchrun's arguments for ``argv``, once the job's config composed and validated for every
    world size the flags allow (steps 1 and 2 of the Note).

    Raises:
        ConfigError: the first bad setting or flag, with what, why and how to fix it.
    """
    flags, job_argv = split_argv(argv)
    _refuse_hydra_flags(job_argv)
    args = torchrun_namespace(flags, job_argv, worker)
    sizes, local = world_sizes(args)
    cfg = compose_job(job_argv)
    with _ranks_view(local):
        for size in sizes:
            validate(cfg, world_size=size)
    return args


def _refuse_hydra_flags(job_argv: Sequence[str]) -> None:
    for arg in job_argv:
        name = arg.split("=", 1)[0]
        if arg.startswith("-") and name not in _HYDRA_FLAGS_KEPT:
            raise ConfigError(
                f"{arg} is not a setting distcompile-train passes to its ranks: after torchrun's flags come the job's "
                "overrides (key=value) and Hydra's --config-path, --config-dir, --config-name and -v. Hydra's other "
                f"flags are for one process: python -m launch.train {arg} ... (a flag torchrun has goes before the "
                "first override).")


@contextlib.contextmanager
def _ranks_view(local_world_size: int) -> Iterator[None]:
    """``LOCAL_WORLD_SIZE`` as the ranks will see it, for the checks that read it (memory shared
    by the machine's ranks, NCCL's GPU per rank); restored afterwards."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


if __name__ == "__main__":
    main()
