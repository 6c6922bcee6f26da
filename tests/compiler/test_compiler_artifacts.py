"""Damaged kernels in Inductor's on-disk cache (Note [Damaged cache artifacts]): found
without loading them and removed, also by a partition whose compile failed on one."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import fx

from compiler import PartitionRecord
from compiler.graph.partition import LazyPartition
from compiler.cache.artifacts import damaged_kernel_in, damaged_kernels, remove_damaged_kernels

# A small real shared library to damage.
LIBRARY = next(Path(torch.__file__).parent.glob("_C.*.so"))


def _kernel(root: Path, name: str, keep: int | None = None) -> Path:
    path = root / name[:2] / name
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(LIBRARY, path)
    if keep is not None:
        path.write_bytes(path.read_bytes()[:keep])
    return path


def test_truncated_kernels_are_found_without_loading_them(tmp_path):
    whole = _kernel(tmp_path, "whole.so")
    half = _kernel(tmp_path, "half.so", keep=LIBRARY.stat().st_size // 2)
    stub = _kernel(tmp_path, "stub.so", keep=100)
    empty = _kernel(tmp_path, "empty.so", keep=0)
    found = dict(damaged_kernels(tmp_path))
    assert whole not in found
    assert set(found) == {half, stub, empty}
    assert found[half].startswith(f"truncated ({LIBRARY.stat().st_size // 2} bytes, its headers reach byte")
    assert found[empty] == "no ELF header (0 bytes)"
    assert remove_damaged_kernels(tmp_path) == sorted([empty, half, stub])
    assert [p.name for p in tmp_path.rglob("*.so")] == ["whole.so"]


def _graph() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(torch.relu, (x,)),))
    return fx.GraphModule(torch.nn.Module(), g)


def _failing_once(error: BaseException):
    calls = []

    def backend(gm, args):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return gm

    return backend, calls


def test_a_partition_that_failed_on_a_damaged_kernel_removes_the_damaged_kernels(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    damaged = _kernel(tmp_path, "cpp_fused_0.so", keep=100)
    other = _kernel(tmp_path, "cpp_fused_1.so", keep=50)
    whole = _kernel(tmp_path, "cpp_fused_2.so")
    backend, calls = _failing_once(ImportError(f"{damaged}: file too short"))
    record = PartitionRecord(0, "submod_0")
    LazyPartition(_graph(), backend, record).compile([torch.ones(2)])
    # Eager for this run (see the Note for why not again in this process); the next start rebuilds.
    assert (record.status, len(calls)) == ("eager", 1)
    assert (damaged.exists(), other.exists(), whole.exists()) == (False, False, True)
    assert record.repaired == f"{damaged}: removed 2 damaged kernel(s) under {tmp_path}"
    assert any("failed on a damaged kernel in Inductor's cache" in r.getMessage() and str(damaged) in r.getMessage()
               and "the next start rebuilds them" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize("where", ["healthy", "elsewhere"])
def test_other_failures_are_not_retried(tmp_path, monkeypatch, where):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    path = _kernel(tmp_path / "inductor", "k.so") if where == "healthy" else _kernel(tmp_path / "other", "k.so", 100)
    backend, calls = _failing_once(ImportError(f"{path}: undefined symbol: foo"))
    record = PartitionRecord(0, "submod_0")
    LazyPartition(_graph(), backend, record).compile([torch.ones(2)])
    assert (record.status, len(calls), record.repaired) == ("eager", 1, None)
    assert damaged_kernel_in(ImportError(str(path))) is None
