"""Gradient compression: ``hooks`` installs the communication hook that
``compile_ddp(compression=..., reduce_dtype=...)`` asks for, ``powersgd`` is the
PowerSGD hook for DDP's reducer and ``traced_powersgd`` its form inside a traced
graph. Built on the planning package; nothing here picks a strategy. The public
names are re-exported by ``ddp_opt``."""

__all__ = ["hooks", "powersgd", "traced_powersgd"]
