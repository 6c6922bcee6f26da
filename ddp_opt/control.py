"""The one line that says ddp_opt is in control of a DDP model: which entry point compiled
it, the strategy and backend, DDP's buckets = the graph partitions, their alignment, and
what the entry point changed in the user's settings (Note [In control, once]).

:func:`control_line` writes the line from plain facts; :class:`ControlLine`, a part of
``CompiledDDP`` (``compiled.control``), says it once, when the facts are final.

Note [In control, once]

Background
    Inside a framework (Lightning's Trainer, Accelerate, the HF Trainer) the user's script
    shows nothing of ours, and the frameworks' default verbosity hides INFO records of
    loggers they do not own: Lightning and transformers configure their own loggers only,
    and Python's root logger stays at WARNING. So the only evidence that our plan, not
    PyTorch's splitter, runs the model was a print the user wrote. When the plan is *not*
    in control (DDP will not rebuild its buckets, the ranks could not agree on caps, the
    torch cannot re-create DDP's reducer) a warning already says so, once.

Algorithm
    - What: ``ddp_opt in control (ENTRY): strategy=..., backend=...; N bucket(s) = graph
      partitions (MiB ...); DDP's buckets realigned with them, alignment F[; changed: ...]``.
      Under ``strategy="traced"`` the bucket clause is the fused all-reduces of the compiled
      backward, under ``"whole"`` DDP's own buckets, under ``"regional"`` the buckets of
      whole blocks.
    - When: after the first step, once the facts are final. Where DDP's buckets are
      realigned, that is when the realigned buckets are measured: DDP rebuilds them in the
      forward after the new reducer's first synchronised backward, so the line comes in that
      forward (the third step's without gradient accumulation). Otherwise it comes in the
      second synchronised forward, when the first step's backward has compiled and run.
    - Where: on the first rank of DDP's group only, and said at most once per handle. An entry
      point that runs inside a framework sets ``prints`` (``CompiledDDPStrategy``,
      ``compile_prepared``, ``compile_trainer``): the line is printed to stdout, as the
      frameworks print their own progress (``accelerator.print``, the Trainer's log dicts), so
      it shows at their default verbosity. Otherwise (``compile_ddp`` or ``compile_for_ddp``
      in a loop of one's own, the launcher) it is an INFO record of this module's logger,
      which the launcher shows on rank 0 and a user's own loop shows when it asks for INFO.
    - Not in control: the warning of the cause is the one line, and this one is not said.

Notes
    - ``changes`` is what an entry point changed in the user's settings; the HF Trainer route
      turns the Trainer's default ``find_unused_parameters=True`` off (Note [HF Trainer route]).
    - ``compiled.control.line`` keeps the line on every rank once it is final (None before, and
      when not in control), so tests and scripts can read it without parsing the output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .handle_parts import synchronised

if TYPE_CHECKING:
    from .handle_parts import Realigner
    from .planning.buckets import Bucket
    from .strategies.traced.plan import TracedPlan

log = logging.getLogger(__name__)

__all__ = ["PREFIX", "ControlFacts", "ControlLine", "backend_name", "buckets_clause", "control_line"]

PREFIX = "ddp_opt in control"
MiB = 1 << 20
_SIZES_SHOWN = 6


@dataclass(frozen=True)
class ControlFacts:
    """What the entry point knows of the line when it compiles (the rest is learnt in training).

    Attributes:
        entry: the entry point, as the line names it (``compile_ddp``, ``compile_trainer``, ...).
        backend: the backend's name.
        in_control: False when a warning at compile time already said the plan is not in control
            (DDP will not rebuild its buckets, the torch cannot re-create its reducer).
        kept: why DDP keeps its own buckets by the user's choice (``align_buckets=False``), or None.
    """

    entry: str = "compile_ddp"
    backend: str = "inductor"
    in_control: bool = True
    kept: str | None = None


def backend_name(backend: object) -> str:
    """A backend as the line names it: its registered name, or the callable's name."""
    return backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


def _mib(sizes: Sequence[int]) -> str:
    shown = ", ".join(f"{s / MiB:.2f}" for s in sizes[:_SIZES_SHOWN])
    more = len(sizes) - _SIZES_SHOWN
    return shown + (f", ... {more} more" if more > 0 else "") + " MiB"


def control_line(entry: str, *, strategy: str, backend: str, buckets: str, changes: Sequence[str] = ()) -> str:
    """The line of Note [In control, once] from its facts.

    Args:
        entry: the entry point that compiled the model (``compile_trainer``, ...).
        strategy, backend: as compiled.
        buckets: what DDP's gradients go through (:func:`buckets_clause`).
        changes: what the entry point changed in the user's settings, one phrase each.
    """
    line = f"{PREFIX} ({entry}): strategy={strategy}, backend={backend}; {buckets}"
    return line + (f"; changed: {'; '.join(changes)}" if changes else "")


