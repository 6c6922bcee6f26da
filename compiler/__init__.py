"""Graph compiler core: backend resolution, graph splitting and lazy,
fault-tolerant per-partition compile. Knows nothing about DDP or FSDP."""

from .backends import BackendFn, BackendSpec, resolve_backend, valid_backend_names, valid_modes
from .partition import DYNAMO_CONTROL_FLOW, FALLBACKS, LazyPartition, PartitionRecord, compile_partitions
from .split import SplitGraph, ensure_tuple_output, split_graph

__all__ = [
    # backends
    "BackendFn",
    "BackendSpec",
    "resolve_backend",
    "valid_backend_names",
    "valid_modes",
    # splitting
    "SplitGraph",
    "split_graph",
    "ensure_tuple_output",
    # per-partition compile
    "DYNAMO_CONTROL_FLOW",
    "FALLBACKS",
    "LazyPartition",
    "PartitionRecord",
    "compile_partitions",
]
