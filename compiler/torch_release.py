"""The one line a run prints when its torch is newer than every release the contract tests ran on.

The install requirement has no upper bound (``setup.cfg``), so a user's next torch installs and
runs; what it has not had is a run of the contract tests. :func:`warn_if_torch_untested` says so
once per process, at the first compile of any entry point (they all resolve their backend in
:func:`compiler.backends.resolve_backend`, which calls it), with the command that runs them.
"""

from __future__ import annotations

import logging

import torch

from ._torch_internals import TESTED_TORCH, torch_version

log = logging.getLogger(__name__)

__all__ = ["CONTRACT_TESTS_COMMAND", "untested_torch_message", "warn_if_torch_untested"]

# What a user runs from a checkout of the toolkit (docs/getting-started.md, "PyTorch releases").
CONTRACT_TESTS_COMMAND = ("python -m pytest -q tests/test_torch_contracts.py tests/test_torch_contracts_ddp.py "
                          "tests/test_launch_torch_internals.py")

_warned = False


def untested_torch_message() -> str | None:
    """The warning for a torch newer than every release of ``TESTED_TORCH``, else None.

    Only newer releases are named: an older one is refused by the install requirement, and a
    release inside the range ran the contract tests.
    """
    if torch_version() <= max(TESTED_TORCH):
        return None
    first, last = min(TESTED_TORCH), max(TESTED_TORCH)
    return (
        f"torch {torch.__version__} is newer than the releases the toolkit's contract tests ran on "
        f"({first[0]}.{first[1]} to {last[0]}.{last[1]}): every private torch access is feature-detected and a "
        "missing one turns its feature off with a warning, but the private torch accesses of compiler, ddp_opt, "
        "fsdp_opt and launch (each package's _torch_internals.py) have not been checked on it. Run the contract "
        f"tests against your torch from a checkout of the toolkit: {CONTRACT_TESTS_COMMAND}; report a failure "
        "as an issue with the output."
    )


def warn_if_torch_untested() -> None:
    """Log :func:`untested_torch_message` once per process, when there is one."""
    global _warned
    if _warned:
        return
    _warned = True
    message = untested_torch_message()
    if message is not None:
        log.warning(message)
