"""``python -m launch.doctor [overrides] [--json PATH]``: run the configured
training job for a few steps and report what the compiler did to it.

The report (graphs, accidental graph breaks with their user lines, recompiles
with the guard that failed, the DDP partitions and any that fell back to eager,
advice) is the launcher's ``diagnose=true`` (``launch.checks.diagnosis``); this entry
point only sets that and a short default length. Run it under torchrun for a
multi-rank job, like the main job:

    torchrun --standalone --nproc-per-node 2 -m launch.doctor compile=aot_eager

With ``profile.steps=[5,6]`` the report also links a Chrome trace of those steps
and a timeline picture of the last one, each partition's backward and each
bucket's all-reduce on its own row, with the exposed communication marked
(``launch.observe.profile``, Note [Overlap timeline] in ``launch.observe.timeline``); without it,
the report says how to get them.
"""

from __future__ import annotations

import sys

from .train import main as train_main

__all__ = ["DEFAULT_STEPS", "doctor_argv", "main"]

DEFAULT_STEPS = 6


def doctor_argv(argv: list[str]) -> list[str]:
    """Launcher overrides for a diagnosis: ``diagnose=true``, a few steps, ``--json``."""
    out, it = [], iter(argv)
    for arg in it:
        if arg == "--json":
            out.append(f"diagnose_json={next(it, '')}")
        elif arg.startswith("--json="):
            out.append(f"diagnose_json={arg.split('=', 1)[1]}")
        else:
            out.append(arg)
    if not any(a.startswith("train.steps=") for a in out):
        out.append(f"train.steps={DEFAULT_STEPS}")
    return out + ["diagnose=true"]


def main() -> None:
    """Entry point of ``python -m launch.doctor``; ends the process like the main job."""
    sys.argv = [sys.argv[0]] + doctor_argv(sys.argv[1:])
    train_main()


if __name__ == "__main__":
    main()