def buckets_clause(strategy: str, sizes: Sequence[int], *, auto: bool = False, alignment: float | None = None,
                   kept: str | None = None, fused: Sequence[int] | None = None) -> str:
    """What DDP's gradients go through, in words.

    Args:
        strategy: the strategy in use.
        sizes: the planned buckets' bytes, forward order (non-empty ones).
        auto: planned by the cost model (``bucket_cap_mb="auto"``).
        alignment: the measured alignment of DDP's realigned buckets, or None when not realigned.
        kept: why DDP keeps its own buckets (not realigned), or None.
        fused: under ``"traced"``, the fused all-reduces' bytes of a compiled backward ([] when none).
    """
    planned = ", planned by the cost model" if auto else ""
    if strategy == "traced":
        if fused:
            return (f"the gradients all-reduced inside the compiled backward graph, in {len(fused)} fused "
                    f"all-reduce{'s' if len(fused) != 1 else ''} ({_mib(list(fused))}{planned})")
        return ("the gradients all-reduced inside the compiled backward graph, one by one (no fusion recorded: "
                "only Inductor's pass fuses them)")
    if strategy == "whole" or not sizes:
        return "each graph compiled whole, DDP's own buckets (no split)"
    n, plural = len(sizes), "s" if len(sizes) != 1 else ""
    what = f"bucket{plural} of whole blocks" if strategy == "regional" else f"bucket{plural} = graph partition{plural}"
    plan = f"{n} {what} ({_mib(list(sizes))}{planned})"
    if alignment is not None:
        return f"{plan}; DDP's buckets realigned with them, alignment {alignment:.2f}"
    return f"{plan}; DDP's own buckets kept ({kept})" if kept else plan


class ControlLine:
    """Says the line of Note [In control, once] once, on the first rank of DDP's group, when
    its facts are final; ``CompiledDDP`` calls :meth:`after_forward` from its forward hook.

    Args:
        ddp_model: the DDP module.
        facts: what the entry point knew when it compiled.
        strategy: the strategy in use.
        buckets: returns the plan's buckets.
        realigner: the handle's realignment part.
        traced: under ``strategy="traced"``, its plan.
        auto: the plan is the cost model's.

    Attributes:
        entry: the entry point the line names; a route that calls ``compile_ddp`` names itself.
        changes: what the entry point changed in the user's settings (appended before the line).
        prints: print the line (the framework routes) instead of logging it at INFO.
        line: the line once final, on every rank; None before it, and when not in control.
        done: True once decided (said, or not in control).
    """

    def __init__(self, ddp_model: DistributedDataParallel, facts: ControlFacts, *, strategy: str,
                 buckets: Callable[[], list[Bucket]], realigner: Realigner, traced: TracedPlan | None = None,
                 auto: bool = False) -> None:
        self.ddp_model, self.entry, self.strategy, self.backend = ddp_model, facts.entry, strategy, facts.backend
        self.buckets, self.realigner, self.traced, self.auto = buckets, realigner, traced, auto
        self.kept = facts.kept
        self.changes: list[str] = []
        self.prints = False
        self.line: str | None = None
        self.done = not facts.in_control
        self._synchronised = 0

    def in_framework(self, entry: str, changes: Sequence[str] = ()) -> None:
        """Called by an entry point that runs inside a framework (before the first step): the
        line names ``entry`` and ``changes``, and is printed, to show at the framework's
        default verbosity."""
        self.entry, self.prints = entry, True
        self.changes.extend(changes)

    def after_forward(self) -> None:
        """Count the synchronised forwards; from the second on, say the line once it is final."""
        if self.done or not (dist.is_initialized() and synchronised(self.ddp_model)):
            return
        self._synchronised += 1
        if self._synchronised < 2:
            return
        clause = self._clause()
        if clause is None:
            return  # realigned, not measured yet
        self.done = True
        if clause:
            self.line = control_line(self.entry, strategy=self.strategy, backend=self.backend, buckets=clause,
                                     changes=self.changes)
            self._say(self.line)

    def _clause(self) -> str | None:
        """The buckets clause; None while not final, "" when not in control (a warning said why)."""
        sizes = [b.size for b in self.buckets() if b.size > 0]
        if self.traced is not None:
            return buckets_clause("traced", sizes, auto=self.auto, fused=self.traced.fused[-1] if self.traced.fused
                                  else [])
        r = self.realigner
        if not r.enabled or not sizes:
            return buckets_clause(self.strategy, sizes, auto=self.auto, kept=self.kept)
        if not r.decided:
            return None
        if r.aligned_caps is None:
            if r.agreed is False:
                return ""  # the ranks could not agree: warned
            return buckets_clause(self.strategy, sizes, auto=self.auto, kept="one partition")
        if r.realignment is None:
            return None
        return buckets_clause(self.strategy, sizes, auto=self.auto, alignment=r.realignment.fraction)

    def _say(self, line: str) -> None:
        if dist.get_rank(self.ddp_model.process_group) != 0:
            return
        if self.prints:
            print(line, flush=True)
        else:
            log.info("%s", line)
