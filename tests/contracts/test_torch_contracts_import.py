"""A torch that lacks a private name the toolkit reads at import still imports ``compiler``,
``ddp_opt``, ``fsdp_opt`` and ``launch.train``; the feature that needs the name turns itself off
with one warning, or refuses when used (Note [Private names read at import] in
``compiler.torch_release``).

The names come from one place: the ``at_import`` calls in the sources, found by reading them
(``_scan``), which must agree with what the imported packages registered. The same scan fails on
any other private torch name read at module level, so a new one cannot escape the deletion test.
Each deletion re-imports our packages in this process (no process is started): their modules
are taken out of ``sys.modules`` for the import and put back after it.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import importlib
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import fx

import compiler.torch_release as release

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("compiler", "ddp_opt", "fsdp_opt", "launch", "benchmarks")  # scanned, and re-imported afresh
ENTRY_POINTS = ("compiler", "ddp_opt", "fsdp_opt", "launch.train")  # must import on any torch of the range


# --- the sources: every private torch name read at module level -----------------------------


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in dotted.split("."))


class _ModuleLevel(ast.NodeVisitor):
    """What a module evaluates when it is imported: its statements, class bodies, decorators,
    default arguments, and annotations unless ``from __future__ import annotations`` (not
    function bodies, lambdas' bodies or ``if TYPE_CHECKING:`` blocks). Collects the private
    torch names read directly (``direct``) and those passed to ``at_import`` (``through``)."""

    def __init__(self, lazy_annotations: bool) -> None:
        self.lazy_annotations = lazy_annotations
        self.torch_names: dict[str, str] = {}  # a local name -> the torch path it is bound to
        self.direct: list[tuple[int, str]] = []
        self.through: list[tuple[int, str]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "torch":
                if _private(alias.name):
                    self.direct.append((node.lineno, f"import {alias.name}"))
                self.torch_names[alias.asname or "torch"] = alias.name if alias.asname else "torch"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module and node.module.split(".")[0] == "torch":
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                if _private(dotted):
                    self.direct.append((node.lineno, f"from {node.module} import {alias.name}"))
                self.torch_names[alias.asname or alias.name] = dotted

    def visit_Attribute(self, node: ast.Attribute) -> None:
        parts, base = [], node
        while isinstance(base, ast.Attribute):
            parts.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in self.torch_names:
            dotted = ".".join([self.torch_names[base.id], *reversed(parts)])
            # ATen operators (torch.ops.aten._to_copy) are the core ATen set, not Python internals.
            if _private(dotted) and not dotted.startswith("torch.ops.aten."):
                self.direct.append((node.lineno, dotted))
                return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name == "at_import":
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self.through.append((node.lineno, first.value))
            else:
                self.direct.append((node.lineno, "at_import with a name that is not a string literal"))
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            self.visit(node.test)
            for stmt in node.body:
                self.visit(stmt)
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for expr in [*node.decorator_list, *node.args.defaults, *(d for d in node.args.kw_defaults if d)]:
            self.visit(expr)
        if not self.lazy_annotations:
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]
            for expr in [*(a.annotation for a in args if a is not None and a.annotation), node.returns]:
                if expr is not None:
                    self.visit(expr)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for expr in [*node.args.defaults, *(d for d in node.args.kw_defaults if d)]:
            self.visit(expr)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)
        if not self.lazy_annotations:
            self.visit(node.annotation)


def _scan() -> tuple[list[str], dict[str, list[str]]]:
    """(each private torch name read directly at module level, as ``file:line: name``;
    each name read through ``at_import`` -> the modules that read it)."""
    direct, through = [], {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            lazy = any(isinstance(s, ast.ImportFrom) and s.module == "__future__"
                       and any(a.name == "annotations" for a in s.names) for s in tree.body)
            visitor = _ModuleLevel(lazy)
            for stmt in tree.body:
                visitor.visit(stmt)
            rel = path.relative_to(ROOT)
            module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            direct += [f"{rel}:{line}: {what}" for line, what in visitor.direct]
            for _, dotted in visitor.through:
                through.setdefault(dotted, []).append(module)
    return direct, through


DIRECT, THROUGH = _scan()


def test_no_private_torch_name_is_read_at_import_except_through_at_import():
    assert THROUGH, "the scan found no at_import call: it no longer reads the sources it should"
    assert not DIRECT, (
        "private torch names read when a module is imported, which fail the import on a torch that lacks them: "
        + "; ".join(DIRECT) + ". Read each through compiler._torch_internals.at_import(name, feature) and have the "
        "feature check when used (warn_if_missing_at_import / refuse_if_missing_at_import), or read it inside "
        "the function that needs it (Note [Private names read at import]).")


def test_the_names_the_packages_register_are_the_names_in_the_sources():
    for module in sorted({m for modules in THROUGH.values() for m in modules}):
        importlib.import_module(module)
    assert release.import_time_names() == sorted(THROUGH)
    assert not release.MISSING_AT_IMPORT, f"this torch ({torch.__version__}) lacks {release.MISSING_AT_IMPORT}"


# --- each name deleted in turn, the packages imported afresh ---------------------------------


@contextlib.contextmanager
def _fresh_packages() -> Iterator[None]:
    """Our packages imported afresh inside the block (none of their modules in ``sys.modules``);
    the modules of before put back after it, so the rest of the session sees them unchanged."""
    ours = lambda name: name.split(".")[0] in PACKAGES  # noqa: E731
    before = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in before:
        del sys.modules[name]
    register = atexit.register
    atexit.register = lambda fn, *args, **kwargs: fn  # a module's exit handler: the old module's stays
    try:
        yield
    finally:
        atexit.register = register
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(before)


@pytest.mark.parametrize("dotted", sorted(THROUGH))
def test_the_packages_import_on_a_torch_without(dotted, monkeypatch):
    readers = THROUGH[dotted]
    for module in (*ENTRY_POINTS, *readers):  # torch's own modules loaded before the name goes
        importlib.import_module(module)
    owner, name = dotted.rsplit(".", 1)
    monkeypatch.delattr(release._resolve(owner), name)
    with _fresh_packages():
        for module in (*ENTRY_POINTS, *readers):
            importlib.import_module(module)
        fresh = sys.modules["compiler.torch_release"]
        assert fresh is not release
        assert fresh.MISSING_AT_IMPORT == {dotted}
        assert any(dotted in names for names in fresh.IMPORT_TIME_NEEDS.values())


# --- what each feature does without its name ------------------------------------------------


@pytest.fixture
def without(monkeypatch):
    """Make this process's packages behave as on a torch that lacks the given names."""
    monkeypatch.setattr(release, "_features_off", set())

    def drop(*names: str) -> None:
        assert set(names) <= set(release.import_time_names()), names
        monkeypatch.setattr(release, "MISSING_AT_IMPORT", set(names))

    return drop


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _split():
    from compiler import split_graph

    gm = fx.symbolic_trace(_Two())
    return split_graph(gm, lambda node: 0 if node.name in ("a", "relu") else 1)


def test_without_fake_tensors_or_dynamo_counters_the_lazy_partition_compile_refuses(without):
    from compiler import compile_partitions

    split = _split()
    without("torch._dynamo.utils.counters")
    with pytest.raises(RuntimeError, match=r"^Lazy partition compile \(.*\) cannot run on torch .*: it needs "
                                           r"torch\._dynamo\.utils\.counters, which this release lacks\. Install a "
                                           r"torch release the contract tests ran on, or compile the graph without "
                                           r"splitting it\. The toolkit's contract tests run on torch 2\.11"):
        compile_partitions(split, lambda gm, inputs: gm.forward, [torch.randn(3, 4)])


def test_without_dynamos_restart_exception_its_signal_is_a_compile_failure_said_once(without):
    from compiler import compile_partitions

    without("torch._dynamo.exc.RestartAnalysis")
    with pytest.warns(RuntimeWarning, match=r"^Letting dynamo's restart and skip signals through a backend is off "
                                            r"on torch .*: it needs torch\._dynamo\.exc\.RestartAnalysis, which this "
                                            r"release lacks, so such a signal counts as a compile failure"):
        records = compile_partitions(_split(), lambda gm, inputs: gm.forward, [torch.randn(3, 4)])
    assert [r.status for r in records] == ["compiled", "compiled"]


def test_without_the_autocast_functions_split_graph_warns_that_it_does_not_see_regions(without):
    without("torch.amp._enter_autocast")
    with pytest.warns(RuntimeWarning, match=r"^Keeping autocast and grad-mode regions whole when a graph is split "
                                            r"is off on torch .*: it needs torch\.amp\._enter_autocast"):
        split = _split()
    assert split.partition_names == ["submod_0", "submod_1"]


def test_without_the_inference_mode_functions_bucket_planning_warns(without):
    from ddp_opt.planning.buckets import BucketCaps, plan_buckets

    without("torch.autograd.grad_mode._exit_inference_mode")
    with pytest.warns(RuntimeWarning, match=r"^Recognising inference_mode regions in a captured graph is off on torch "
                                            r".*: it needs torch\.autograd\.grad_mode\._exit_inference_mode"):
        buckets = plan_buckets(fx.symbolic_trace(_Two()), BucketCaps(1 << 20, 1 << 20))
    assert buckets


def test_without_recompile_error_no_recompile_after_warmup_is_refused(without, tmp_path):
    from _jobs import composed

    from launch.checks.validate import validate
    from launch.config.schema import ConfigError
    from launch.runtime.recompiles import no_recompile

    without("torch._dynamo.exc.RecompileError")
    refused = (r"^train\.no_recompile_after_warmup=true cannot run on torch .*: it needs "
               r"torch\._dynamo\.exc\.RecompileError, which this release lacks\. Set "
               r"train\.no_recompile_after_warmup=false to allow recompiles")
    cfg = composed("train.no_recompile_after_warmup=true", f"train.checkpoint_dir={tmp_path / 'ckpt'}")
    with pytest.raises(ConfigError, match=refused):
        validate(cfg, world_size=2)
    with pytest.raises(RuntimeError, match=refused), no_recompile(True, {}, 3, []):
        pass
    with no_recompile(False, {}, 3, []):  # off: nothing is needed
        pass


def _private_torch_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Each ``torch.a._b`` attribute chain and ``from torch.a._b import`` / ``import torch._b`` in ``tree``
    (anywhere: at module level or in a function), as (line, dotted name); ``parent`` set on its nodes."""
    found = []
    for node in ast.walk(tree):
        dotted = None
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            dotted = node.module
        elif isinstance(node, ast.Import):
            dotted = next((a.name for a in node.names if a.name.startswith("torch.")), None)
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            parts, inner = [], node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch":
                dotted = ".".join(["torch", *reversed(parts)])
        if dotted and dotted.split(".")[0] == "torch" and not dotted.startswith("torch.ops.") and any(
                p.startswith("_") and not p.startswith("__") for p in dotted.split(".")[1:]):
            found.append((node.lineno, dotted))
    return found


def test_private_torch_names_are_read_only_in_each_packages_one_place():
    # contributing: every private torch access in one place per library package, its _torch_internals
    # module(s) (compiler.torch_release, which feature-detects them, with them). Aten ops (torch.ops.aten._to_copy)
    # are operator names, not private Python; the benchmarks are no library and have no such place.
    outside = []
    for package in ("compiler", "ddp_opt", "fsdp_opt", "launch"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name in ("_torch_internals.py", "torch_release.py"):
                continue
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                for child in ast.iter_child_nodes(node):
                    child.parent = node
            outside += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in _private_torch_reads(tree)]
    assert not outside, ("private torch names read outside the packages' _torch_internals modules: "
                         + "; ".join(outside) + ". Add a function to the package's _torch_internals.py that reads "
                         "it, with a comment naming what it reaches and why, and call that.")
