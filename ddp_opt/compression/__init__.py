"""Gradient compression: ``hooks`` installs the communication hook that
``compile_ddp(compression=..., reduce_dtype=...)`` asks for, ``powersgd`` is the
PowerSGD hook for DDP's reducer (``bucket_powersgd`` its step for one CPU bucket) and
``traced_powersgd`` its form inside a traced graph; ``factors`` holds the products and
orthogonalisation both use. Built on the planning package; nothing here picks a
strategy. The public names are re-exported by ``ddp_opt``."""

__all__ = ["bucket_powersgd", "factors", "hooks", "powersgd", "traced_powersgd"]
