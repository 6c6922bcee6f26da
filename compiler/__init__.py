"""Graph compiler core: backend resolution, graph splitting, lazy fault-tolerant
per-partition compile, regional (per-block) compile, the compile cache and
diagnostics. Knows nothing about DDP, FSDP or the launcher.

The names below are the public surface (at most 20). Their neighbours are imported from
their modules: ``compiler.backends`` (``valid_backend_names``, ``valid_modes``),
``compiler.split`` (``SplitGraph``), ``compiler.partition`` (``LazyPartition``,
``DYNAMO_CONTROL_FLOW``), ``compiler.cache`` (``CacheKey``), ``compiler.diagnose``
(``Report``)."""

from .backends import BackendFn, SettingError, resolve_backend
from .cache import CompileCache
from .diagnose import Diagnoser, size_guard
from .graph_kind import produces_gradients
from .options import CompileOptions
from .partition import FALLBACKS, PartitionRecord, compile_partitions
from .regional import block_containers, block_lists, check_blocks_setting, compile_blocks, find_blocks
from .settings_key import cache_settings, not_compiled
from .split import ensure_tuple_output, split_graph

__all__ = [
    # backends
    "BackendFn",
    "CompileOptions",
    "SettingError",
    "resolve_backend",
    # splitting
    "split_graph",
    "ensure_tuple_output",
    # per-partition compile
    "produces_gradients",
    "FALLBACKS",
    "PartitionRecord",
    "compile_partitions",
    # persistent compile cache
    "CompileCache",
    "cache_settings",
    "not_compiled",
    # diagnostics
    "Diagnoser",
    "size_guard",
    # regional compile (shared by ddp_opt and fsdp_opt)
    "find_blocks",
    "block_containers",
    "block_lists",
    "compile_blocks",
    "check_blocks_setting",
]
