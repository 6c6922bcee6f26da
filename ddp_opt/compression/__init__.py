"""Gradient compression under DDP's reducer (the split, whole and regional strategies):
``hooks`` makes the communication hook that ``compile_ddp(compression=..., reduce_dtype=...)``
asks for, ``powersgd`` is the PowerSGD hook for DDP's reducer (``bucket_powersgd`` its step
for one CPU bucket); ``factors`` holds the products and orthogonalisation PowerSGD uses here
and in the traced strategy's form (``ddp_opt.strategies.traced.powersgd``). Built on the
planning package; nothing here picks a strategy. The public names are re-exported by
``ddp_opt``."""

__all__ = ["bucket_powersgd", "factors", "hooks", "powersgd"]
