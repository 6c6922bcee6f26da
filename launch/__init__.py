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
  (``schema``), the Hydra shell (``shell``), config errors under torchrun (``bad_input``).

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
