"""Rank agreement and alignment with DDP's runtime buckets: ``measure`` compares
the plan with the buckets DDP's reducer really uses, ``realign`` rebuilds the
reducer's buckets to match the plan, and ``agreement`` checks that every rank chose
the same plan. Built on the planning package; nothing here picks a strategy. The
public names are re-exported by ``ddp_opt``."""

__all__ = ["agreement", "measure", "realign"]
