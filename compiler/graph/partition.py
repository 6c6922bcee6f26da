"""Lazy, fault-tolerant compilation of the partitions of a split graph.

Note [Lazy partition compile]

Background
    A graph split into N partitions needs N backend compiles, each with example
    inputs shaped like what the partition will see: symbolic sizes for dynamic axes,
    and the strides the *compiled* previous partition produces.

Algorithm
    - Each partition is a :class:`LazyPartition`, compiled with the inputs of its
      first call. :func:`compile_partitions` makes that call with fake tensors inside
      dynamo's tracing context, in graph order, so partition i's fake outputs are
      partition i+1's example inputs.
    - AOTAutograd refuses to cache a graph compiled with ``fakify_first_call``, which
      would make every restart re-run every partition's joint trace. With
      ``aot_cache`` (the default when Inductor's and AOTAutograd's caches are on), a
      partition is compiled without it and the next partition's fake inputs come
      from running its FX graph on fakes (:func:`run_on_fakes`); Inductor keeps eager
      output strides, and its input stride asserts fail loudly if they ever differ.
    - AOTAutograd compiles backward lazily, last partition first, reading each
      partition's forward metadata from the tracing context's ``ddp_optimizer_ctx``.
      We fill it as PyTorch's splitter does, but only for partitions AOTAutograd
      really traced: a cache hit brings its backward along, and an entry for it would
      hand later partitions the wrong metadata.
    - A partition whose compile raises runs eagerly and the others stay compiled
      (``fallback="raise"`` re-raises); a damaged kernel file in Inductor's cache is
      removed first, so the next start rebuilds it (Note [Damaged cache artifacts]).

Notes
    - Only errors of a partition's forward compile are caught; a lazy backward compile
      that fails propagates.
    - Every outcome is kept in :class:`PartitionRecord`; ``TORCH_LOGS="+compiler.graph.partition"``
      shows each partition's compile time.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

import torch
from torch import fx

from .. import _torch_internals as _ti
from .._torch_internals import DYNAMO_CONTROL_FLOW, FakeTensor, FakeTensorMode, aot_cache_enabled
from ..cache import artifacts
from .backends import BackendFn
from .progress import compiling
from .split import SplitGraph, ensure_tuple_output

log = logging.getLogger(__name__)

__all__ = ["DYNAMO_CONTROL_FLOW", "FALLBACKS", "LazyPartition", "PartitionRecord", "aot_cache_enabled", "compile_partitions",
           "run_on_fakes"]

FALLBACKS = ("warn", "raise")

# DYNAMO_CONTROL_FLOW: dynamo's restart/skip exceptions, not compile failures;
# they must reach dynamo (a fallback would hide a restart and leave the
# partition eager for no reason).


@dataclass
class PartitionRecord:
    """What happened to one partition. ``status``: pending, compiled or eager. ``shared``: another
    rank claimed its compile (Note [Shared compile]); this rank loads it once published (or
    compiles it itself if the publication fails), so ``compile_s`` is the wait-free hand-off."""

    index: int
    name: str
    status: str = "pending"
    compile_s: float = 0.0
    error: str | None = None
    # A damaged cached kernel the compile failed on, and what was removed
    # (Note [Damaged cache artifacts]).
    repaired: str | None = None
    shared: bool = False


class LazyPartition(torch.nn.Module):
    """One partition: compiled with the inputs of its first call, eager if that fails."""

    def __init__(
        self,
        graph_module: fx.GraphModule,
        backend: BackendFn,
        record: PartitionRecord,
        fallback: str = "warn",
        compile_reason: str | None = None,
    ) -> None:
        super().__init__()
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}.")
        self.graph_module = graph_module
        self.record = record
        self._backend = backend
        self._fallback = fallback
        self._unwrap = ensure_tuple_output(graph_module)
        self._fn: Callable[..., Any] | None = None
        if compile_reason is not None:  # shown by dynamo's explain/logging as this break's reason
            _ti.set_compile_reason(graph_module, compile_reason, __file__)

    @property
    def compiled(self) -> bool:
        return self.record.status == "compiled"

    def compile(self, args: list[Any]) -> None:
        """Compile with ``args`` (fake or real); on failure fall back to eager."""
        t0 = time.perf_counter()
        try:
            self._fn = self._backend(self.graph_module, list(args))
            self.record.status = "compiled"
        except DYNAMO_CONTROL_FLOW:
            raise
        except Exception as e:  # noqa: BLE001 - any backend failure is a fallback case
            self._fn = self._fall_back(e)
        # A compile another rank owns finishes later (Note [Shared compile]); if it fails then, fall back then.
        later = getattr(self._fn, "failure_callbacks", None)
        if later is not None:
            later.append(self._fall_back)
            self.record.shared = True
        self.record.compile_s = time.perf_counter() - t0

    def _fall_back(self, e: Exception) -> Callable[..., Any]:
        """The eager graph in place of a failed compile (re-raises with ``fallback="raise"``)."""
        self._remove_damaged_kernels(e)
        if self._fallback == "raise":
            raise e
        self._fn = self.graph_module
        self.record.status = "eager"
        self.record.error = f"{type(e).__name__}: {e}"
        log.warning(
            "Compiling partition %d (%s) failed; it will run eagerly and the other partitions stay "
            "compiled. Error: %s. Pass fallback='raise' to stop on this error instead.",
            self.record.index, self.record.name, self.record.error,
        )
        return self.graph_module

    def _remove_damaged_kernels(self, error: Exception) -> None:
        """When ``error`` names a damaged kernel file in Inductor's cache, remove the
        damaged kernels there, so that the next start rebuilds them (Note [Damaged cache
        artifacts] in ``compiler.cache.artifacts``; why not compile again in this process)."""
        damaged = artifacts.damaged_kernel_in(error)
        if damaged is None:
            return
        root = artifacts.inductor_cache_dir()
        removed = artifacts.remove_damaged_kernels(root)
        self.record.repaired = f"{damaged}: removed {len(removed)} damaged kernel(s) under {root}"
        log.warning(
            "Compiling partition %d (%s) failed on a damaged kernel in Inductor's cache (%s); removed %d damaged "
            "kernel(s) under %s: the next start rebuilds them from their cached source.",
            self.record.index, self.record.name, damaged, len(removed), root,
        )

    def forward(self, *args: Any) -> Any:
        if self._fn is None:
            self.compile(list(args))
        if _ti.profiler_enabled() and not any(isinstance(a, FakeTensor) for a in args):
            out = self._profiled(args)
        else:
            out = self._fn(*args)
        if self._unwrap and isinstance(out, (tuple, list)):
            return out[0]
        return out

    def _profiled(self, args: tuple) -> Any:
        """Run under torch.profiler with labels (Note [Partition labels])."""
        name = f"partition {self.record.index}"
        with torch.profiler.record_function(f"{name} forward"):
            out = self._fn(*args)
        _label_backward(out, f"{name} backward")
        return out


def _label_backward(out: Any, label: str) -> None:
    """Note [Partition labels]

    Under torch.profiler each partition's forward runs inside a
    ``record_function("partition i forward")`` range, and its backward inside
    ``"partition i backward"``: the range is opened by a pre-hook and closed by a
    post-hook of the autograd node that runs the partition's backward (the node
    its outputs share; AOTAutograd's ``CompiledFunctionBackward``), so it spans
    exactly that backward, and a profile can put each partition on its own row
    next to the gradient all-reduces. Nothing is labelled when several
    unrelated nodes produce the outputs (a partition run eagerly); without a
    profiler none of this runs."""
    tensors = out if isinstance(out, (tuple, list)) else (out,)
    nodes = {id(t.grad_fn): t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    compiled = [n for n in nodes.values() if "CompiledFunction" in n.name()]
    node = compiled[0] if len(compiled) == 1 else next(iter(nodes.values())) if len(nodes) == 1 else None
    if node is None:
        return
    span = torch.profiler.record_function(label)

    def enter(grad_outputs: Any) -> None:
        span.__enter__()

    def leave(grad_inputs: Any, grad_outputs: Any) -> None:
        span.__exit__(None, None, None)

    node.register_prehook(enter)
    node.register_hook(leave)


def compile_partitions(
    split: SplitGraph,
    backend: BackendFn,
    example_inputs: list[Any],
    *,
    fallback: str = "warn",
    compile_reason: str | None = None,
    aot_cache: bool | None = None,
) -> list[PartitionRecord]:
    """Replace each partition of ``split`` by a :class:`LazyPartition` and make its
    first call (the compile) with fake inputs propagated through the outer graph.

    Args:
        split: the split graph; modified in place.
        backend: the dynamo backend each partition is compiled with.
        example_inputs: the outer graph's example inputs (fake under dynamo).
        fallback: ``"warn"`` runs a failing partition eagerly, ``"raise"`` re-raises.
        compile_reason: text recorded as each partition's graph-break reason.
        aot_cache: compile without ``fakify_first_call`` so that AOTAutograd can
            cache each partition (see the Note); None: on when Inductor's FX
            graph cache and AOTAutograd's cache are both enabled.

    Returns:
        One :class:`PartitionRecord` per partition, in execution order.
    """
    _ti.refuse_if_missing_at_import(_ti.LAZY_COMPILE, "Install a torch release the contract tests ran on, or "
                                    "compile the graph without splitting it.")
    _ti.warn_if_missing_at_import(_ti.CONTROL_FLOW, "such a signal counts as a compile failure: the partition "
                                  "runs eagerly")
    records = []
    for i, name in enumerate(split.partition_names):
        record = PartitionRecord(index=i, name=name)
        lazy = LazyPartition(getattr(split.gm, name), backend, record, fallback, compile_reason)
        split.gm.delete_submodule(name)
        split.gm.add_submodule(name, lazy)
        records.append(record)
    split.gm.recompile()

    fake_mode = _ti.detect_fake_mode(example_inputs) or FakeTensorMode()
    tracing = _ti.tracing_context()
    if tracing is not None:
        _ti.start_partition_metadata(tracing)
    if aot_cache is None:
        aot_cache = aot_cache_enabled()
    runner = _FirstCallRunner(split.gm, fake_mode, tracing, len(records), aot_cache)
    with _ti.no_saved_tensor_hooks_while_tracing():
        runner.run(*example_inputs)
    split.gm.recompile()
    return records


def run_on_fakes(gm: fx.GraphModule, args: tuple, fake_mode: FakeTensorMode) -> Any:
    """Run ``gm`` on fake ``args`` (inside ``fake_mode``) for its fake outputs.

    A graph that reads attributes (``get_attr``) or calls submodules runs on a
    fake deep copy, as PyTorch's own splitter runs every partition. Dynamo's
    graphs lift parameters and buffers to inputs, so their partitions usually
    have neither and run as they are: the copy cost ~30 ms a partition, a
    noticeable share of a warm restart.
    """
    if any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes):
        gm = _ti.fake_copy(gm, fake_mode)
    return gm(*args)


class _FirstCallRunner(fx.Interpreter):
    """Runs the outer graph on fake tensors; each LazyPartition compiles on its call."""

    def __init__(self, gm: fx.GraphModule, fake_mode: FakeTensorMode, tracing: Any, total: int,
                 aot_cache: bool = False) -> None:
        super().__init__(gm)
        self.aot_cache = aot_cache
        self.fake_mode = fake_mode
        self.tracing = tracing
        self.total = total
        self.t_start = time.perf_counter()

    def _fakify(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            return _ti.to_fake(value, self.fake_mode)
        return value

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        mod = self.fetch_attr(str(target))
        args = tuple(self._fakify(a) for a in args)
        if not isinstance(mod, LazyPartition):
            with self.fake_mode, mock.patch.object(self.fake_mode, "allow_non_fake_inputs", True):
                return _ti.fake_copy(mod, self.fake_mode)(*args, **kwargs)
        with ExitStack() as stack:
            if self.tracing is not None and not self.aot_cache:
                # Ask AOTAutograd to return fake outputs with the backend's real
                # strides on the compiled function's first call (the one below).
                _ti.set_fakify_first_call(self.tracing, True)
                stack.callback(_ti.set_fakify_first_call, self.tracing, False)
            aot_before, hits_before = _ti.aot_counts()
            log.debug("compiling partition %d/%d (%s)", mod.record.index + 1, self.total, mod.record.name)
            with compiling(f"partition {mod.record.index + 1}/{self.total} ({mod.record.name})"):
                mod.compile(list(args))
            if mod.record.shared:
                log.info("partition %d/%d is compiled by another rank: loaded from the shared compile (%.1fs elapsed)",
                         mod.record.index + 1, self.total, time.perf_counter() - self.t_start)
            else:
                log.info("partition %d/%d %s in %.1fs (%.1fs elapsed)", mod.record.index + 1, self.total,
                         mod.record.status, mod.record.compile_s, time.perf_counter() - self.t_start)
            aot_after, hits_after = _ti.aot_counts()
            went_through_aot, cache_hit = aot_after != aot_before, hits_after != hits_before
            with self.fake_mode, mock.patch.object(self.fake_mode, "allow_non_fake_inputs", True):
                if mod.compiled and went_through_aot and self.tracing is not None:
                    if not cache_hit:  # a traced partition: its backward compiles lazily
                        _ti.record_partition_metadata(self.tracing)
                    if not self.aot_cache:
                        return mod(*args)
                # No AOT first-call fakification: run the partition's FX graph itself
                # on fake tensors to get outputs for the next partition.
                out = run_on_fakes(mod.graph_module, args, self.fake_mode)
                if mod._unwrap and isinstance(out, (tuple, list)):
                    return out[0]
                return out
