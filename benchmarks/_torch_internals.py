"""Every private PyTorch name the benchmarks touch, in one place.

Each helper says in a comment what it relies on, so a PyTorch upgrade that moves
one of them breaks here, with a name to look up, and nowhere else. The rest of
``benchmarks`` uses only public torch APIs and these helpers.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import torch

# One definition each, in ddp_opt: the python reducer's switch, its compiled-autograd backward, its all-reduce.
from ddp_opt.strategies.traced._torch_internals import functional_all_reduce, python_reducer_ddp, traced_backward

__all__ = ["bf16_compress", "functional_all_reduce", "has_compile_on_one_rank", "graphs_compiled",
           "cache_counts", "inductor_cache_at", "room_for_compiled_copies", "BuiltinBuckets",
           "python_reducer_ddp", "python_reducer_step"]

# Relies on: Inductor reading its on-disk cache location from this environment variable.
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"

_CACHE_COUNTERS = {
    "aot_hit": ("aot_autograd", "autograd_cache_hit"),
    "aot_miss": ("aot_autograd", "autograd_cache_miss"),
    "aot_bypass": ("aot_autograd", "autograd_cache_bypass"),
    "fx_hit": ("inductor", "fxgraph_cache_hit"),
    "fx_miss": ("inductor", "fxgraph_cache_miss"),
    "fx_bypass": ("inductor", "fxgraph_cache_bypass"),
}


def _counters():
    # Relies on: torch._dynamo.utils.counters, dynamo's process-wide Counter of named events.
    from torch._dynamo.utils import counters

    return counters


def graphs_compiled() -> int:
    """Dynamo graphs compiled so far in this process."""
    # Relies on: the "stats"/"unique_graphs" entry of torch._dynamo.utils.counters.
    return int(_counters()["stats"]["unique_graphs"])


def cache_counts() -> dict[str, int]:
    """AOTAutograd and FX graph cache outcomes so far (hits, misses, bypasses)."""
    # Relies on: the "aot_autograd"/"autograd_cache_*" and "inductor"/"fxgraph_cache_*" counter names.
    counters = _counters()
    return {k: int(counters[group][name]) for k, (group, name) in _CACHE_COUNTERS.items()}


@contextlib.contextmanager
def inductor_cache_at(path: str) -> Iterator[None]:
    """Point Inductor at ``path`` for the block, with its in-process caches cleared first,
    so that a compile reads and fills only that directory."""
    # Relies on: torch._inductor.utils.clear_caches, which empties Inductor's registered in-memory caches.
    from torch._inductor.utils import clear_caches

    clear_caches()
    old = os.environ.get(INDUCTOR_CACHE_ENV)
    os.environ[INDUCTOR_CACHE_ENV] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(INDUCTOR_CACHE_ENV, None)
        else:
            os.environ[INDUCTOR_CACHE_ENV] = old


def room_for_compiled_copies():
    """Recompile limits high enough for several compiled copies of one model in a process
    (the copies share their code objects, so dynamo counts them as recompiles)."""
    # Relies on: torch._dynamo.config.patch and its recompile_limit / accumulated_recompile_limit settings.
    return torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024)


class BuiltinBuckets(logging.Handler):
    """Reads the bucket count PyTorch's splitter (DDPOptimizer) logs at INFO when it splits."""

    # Relies on: the logger name of torch/_dynamo/backends/distributed.py and its log line
    # "DDPOptimizer used bucket cap %s and created %d buckets" (the count is the second argument).
    LOGGER = "torch._dynamo.backends.distributed"
    MESSAGE = "DDPOptimizer used bucket cap"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.MESSAGE in str(record.msg) and len(record.args or ()) >= 2:
            self.counts.append(int(record.args[1]))

    @contextlib.contextmanager
    def listening(self) -> Iterator[None]:
        logger = logging.getLogger(self.LOGGER)
        old_level, old_handlers, old_propagate = logger.level, logger.handlers, logger.propagate
        # Only this handler, for this call: keeps the INFO line off torch's console handler.
        logger.handlers, logger.propagate = [self], False
        logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            logger.handlers, logger.propagate = old_handlers, old_propagate
            logger.setLevel(old_level)


# --- PyTorch's compiled-autograd reducer (the benchmark's compiled_autograd mode) -----------


@contextlib.contextmanager
def python_reducer_step(backend, bucket_cap_mb: float) -> Iterator[None]:
    """One step of a python-reducer DDP: compiled autograd on (its backward graph, with the
    reducer's all-reduces traced into it, compiled with ``backend``), and Inductor's own
    fusion of those all-reduces into buckets of ``bucket_cap_mb`` (which DDP's __init__
    sets process-wide; scoped here to this mode's steps, so several caps can run side by
    side). The context is ddp_opt's (``traced_backward``), with PyTorch's default passes."""

    def compiler_fn(gm):
        return torch.compile(gm, backend=backend, fullgraph=True)

    with traced_backward(compiler_fn, bucket_size_mb=bucket_cap_mb):
        yield


def has_compile_on_one_rank() -> bool:
    """Whether this torch has ``torch.compiler.config.compile_on_one_rank`` (2.14+), PyTorch's
    switch that keeps ranks and devices out of compiled graphs (env TORCH_COMPILE_ON_ONE_RANK)."""
    config = getattr(torch.compiler, "config", None)
    return config is not None and hasattr(config, "compile_on_one_rank")


def bf16_compress(state, bucket):
    # Relies on: default_hooks._compress_hook(dtype, process_group, bucket), the body of DDP's
    # bf16_compress_hook (cast, divide by the world size, all-reduce, copy back into the bucket).
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, state, bucket)
