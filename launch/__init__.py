"""torchrun-aware entry points of the toolkit.

- ``launch.train``: the main job (``@hydra.main`` shell around ``run(cfg)``);
- ``launch.config``: typed config schemas, ConfigStore registration, validation;
- ``launch.dist``: process-group setup/teardown, ``print0``, reliable exit;
- ``launch.parallel``: model building and DDP/FSDP/compile wrapping;
- ``launch.data``: deterministic synthetic tokens and the dataset contract;
- ``launch.checkpoint``: DCP checkpoints, written then published.

Submodules are not imported here, so that ``python -m launch.train`` runs cleanly.
"""

__all__: list[str] = []
