"""Graph compiler core: backend resolution, graph splitting, lazy fault-tolerant
per-partition compile, regional (per-block) compile, the compile cache and
diagnostics. Knows nothing about DDP, FSDP or the launcher."""

from .backends import BackendFn, SettingError, resolve_backend, valid_backend_names, valid_modes
from .cache import CacheKey, CompileCache
from .diagnose import Diagnoser, Report, size_guard
from .graph_kind import produces_gradients
from .options import CompileOptions
from .partition import DYNAMO_CONTROL_FLOW, FALLBACKS, LazyPartition, PartitionRecord, compile_partitions
from .regional import block_containers, block_lists, check_blocks_setting, compile_blocks, find_blocks
from .settings_key import cache_settings, not_compiled
from .split import SplitGraph, ensure_tuple_output, split_graph

__all__ = [
    # backends
    "BackendFn",
    "CompileOptions",
    "SettingError",
    "resolve_backend",
    "valid_backend_names",
    "valid_modes",
    # splitting
    "SplitGraph",
    "split_graph",
    "ensure_tuple_output",
    # per-partition compile
    "produces_gradients",
    "DYNAMO_CONTROL_FLOW",
    "FALLBACKS",
    "LazyPartition",
    "PartitionRecord",
    "compile_partitions",
    # persistent compile cache
    "CacheKey",
    "CompileCache",
    "cache_settings",
    "not_compiled",
    # diagnostics
    "Diagnoser",
    "Report",
    "size_guard",
    # regional compile (shared by ddp_opt and fsdp_opt)
    "find_blocks",
    "block_containers",
    "block_lists",
    "compile_blocks",
    "check_blocks_setting",
]
