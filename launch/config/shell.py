"""The Hydra shell of ``python -m launch.train``: compose the config, convert it to a
``JobConfig``, call the job's ``run`` (``launch.train.run``, handed in by
``launch.train.main``), turn a ``ConfigError`` (a value Hydra cannot compose too:
``launch.config.compose``) into one message and exit code 2 (``launch.config.bad_input``).
The exit code goes back to the caller, which ends the process with it (Note [Reliable
exit] in ``launch.runtime.dist``)."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable, Sequence

from .argv import check_argv
from .bad_input import CONFIG_ERROR_EXIT, config_error_reported_before, report_config_error
from .compose import compose
from .location import CONFIG_DIR
from .schema import ConfigError, register_configs, to_job_config

__all__ = ["main", "run_cli"]

RunJob = Callable[..., Any]  # launch.train.run: run(cfg, output_dir, *, step_callbacks, exit_on_error)


def main(run: RunJob, step_callbacks: Sequence[Any] = ()) -> int:
    """What ``python -m launch.train`` does with ``sys.argv``, up to its exit code;
    ``launch.train.main`` ends the process with it (Note [Reliable exit]).

    Args:
        run: the job (``launch.train.run``).
        step_callbacks: passed on to ``run`` (an entry module of one's own can
            install them, as ``tests/_fault_job.py`` does).
    """
    if config_error_reported_before():  # torchrun restarted the group after a config error: no retry
        return CONFIG_ERROR_EXIT
    return run_cli(_quiet_other_ranks(sys.argv[1:]), run, step_callbacks)


def run_cli(argv: Sequence[str], run: RunJob, step_callbacks: Sequence[Any] = ()) -> int:
    """What ``python -m launch.train ARGV`` does, in this process, up to its exit code:
    0 done, 2 bad input (one message, no traceback), 1 failure. :func:`main` returns
    it; tests call this to check exit codes without starting a process."""
    import hydra

    argv, problem = check_argv(argv)  # Note [Command line before Hydra]
    if problem is not None:
        return report_config_error(problem)
    if not any(a in ("-m", "--multirun") for a in argv):  # a sweep composes one config per job, in Hydra
        try:
            compose(argv)  # a value Hydra cannot take, in one line: Note [Hydra's errors in our words]
        except ConfigError as e:
            return report_config_error(str(e))
    register_configs()
    codes: list[int] = []  # one exit code per task Hydra ran; none when it could not compose the config

    def task(dcfg: Any) -> None:
        codes.append(_run_task(dcfg, run, step_callbacks))

    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "launch.train", *argv]
    try:
        hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")(task)()
        return codes[-1] if codes else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return 2 if code == 1 and not codes else code  # no task ran: Hydra could not compose the config (it printed why)
    finally:
        sys.argv = saved_argv


def _run_task(dcfg: Any, run: RunJob, step_callbacks: Sequence[Any]) -> int:
    """One Hydra task; returns the exit code: 0 done, 2 bad config (one message), 1 failure."""
    from hydra.core.hydra_config import HydraConfig

    try:
        cfg = to_job_config(dcfg)
        output_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
        run(cfg, output_dir, step_callbacks=step_callbacks, exit_on_error=True)
        return 0
    except ConfigError as e:  # one message per machine, printed before torchrun stops the group
        return report_config_error(str(e))
    except Exception:  # noqa: BLE001 - a real failure: show where, exit 1
        traceback.print_exc()
        sys.stderr.flush()
        return 1


def _quiet_other_ranks(argv: list[str]) -> list[str]:
    """Ranks other than 0 write no Hydra run directory and no log file: the run
    directory's name comes from the clock, which ranks may read a second apart."""
    if os.environ.get("RANK", "0") == "0" or any(a in ("-m", "--multirun") for a in argv):
        return argv
    return argv + ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.run.dir=."]


