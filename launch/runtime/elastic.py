"""torchrun's agent in this process, for ``distcompile-train`` (``launch.launcher``): torchrun's
flags told apart from the job's arguments, the world sizes the ranks will have, the program
each rank runs, and one line for a failed worker in place of torchrun's traceback and table.

The launcher's Note is Note [Checks before the ranks start] in ``launch/launcher.py``; what a
failed worker leaves for the line here is Note [A failed rank's last line] in
``launch.runtime.worker_error``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import signal
import sys
from typing import Sequence

from ..config.schema import ConfigError
from ._torch_internals import AgentSignalled, FailedWorker, run_torchrun, torchrun_args, torchrun_parser, torchrun_sizes
from .preempt import EXIT_PREEMPTED
from .worker_error import failed_at, last_line

__all__ = ["split_argv", "torchrun_namespace", "world_sizes", "worker_command", "run_agent", "first_failure",
           "failure_line"]

# torchrun's flags that name the program the ranks run: distcompile-train chooses it.
_PROGRAM_FLAGS = ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """torchrun's flags at the front of ``argv`` (``--standalone``, ``--nproc-per-node 2``,
    ``--rdzv-endpoint=host:port``, ...: every flag torchrun's parser has), and the job's arguments
    from the first argument that is not one of them (Hydra overrides and flags).

    Raises:
        ConfigError: a torchrun flag that names the program (``-m``, ``--no-python``,
            ``--run-path``), or a flag at the end that lacks its value.
    """
    argv = list(argv)
    options = {opt: action for action in torchrun_parser()._actions for opt in action.option_strings}
    i = 0
    while i < len(argv):
        name, eq, _ = argv[i].partition("=")
        action = options.get(name if name.startswith("--") else argv[i])
        if not argv[i].startswith("-") or action is None:
            break
        if name in _PROGRAM_FLAGS:
            raise ConfigError(
                f"{argv[i]} is not a flag of distcompile-train: it runs the main job on every rank, so the program is "
                "chosen already. Give torchrun's other flags and then the job's overrides, e.g. distcompile-train "
                "--standalone --nproc-per-node 2 train.steps=50; for a program of your own use torchrun itself.")
        takes_value = action.nargs != 0 and not eq
        if takes_value and i + 1 >= len(argv):
            raise ConfigError(f"{argv[i]} needs a value: it is torchrun's flag, e.g. {argv[i]} 2. Give the value "
                              "after it, then the job's overrides.")
        i += 2 if takes_value else 1
    return argv[:i], argv[i:]


def torchrun_namespace(flags: Sequence[str], job_argv: Sequence[str], worker: Sequence[str]) -> argparse.Namespace:
    """torchrun's parse of ``FLAGS --no-python WORKER JOB_ARGV``: its arguments for this launch.

    Raises:
        ConfigError: a value torchrun's parser refuses (``--max-restarts abc``), in one line.
    """
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return torchrun_args([*flags, "--no-python", *worker, *job_argv])
    except SystemExit:  # argparse printed its usage (about 40 lines) and why: keep the why
        why = next((line for line in reversed(err.getvalue().splitlines()) if line.strip()), "not valid")
        raise ConfigError(f"torchrun's flags {' '.join(flags)} are not valid: {why.split(': error: ')[-1]}. Fix the "
                          "flag (torchrun --help lists them), then give the job's overrides.") from None


def world_sizes(args: argparse.Namespace) -> tuple[list[int], int]:
    """Every world size the ranks may have (``--nnodes MIN:MAX`` times ``--nproc-per-node``; one
    size for a fixed ``--nnodes``), and the ranks on this machine.

    Raises:
        ConfigError: a value of ``--nnodes`` or ``--nproc-per-node`` torchrun cannot read.
    """
    try:
        lo, hi, nproc = torchrun_sizes(args)
    except ValueError as e:
        raise ConfigError(f"{e}. Give --nproc-per-node a number of ranks per machine (or gpu, cpu, auto) and "
                          "--nnodes a number of machines or MIN:MAX, e.g. --standalone --nproc-per-node 2.") from None
    if not 0 < lo <= hi or nproc < 1:
        raise ConfigError(f"--nnodes={args.nnodes} with --nproc-per-node={args.nproc_per_node} gives no rank to run: "
                          "both must be at least 1 (MIN <= MAX). E.g. --standalone --nproc-per-node 2.")
    return [n * nproc for n in range(lo, hi + 1)], nproc


def worker_command() -> list[str]:
    """The program each rank runs: this console script itself when ``distcompile-train`` is
    running (under torchrun it is the worker entry point, as in ``torchrun --no-python
    distcompile-train``, so the current folder does not come first on the import path: Note
    [Install layout]); otherwise ``python -u -m launch.train``."""
    script = sys.argv[0] if sys.argv else ""
    if os.path.basename(script) == "distcompile-train" and os.access(script, os.X_OK):
        return [os.path.abspath(script)]
    return [sys.executable, "-u", "-m", "launch.train"]


def run_agent(args: argparse.Namespace) -> int:
    """Run torchrun's agent with ``args`` in this process; returns the launcher's exit code: 0 when
    every rank finished, the first failed rank's own code (1 where a signal ended it) with one
    line (:func:`failure_line`), 75 when the agent was signalled (the ranks got the signal too:
    Note [Preemption])."""
    try:
        failures = run_torchrun(args)
    except AgentSignalled as e:
        print(f"preempted: distcompile-train got {_signal_name(e.signum)} and passed it to the ranks, which stop after "
              "the same step and save when checkpointing (their lines above say what they saved); continue with "
              f"train.resume=true (exit code {EXIT_PREEMPTED}, to requeue on)", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    if not failures:
        return 0
    first = first_failure(failures)
    print(failure_line(first, len(failures)), file=sys.stderr, flush=True)
    return first.exitcode if first.exitcode > 0 else 1


def first_failure(failures: Sequence[FailedWorker]) -> FailedWorker:
    """The rank that failed first: the earliest error file written (Note [A failed rank's last
    line]); without one, a rank that exited by itself before one ended by a signal (torchrun
    SIGTERMs the others once one has failed)."""
    def key(w: FailedWorker) -> tuple:
        at = failed_at(w.record)
        return (at is None, at if at is not None else math.inf, w.exitcode < 0, w.rank)

    return min(failures, key=key)


def failure_line(w: FailedWorker, failed: int = 1) -> str:
    """One line for the failed worker ``w``: its rank, its exit code, its own last line and where
    its last lines are kept; ``failed`` ranks failed on this machine in all."""
    if w.exitcode > 0:
        how = f"exit code {w.exitcode}"
    else:
        how = f"killed by {_signal_name(-w.exitcode)} (exit code {w.exitcode})"
    said = last_line(w.record)
    if said:
        what = f": {said}"
    elif w.exitcode < 0:
        what = ", with no error line (a signal leaves none: kill -9 or the OOM killer); its output is above"
    else:
        what = ", with no error line of its own; its output is above"
    where = f" (its last lines: {w.error_file})" if said and w.error_file else ""
    others = f"; {failed - 1} other rank(s) here ended too" if failed > 1 else ""
    return f"error: rank {w.rank} failed first, {how}{what}{where}{others}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
