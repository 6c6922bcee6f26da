"""Strategies: how a compiled DDP model is cut at its buckets, one module or folder per
strategy holding everything particular to it. ``table`` lists them (``STRATEGIES``: each
entry's rules, its build function, what it checks of the model); ``rules`` holds each
strategy's rules as data; ``base`` what every strategy reads and returns.

- ``split``: ``DDPOptimizer`` (split the graph at the bucket boundaries, compile each
  partition) and its build;
- ``whole``: each captured graph compiled whole;
- ``regional``: each repeated block compiled once, buckets of whole blocks;
- ``traced/``: the all-reduces inside one compiled backward: its plan and fusion pass
  (``plan``), where its waits and updates go (``placement``), its optimizer in backward
  (``update``), its PowerSGD (``powersgd``), its part of the handle and its refusals
  (``backward``), and how it is built (``build``).

What split, whole and regional share (DDP's reducer: the optimizer in backward chained to
its hooks, the compression hooks) is in ``ddp_opt.in_backward`` and ``ddp_opt.compression``.
They use the planning, alignment and compression packages, never the reverse. The public
names are re-exported by ``ddp_opt``."""

__all__ = ["base", "regional", "rules", "split", "table", "traced", "whole"]
