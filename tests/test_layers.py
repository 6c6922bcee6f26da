"""The import contracts in pyproject.toml ([tool.importlinter]) hold: a wrong
import (the core reaching into DDP, FSDP, Hydra or the launcher) fails here."""

import logging
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("compiler", "ddp_opt", "fsdp_opt", "launch", "benchmarks", "tools")


def test_import_contracts_hold(capsys, monkeypatch):
    # import-linter's own command (lint-imports), run in this process. It configures logging
    # with dictConfig, which disables every logger that exists: restored for the tests after.
    from importlinter.cli import lint_imports

    monkeypatch.chdir(ROOT)
    loggers = [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled, root_level = {lg: lg.disabled for lg in loggers}, logging.root.level
    try:
        code = lint_imports(no_cache=True)
    finally:
        for lg, was in disabled.items():
            lg.disabled = was
        logging.root.setLevel(root_level)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "0 broken" in out


@pytest.mark.parametrize("package", LIBRARIES)
def test_no_library_module_is_over_400_lines(package):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / package).rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"{package}: modules over 400 lines (split them by job): {long}"
