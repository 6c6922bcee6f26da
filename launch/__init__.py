"""torchrun-aware entry points of the toolkit: the main job and the doctor.

- ``launch.train``: the main job, ``@hydra.main`` shell around ``run(cfg)`` and the
  phases of ``train`` (setup, warm-up, loop, report);
- ``launch.doctor``: ``python -m launch.doctor``, the main job with ``diagnose=true``;
- ``launch.schema``: typed config schemas and their ConfigStore registration;
- ``launch.validate``: the validation pass before any process group starts;
- ``launch.banner`` / ``launch.report`` / ``launch.diagnosis``: what rank 0 prints;
- ``launch.dist``: process-group setup/teardown, ``print0``, reliable exit;
- ``launch.parallel``: model building and DDP/FSDP/compile wrapping;
- ``launch.data``, ``launch.batching``: deterministic tokens, padding strategies;
- ``launch.step``, ``launch.optim``, ``launch.precision``, ``launch.recompiles``: the training step;
- ``launch.checkpoint``: DCP checkpoints, written then published;
- ``launch._torch_internals``: every private torch name the launcher uses.

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
    "JobConfig": "schema", "ConfigError": "schema", "register_configs": "schema", "to_job_config": "schema",
    "validate": "validate",
    "build_model": "parallel", "apply_parallel": "parallel",
    "process_group": "dist",
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
