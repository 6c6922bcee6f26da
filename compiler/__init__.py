"""Graph compiler core. Knows nothing about DDP, FSDP or the launcher. Three roles, one
subpackage each, and the torch access they share at the top:

- ``compiler.graph``: backend resolution, graph splitting, lazy fault-tolerant per-partition
  compile, regional (per-block) compile, the backend wrapper chain, compile progress and
  diagnostics;
- ``compiler.cache``: the persistent compile cache, its keys, artifacts and kernels, and what
  the job trusts on disk;
- ``compiler.ranks``: what the ranks of a job do together: the shared compile and its secret,
  the step gate, peer liveness, the measured link;
- ``_torch_internals`` (every private torch access of the package) and ``torch_release``
  (what the installed torch offers, Note [Private names read at import]).

The names below are the public surface (at most 20). Code outside ``compiler`` imports these,
or a role's names from its subpackage (each subpackage's ``__all__``), never a module below a
subpackage (pinned by tests/contracts/test_layers.py); a package's own ``_torch_internals``
may read ``compiler._torch_internals``."""

from ._torch_internals import size_guard
from .cache import CompileCache, cache_settings, not_compiled
from .graph import (FALLBACKS, BackendFn, CompileOptions, Diagnoser, PartitionRecord, SettingError, block_containers,
                    block_lists, check_blocks_setting, compile_blocks, compile_partitions, ensure_tuple_output,
                    find_blocks, produces_gradients, resolve_backend, split_graph)

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
