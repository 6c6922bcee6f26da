"""What each strategy of ``compile_ddp`` takes and refuses, as data: one :class:`Rules` per
strategy in :data:`RULES`, keyed by its name. The checks read these entries instead of
naming strategies (``config.py``, ``setup.py``, ``api.py``, ``compile_first.py``), and
``strategies/table.py`` pairs each entry with the function that builds the strategy.

Pure data, importing nothing of ddp_opt: ``DDPCompileConfig`` validates against it when a
config is built (the launcher builds one before any rank starts), below every module that
builds a strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RULES", "Rules", "names_where", "refusal"]


@dataclass(frozen=True)
class Rules:
    """One strategy's rules.

    Attributes:
        says: what it does, in one line (the refusal of an unknown name lists these).
        plans_buckets: a cost model (``bucket_cap_mb="auto"``, ``link=``) chooses where its
            buckets end; where False, both are refused (:func:`refusal`).
        reducer: DDP's reducer all-reduces the buckets, so a comm hook applies, the hook of
            ``compression=`` runs on the backward's cores (its compute is in the cost model),
            and a compile cache entry serves every world size; where False the all-reduces
            are in the compiled backward graph (``reduce_dtype=`` and ``compression=`` take
            their traced form; the cache entry is per world size).
        realigns: DDP's buckets are realigned with the plan's after DDP's first iteration.
        one_partition: each captured graph is one partition, so no realignment check applies.
        compile_first: ``compile_for_ddp`` (compile, then wrap in DDP) offers it; where False
            it needs the DDP module before the first forward.

    What a strategy refuses of a given model or optimizer (traced: a registered comm hook, an
    optimizer it cannot trace) needs the model, so it is a function of its entry in
    ``strategies/table.py`` (``fallback``, ``prepare_update``), not a field here.
    """

    says: str
    plans_buckets: bool
    reducer: bool
    realigns: bool
    one_partition: bool
    compile_first: bool


RULES: dict[str, Rules] = {
    "split": Rules(
        says="the forward split at the bucket boundaries, DDP's reducer all-reduces each bucket (the default)",
        plans_buckets=True, reducer=True, realigns=True, one_partition=False, compile_first=True),
    "whole": Rules(
        says="each captured graph compiled whole, no split (no overlap of communication with backward; for "
             "comparison)",
        plans_buckets=False, reducer=True, realigns=True, one_partition=True, compile_first=True),
    "regional": Rules(
        says="each repeated block compiled once and reused, DDP's buckets made of whole blocks, the rest eager",
        plans_buckets=False, reducer=True, realigns=True, one_partition=False, compile_first=False),
    "traced": Rules(
        says="the forward compiled whole and the all-reduces traced into one compiled backward graph",
        plans_buckets=True, reducer=False, realigns=False, one_partition=False, compile_first=False),
}


def names_where(**facts: bool) -> list[str]:
    """The strategies whose rules have every one of ``facts``, in the table's order."""
    return [name for name, rules in RULES.items() if all(getattr(rules, k) == v for k, v in facts.items())]


def refusal(strategy: str, uses_cost_model: bool) -> str | None:
    """Why ``strategy`` cannot take a cost model's plan, or None."""
    if not uses_cost_model or RULES[strategy].plans_buckets:
        return None
    takers = " or ".join(repr(n) for n in names_where(plans_buckets=True))
    return (f"the cost model chooses (or predicts) where to split the graph into buckets, and strategy={strategy!r} "
            f"does not split it at planned buckets. Drop one of the two, or use strategy={takers}")
