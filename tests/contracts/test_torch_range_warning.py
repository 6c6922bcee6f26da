"""A torch newer than every release the contract tests ran on installs and runs, and the first
compile says, in one line, what has not been checked on it and how to check it."""

import logging
import re
from pathlib import Path

import pytest
import torch

import compiler.torch_release as release
from compiler import CompileOptions, resolve_backend

UNTESTED = (
    r"^torch 2\.16\.0 is newer than the releases the toolkit's contract tests ran on \(2\.11 to 2\.15\): the "
    r"private torch names read at import and the internals of the features known to vary are feature-detected "
    r"\(a missing one turns its feature off with a warning or refuses it\), but the "
    r"private torch accesses of compiler, ddp_opt, fsdp_opt and launch \(each package's _torch_internals\.py\) "
    r"have not been checked on it\. Run the contract tests against your torch from a checkout of the toolkit: "
    r"python -m pytest -q tests/contracts/test_torch_contracts\.py tests/contracts/test_torch_contracts_ddp\.py "
    r"tests/launch/test_launch_torch_internals\.py tests/contracts/test_torch_contracts_import\.py; report a failure "
    r"as an issue with the output\.$"
)


@pytest.fixture
def torch_release(monkeypatch, caplog):
    """Set the running torch's version string; a fresh process as far as the warning goes."""
    monkeypatch.setattr(release, "_warned", False)
    caplog.set_level(logging.WARNING, logger="compiler.torch_release")

    def set_version(version: str) -> None:
        monkeypatch.setattr(torch, "__version__", version)

    return set_version


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "compiler.torch_release"]


def test_a_newer_torch_is_named_once_at_the_first_compile(torch_release, caplog):
    torch_release("2.16.0")
    resolve_backend("aot_eager")
    CompileOptions(backend="eager").resolve_backend()  # a second entry point in the same process
    lines = _lines(caplog)
    assert len(lines) == 1, lines
    assert "\n" not in lines[0]
    assert re.match(UNTESTED, lines[0]), lines[0]


@pytest.mark.parametrize("version", ["2.11.0", "2.15.0+cu132", "2.13.0+cpu"])
def test_a_release_of_the_tested_range_says_nothing(torch_release, caplog, version):
    torch_release(version)
    resolve_backend("aot_eager")
    assert _lines(caplog) == []


def test_the_documented_command_is_the_one_the_warning_gives():
    page = (Path(__file__).resolve().parents[2] / "docs" / "getting-started.md").read_text()
    assert release.CONTRACT_TESTS_COMMAND in page
