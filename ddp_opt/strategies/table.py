"""The compile strategies of ``compile_ddp`` and ``compile_for_ddp`` in one table,
``STRATEGIES``, keyed by the strategy's name, and ``ddp_backend``, which builds the dynamo
backend of a DDP model through ``compiler.graph.build_backend`` with the chosen strategy as
its transform.

Each entry is a :class:`Strategy`: its rules as data (``strategies/rules.py``: what it takes
and refuses, read by the checks), the function in its own module that builds it
(``(setup, backend) -> Built``: given the backend each piece is compiled with, already shared,
Note [Backend wrapping order], it returns the backend dynamo calls and what the handle keeps),
and what it checks of the DDP model before anything is converted.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from torch.nn.parallel import DistributedDataParallel

from compiler import produces_gradients
from compiler.graph import build_backend
from compiler.ranks import CompileShare

from ..config import DDPCompileConfig
from ..in_backward.reducer import grads_in_buckets
from . import regional, split, whole
from .base import Built, Setup, caps_from_ddp
from .rules import RULES, Rules
from .traced.build import build as build_traced
from .traced.backward import check_update
from .traced.plan import fallback_reason

log = logging.getLogger(__name__)

__all__ = ["STRATEGIES", "Built", "Setup", "Strategy", "caps_from_ddp", "ddp_backend", "strategy_for"]


def _update_on_reducer(ddp_model: DistributedDataParallel, config: DDPCompileConfig) -> None:
    """``optimizer=`` under DDP's reducer: every gradient in its bucket before DDP's first iteration."""
    grads_in_buckets(ddp_model, rebuild_now=True)


@dataclass(frozen=True)
class Strategy:
    """One entry of the table.

    Attributes:
        rules: what it takes and refuses (``rules.RULES``).
        build: ``(setup, backend) -> Built``, in the strategy's own module.
        fallback: why it cannot run on a given DDP model, in which case ``compile_ddp`` runs
            ``"split"`` with a warning that says so; None where it runs on any.
        prepare_update: what ``optimizer=`` needs of the DDP model before it is converted,
            raising ``SettingError`` for an optimizer the strategy cannot update in backward.
    """

    rules: Rules
    build: Callable[[Setup, Callable], Built]
    fallback: Callable[[DistributedDataParallel], str | None] | None = None
    prepare_update: Callable[[DistributedDataParallel, DDPCompileConfig], None] = _update_on_reducer


STRATEGIES: dict[str, Strategy] = {
    "split": Strategy(RULES["split"], split.build),
    "whole": Strategy(RULES["whole"], whole.build),
    "regional": Strategy(RULES["regional"], regional.build),
    "traced": Strategy(RULES["traced"], build_traced, fallback=fallback_reason, prepare_update=check_update),
}


def strategy_for(ddp_model: DistributedDataParallel, asked: str) -> tuple[str, str | None]:
    """``(strategy, why)``: the strategy ``compile_ddp`` runs for ``asked`` on ``ddp_model``, and
    why it is ``"split"`` instead where the asked one's ``fallback`` refuses the model (else None)."""
    fallback = STRATEGIES[asked].fallback
    why = fallback(ddp_model) if fallback is not None else None
    return ("split", why) if why is not None else (asked, None)


def ddp_backend(setup: Setup, strategy: str, share: CompileShare | None, backward_with_forward: bool) -> Built:
    """The dynamo backend of ``setup.ddp_model`` under ``strategy`` (a key of ``STRATEGIES``),
    built by ``compiler.graph.build_backend`` (Note [Backend wrapping order]); the barrier holds
    for the graphs that produce gradients, whose all-reduces follow them."""
    built: list[Built] = []

    def transform(backend: Callable) -> Callable:
        built.append(STRATEGIES[strategy].build(setup, backend))
        return built[0].backend

    backend = build_backend(setup.config.resolve_backend(), share=share, backward_with_forward=backward_with_forward,
                            transform=transform, wrap_backend=setup.config.wrap_backend,
                            barrier_if=produces_gradients)
    return dataclasses.replace(built[0], backend=backend)
