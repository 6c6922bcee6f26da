"""Every private torch name the launcher uses, in one place.

These are ``torch._dynamo`` names with no public equivalent in torch 2.11-2.13, and
torchrun's Python side (``torch.distributed.run``: its parser and ``run``, which only the
``torchrun`` command documents; the agent's ``ChildFailedError`` and ``SignalException``),
which ``distcompile-train`` runs in its own process (``launch.runtime.elastic``). Each
function says what it relies on, so that a torch upgrade that moves one breaks here,
visibly, and nowhere else.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

# One definition each, in the core: dynamo's recompile limit (torch._dynamo.config.recompile_limit), and
# the names read at import (Note [Private names read at import]).
from compiler._torch_internals import at_import, recompile_limit, refuse_if_missing_at_import

__all__ = ["RecompileError", "refuse_no_recompile", "error_on_recompile", "mark_dynamic", "recompile_limit",
           "AgentSignalled", "FailedWorker", "torchrun_parser", "torchrun_args", "torchrun_sizes", "run_torchrun"]

# Raised by dynamo instead of recompiling a frame while `error_on_recompile` is set; None where this
# torch lacks it: train.no_recompile_after_warmup=true is then refused (refuse_no_recompile).
NO_RECOMPILE = "train.no_recompile_after_warmup=true"
RecompileError = at_import("torch._dynamo.exc.RecompileError", NO_RECOMPILE)


def refuse_no_recompile() -> None:
    """Raise RuntimeError where this torch lacks what ``train.no_recompile_after_warmup`` needs."""
    refuse_if_missing_at_import(NO_RECOMPILE, "Set train.no_recompile_after_warmup=false to allow recompiles "
                                "(the launcher then counts them), or install a torch release the contract tests "
                                "ran on.")


@contextlib.contextmanager
def error_on_recompile() -> Iterator[None]:
    """Make a recompile raise :data:`RecompileError` inside the block only
    (``torch._dynamo.config.patch(error_on_recompile=True)``, scoped, not process-wide)."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Compile ``tensor``'s axis ``dim`` as a symbolic size from the first graph on
    (``torch._dynamo.mark_dynamic``; ``torch.compiler`` has no public spelling of it)."""
    torch._dynamo.mark_dynamic(tensor, dim)


# --- torchrun's agent in this process (launch.runtime.elastic) ---------------------------


class AgentSignalled(Exception):
    """torchrun's agent got a termination signal (its ``SignalException``) and stopped the workers."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


@dataclass(frozen=True)
class FailedWorker:
    """One failed worker, as torchrun's ``ProcessFailure`` reports it: ``exitcode`` is negative
    for a signal; ``error_file`` is the worker's ``TORCHELASTIC_ERROR_FILE``, None when it wrote none;
    ``record`` that file's JSON."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    error_file: str | None
    record: dict[str, Any]


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (``torch.distributed.run.get_args_parser``): its flags, and whether each
    takes a value (``nargs == 0`` for the switches such as ``--standalone``)."""
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def torchrun_args(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed as the ``torchrun`` command parses it (``torch.distributed.run.parse_args``):
    flags, then ``training_script`` and ``training_script_args``."""
    from torch.distributed.run import parse_args

    return parse_args(list(argv))


def torchrun_sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """``(min_nodes, max_nodes, nproc_per_node)`` as torchrun reads ``--nnodes`` (``N`` or
    ``MIN:MAX``) and ``--nproc-per-node`` (a number, or ``cpu``/``gpu``/``auto``), through its
    ``parse_min_max_nnodes`` and ``determine_local_world_size``.

    Raises:
        ValueError: a value torchrun cannot read.
    """
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    try:
        lo, hi = parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"--nnodes={args.nnodes!r}: {e}") from None
    try:
        nproc = determine_local_world_size(args.nproc_per_node)
    except ValueError as e:
        raise ValueError(f"--nproc-per-node={args.nproc_per_node!r}: {e}") from None
    return lo, hi, nproc


def run_torchrun(args: argparse.Namespace) -> list[FailedWorker]:
    """What ``torchrun ARGS`` does, in this process (``torch.distributed.run.run``: the rendezvous,
    the elastic agent, its restarts), without its ``@record`` wrapper's traceback and table. Returns
    the failed workers of the last attempt (torchrun's ``ChildFailedError.failures``), [] on success.

    Raises:
        AgentSignalled: the agent got SIGTERM, SIGINT, SIGHUP or SIGQUIT (torchrun's
            ``SignalException``); it forwarded it to the workers and stopped them.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(args)
    except ChildFailedError as e:
        return [FailedWorker(rank, f.local_rank, f.pid, f.exitcode,
                             f.error_file if f.error_file and f.error_file != "<N/A>" else None,
                             f.error_file_data if isinstance(f.error_file_data, dict) else {})
                for rank, f in e.failures.items()]
    except SignalException as e:
        raise AgentSignalled(int(e.sigval)) from None
    return []
