"""FSDP2 (``fully_shard``) + per-block compile: find the repeated blocks, group
them into shard units of a chosen size, compile each block, shard each unit and
the root, and prefetch explicitly. Whole-model fullgraph compile and compiled
autograd are refused with FSDP2: see ``fsdp_opt.config``."""

from .apply import apply, check_no_compiled_autograd, default_mesh
from compiler import block_containers, block_lists, find_blocks
from .config import FSDPCompileConfig, FSDPConfig
from .plan import FSDPPlan, ShardUnit, format_units, plan_fsdp, plan_shard_units

__all__ = [
    # entry point
    "apply",
    # configuration
    "FSDPConfig",
    "FSDPCompileConfig",
    # planning (pure, no process group)
    "find_blocks",
    "block_containers",
    "block_lists",
    "plan_fsdp",
    "plan_shard_units",
    "format_units",
    "FSDPPlan",
    "ShardUnit",
    # guards and helpers
    "check_no_compiled_autograd",
    "default_mesh",
]
