"""torchrun-aware entry points of the toolkit: the main job and the doctor.

- ``launch.train``: the main job, ``run(cfg)`` and the phases of ``train`` (setup,
  warm-up, loop, report), and ``main``, the entry point of ``python -m launch.train``;
- ``launch.doctor``: ``python -m launch.doctor``, the main job with ``diagnose=true``;
- ``launch.prepare_data``: ``python -m launch.prepare_data``, a text file into a token file.

The rest lives in rooms by role, each importing only the rooms below it (the layers
contract in ``pyproject.toml``):

- ``launch.checks``: the validation pass before any process group starts
  (``validate``, ``rules*``, ``probe``), the ranks' agreement (``agree``), the
  doctor's report (``diagnosis``);
- ``launch.checkpoint``: DCP checkpoints, written then published (``store``), the
  run identity (``run_identity``), the resume policy (``resume``);
- ``launch.observe``: what rank 0 prints and writes (``banner``, ``report``), TensorBoard,
  the profiler and the overlap timeline, driven by ``observer``;
- ``launch.step``: the training step (``train_step``), ``optim``, ``schedule``, ``evaluate``;
- ``launch.data``: the dataset contract and synthetic tokens (``source``), token files
  (``tokens``), ``build``, the padding strategies (``batching``);
- ``launch.runtime``: process-group setup/teardown, ``print0``, reliable exit
  (``dist``), model building and DDP/FSDP/compile wrapping (``parallel``),
  ``precision``, ``preempt``, ``guard``, ``recompiles``, ``compile_stats``, and
  ``_torch_internals``, every private torch name the launcher uses;
- ``launch.config``: typed config schemas and their ConfigStore registration
  (``schema``), the Hydra shell (``shell``), config errors under torchrun (``bad_input``),
  where the job's configs are (``location``);
- ``launch.models``: the example GPT the default config builds (``GPT``, ``GPTConfig``).

Note [Install layout]

Background: ``pip install`` puts a wheel's top-level packages beside everyone else's, and
``python -m`` puts the current folder first on ``sys.path``. ML projects often have their
own ``models`` and ``configs`` packages, and ROS 2 ships a ``launch``: generic top-level
names shadow, or are shadowed by, the user's.

Algorithm:

- The wheel's top-level packages are the libraries only: ``compiler``, ``ddp_opt``,
  ``fsdp_opt``, ``launch``. ``benchmarks`` and ``tools`` run from a checkout and are not
  installed.
- The example GPT lives in the launcher (``launch.models``, the bottom room beside
  ``config``): only the launcher, the benchmarks and the tests use it.
- The Hydra configs stay in the repository's top-level ``configs/`` and ship inside the
  launcher as ``launch/configs`` (setup.cfg's ``package_dir``). ``launch.config.location``
  finds them from its own file (the shipped folder first, then the checkout's), and Hydra
  gets that absolute path: never a package name (``pkg://configs``) that a ``configs``
  in the current folder would win.
- The console script ``distcompile-train`` runs ``launch.train.main`` with the script's
  folder first on ``sys.path``, not the current one, so a ``launch`` (or ``compiler``) of
  the current folder does not shadow the toolkit; ``python -m launch.train`` stays the
  way to run from a checkout.

Notes: a config of one's own builds the example model as ``_target_: launch.models.GPT``.
The repository keeps ``configs/`` at its top level (where users look for it); only the
wheel moves it, so a checkout and an editable install read the same files.

The names below are the public surface. They are imported on first use, not
here: ``python -m launch.train`` imports this package first, and a ``launch.train``
already imported by then would run twice (runpy warns about exactly that).
"""

import importlib
from typing import Any

__all__ = [
    # entry points
    "run",
    "train",
    "main",
    # configuration
    "JobConfig",
    "ConfigError",
    "register_configs",
    "to_job_config",
    "validate",
    # building blocks of a run
    "build_model",
    "apply_parallel",
    "process_group",
    "save_checkpoint",
    "load_checkpoint",
]

_HOME = {
    "run": "train", "train": "train", "main": "train",
    "JobConfig": "config.schema", "ConfigError": "config.schema", "register_configs": "config.schema",
    "to_job_config": "config.schema",
    "validate": "checks.validate",
    "build_model": "runtime.parallel", "apply_parallel": "runtime.parallel",
    "process_group": "runtime.dist",
    "save_checkpoint": "checkpoint.store", "load_checkpoint": "checkpoint.store",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
