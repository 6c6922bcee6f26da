"""The import contracts in pyproject.toml ([tool.importlinter]) hold: a wrong
import (the core reaching into DDP, FSDP, Hydra or the launcher) fails here. Their layers
forbid a cycle between layers; ``test_no_import_cycle`` forbids one anywhere, between any two
modules of the repository's packages."""

import ast
import graphlib
import logging
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _import_graph() -> dict[str, set[str]]:
    """Each module of ``LIBRARIES`` -> the modules of ``LIBRARIES`` it imports, read from the sources
    (every import statement: at module level, in a function, under TYPE_CHECKING). Importing
    ``a.b.c`` runs ``a/__init__`` first, but that is Python's order, not a dependency: only the
    module named (or the module ``from X import name`` takes ``name`` from) is an edge."""
    paths = {_module_name(p): p for package in LIBRARIES for p in (ROOT / package).rglob("*.py")}

    def known(dotted: str) -> str | None:  # the longest prefix of ``dotted`` that is one of ours
        while dotted and dotted not in paths:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, *([base] if base else [])])
                edges.update(known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in paths else known(base)
                             for alias in node.names)
        edges.discard(None)
        edges.discard(module)
    return graph


def test_no_import_cycle():
    graph = _import_graph()
    assert {"compiler", "ddp_opt.api", "launch.train", "benchmarks.studies.lightning_compare",
            "tools.torch_matrix"} <= set(graph), "the graph lost modules it should hold"
    assert "benchmarks.studies.lightning_modes" in graph["benchmarks.studies.lightning_fits"]
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        cycle = e.args[1]
        pytest.fail(f"import cycle: {' -> '.join(cycle)}. Move what the modules share into one of them or into a "
                    "third module that both import, so that the imports run one way.")


# What code outside compiler may import of it (compiler/__init__.py): the package's public names, a
# role's subpackage (its names, never a module below it) or torch_release; and from a package's
# own _torch_internals module, compiler's _torch_internals (the private torch accesses they share).
COMPILER_DOORS = {"compiler", "compiler.graph", "compiler.cache", "compiler.ranks", "compiler.torch_release"}


def test_outside_code_imports_compiler_through_its_doors():
    graph = _import_graph()
    through_a_wall = sorted(
        f"{module} imports {target}" for module, edges in graph.items() if not module.startswith("compiler")
        for target in edges if target.startswith("compiler") and target not in COMPILER_DOORS
        and not (target == "compiler._torch_internals" and module.endswith("._torch_internals")))
    assert not through_a_wall, (
        "code outside compiler imports a module inside it: " + "; ".join(through_a_wall) + ". Import the name from "
        "compiler, or from its role's subpackage (compiler.graph, compiler.cache, compiler.ranks; add it to that "
        "subpackage's __all__ if it is missing), or read a private torch name through the package's own "
        "_torch_internals.")
    assert len([p for p in (ROOT / "compiler").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()]) <= 10, \
        "compiler/ holds more than 10 top-level modules and subpackages: file the new one under its role"


@pytest.mark.parametrize("role", ["graph", "cache", "ranks"])
def test_each_role_exports_what_it_imports(role):
    import importlib
    package = importlib.import_module(f"compiler.{role}")
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert not missing, f"compiler.{role}.__all__ names what it does not import: {missing}"
