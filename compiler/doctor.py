"""``python -m compiler.doctor [overrides] [--json PATH]``: run the configured
training job for a few steps and report what the compiler did to it.

The report (graphs, accidental graph breaks with their user lines, recompiles
with the guard that failed, the DDP partitions and any that fell back to eager,
advice) is the launcher's ``diagnose=true``; this entry point only sets that and a
short default length, so the engine (``compiler.diagnose``) stays free of Hydra.
Run it under torchrun for a multi-rank job, like the main job:

    torchrun --standalone --nproc-per-node 2 -m compiler.doctor compile=aot_eager
"""

from __future__ import annotations

import sys

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
    from launch.train import main as train_main  # the CLI boundary; the engine does not import launch

    sys.argv = [sys.argv[0]] + doctor_argv(sys.argv[1:])
    train_main()


if __name__ == "__main__":
    main()
