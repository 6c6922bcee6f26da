"""Strategies: how a compiled DDP model is cut at its buckets. ``table`` holds the
strategy table that ``compile_ddp`` picks from; ``split`` is the split strategy's
``DDPOptimizer`` (split the graph at the bucket boundaries, compile each partition);
``traced`` buckets inside one traced graph and ``regional`` buckets by whole compiled
blocks. They use the planning, alignment and compression packages, never the
reverse. The public names are re-exported by ``ddp_opt``."""

__all__ = ["regional", "split", "table", "traced"]
