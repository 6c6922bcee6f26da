"""Traced FSDP (``fsdp_opt.apply(model, strategy="traced")``): parameters stored as FSDP2
stores them, the whole forward compiled with every all-gather and reduce-scatter inside
the graph, bucketed and ordered from the measured link.

- ``gather``: one unit's all-gather and reduce-scatter as one autograd function (Note [Unit gather]).
- ``shard``: the sharded parameters, the properties that read the gathered ones, the state (Note [Traced parameters]).
- ``plan``, ``measure``: the units from the link and block times, within a memory budget (Note [Traced FSDP plan]).
- ``schedule``: where each collective is issued and awaited; the re-gathers (Note [Traced FSDP schedule]).
- ``segments``: Inductor's pieces between the collectives (Note [Compiled segments]).
- ``backend``: the dynamo backend that runs them in order; ``apply``: the entry point.
"""

from .apply import apply_traced, traced_refusal
from .plan import CollectiveLink, TracedPlan, TracedUnit

__all__ = ["apply_traced", "traced_refusal", "TracedPlan", "TracedUnit", "CollectiveLink"]
