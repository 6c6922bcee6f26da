"""What the running torch release has, and what the toolkit says about it.

- ``TESTED_TORCH``: the releases the contract tests ran on. The install requirement has no
  upper bound (``setup.cfg``), so a user's next torch installs and runs; what it has not had is
  a run of the contract tests. :func:`warn_if_torch_untested` says so once per process, at the
  first compile of any entry point (they all resolve their backend in
  :func:`compiler.graph.backends.resolve_backend`, which calls it), with the command that runs them.
- Features are gated by feature detection, never by the version number:
  :func:`warn_feature_off_once` says which feature is off on this release and why.
- Private names read when a module is imported go through :func:`at_import`
  (Note [Private names read at import]); the features that need them check when used.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["CONTRACT_TESTS_COMMAND", "TESTED_TORCH", "untested_torch_message", "warn_if_torch_untested",
           "torch_version", "torch_is_tested", "warn_feature_off_once", "at_import", "import_time_names",
           "missing_at_import", "warn_if_missing_at_import", "refuse_if_missing_at_import"]

# (major, minor) torch releases the contract tests ran on (the compatibility table in
# docs/getting-started.md, written by tools/torch_matrix); setup.cfg states the same range.
# Features are gated by feature detection, not by this.
TESTED_TORCH = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))

_features_off: set[str] = set()  # the features warn_feature_off_once named


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torch_is_tested() -> bool:
    """True when the running torch is one this toolkit was tested with."""
    return torch_version() in TESTED_TORCH


def warn_feature_off_once(feature: str, missing: list[str], consequence: str) -> None:
    """One warning per feature that cannot run on this torch: what is off, which internals it
    needs that this release lacks, and what happens instead."""
    if feature in _features_off:
        return
    _features_off.add(feature)
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TORCH)
    warnings.warn(
        f"{feature} is off on torch {torch.__version__}: it needs {', '.join(missing)}, which this release lacks, "
        f"so {consequence}. The toolkit's contract tests run on torch {tested}.",
        RuntimeWarning, stacklevel=3,
    )


# --- names read at import (Note [Private names read at import]) ----------------------------


IMPORT_TIME_NEEDS: dict[str, list[str]] = {}  # feature -> the dotted names it reads at import
MISSING_AT_IMPORT: set[str] = set()  # the dotted names this torch lacks


def _resolve(dotted: str) -> Any:
    """The object at ``dotted`` (``torch.a.b``, submodules imported as needed), or None."""
    parts = dotted.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if not hasattr(obj, "__path__"):  # not a package: nothing more to import
                return None
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                return None
    return obj


def at_import(dotted: str, feature: str) -> Any:
    """Note [Private names read at import]

    Background
        A private torch name read while a module is imported (a constant, a class base, an
        ``except`` tuple, a default argument) fails the import of the whole package on a torch
        that lacks it, long before the feature that needs it is asked for.

    Algorithm
        - Every such read goes through :func:`at_import` with the feature that needs the name:
          it returns the object, or None on a torch that lacks it. :data:`IMPORT_TIME_NEEDS`
          keeps, per feature, the names it reads this way; :data:`MISSING_AT_IMPORT` those this
          torch lacks.
        - The feature checks when it is used: :func:`warn_if_missing_at_import` turns it off
          with one warning (:func:`warn_feature_off_once`) where it can do without the name, and
          :func:`refuse_if_missing_at_import` raises (what, why, the fix) where it cannot.

    Notes
        - ``tests/contracts/test_torch_contracts_import.py`` deletes each name of
          :func:`import_time_names` in turn, imports ``compiler``, ``ddp_opt``, ``fsdp_opt``,
          ``launch.train`` (and the module that reads the name) afresh, and finds the name in
          :data:`MISSING_AT_IMPORT`; it also scans the sources for any other private torch read
          at module level, so a new one cannot bypass this.
        - ATen operators looked up at import (``torch.ops.aten._to_copy.default``) are not read
          this way: they are operators of the core ATen set, not Python internals.

    Returns the object torch keeps at ``dotted`` (``"torch._dynamo.exc.SkipFrame"``), None where
    this torch lacks it.
    """
    names = IMPORT_TIME_NEEDS.setdefault(feature, [])
    if dotted not in names:
        names.append(dotted)
    obj = _resolve(dotted)
    if obj is None:
        MISSING_AT_IMPORT.add(dotted)
    return obj


def import_time_names() -> list[str]:
    """Every private name read at import so far (the modules imported), sorted."""
    return sorted({name for names in IMPORT_TIME_NEEDS.values() for name in names})


def missing_at_import(feature: str) -> list[str]:
    """The names ``feature`` reads at import that this torch lacks; empty where it has them all."""
    return [name for name in IMPORT_TIME_NEEDS.get(feature, []) if name in MISSING_AT_IMPORT]


def warn_if_missing_at_import(feature: str, consequence: str) -> bool:
    """Warn once that ``feature`` is off where a name it reads at import is missing; True if so."""
    missing = missing_at_import(feature)
    if missing:
        warn_feature_off_once(feature, missing, consequence)
    return bool(missing)


def refuse_if_missing_at_import(feature: str, fix: str) -> None:
    """Raise RuntimeError (what is missing, why ``feature`` cannot run, ``fix``) where a name it
    reads at import is missing."""
    missing = missing_at_import(feature)
    if missing:
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TORCH)
        raise RuntimeError(
            f"{feature} cannot run on torch {torch.__version__}: it needs {', '.join(missing)}, which this release "
            f"lacks. {fix} The toolkit's contract tests run on torch {tested}.")


# What a user runs from a checkout of the toolkit (docs/getting-started.md, "PyTorch releases").
CONTRACT_TESTS_COMMAND = ("python -m pytest -q tests/contracts/test_torch_contracts.py "
                          "tests/contracts/test_torch_contracts_ddp.py tests/launch/test_launch_torch_internals.py "
                          "tests/contracts/test_torch_contracts_import.py")

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
        f"({first[0]}.{first[1]} to {last[0]}.{last[1]}): the private torch names read at import and the "
        "internals of the features known to vary are feature-detected (a missing one turns its feature off with a "
        "warning or refuses it), but the private torch accesses of compiler, ddp_opt, "
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
