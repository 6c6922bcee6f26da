"""The graph role of ``compiler``: resolve a backend, split a captured graph, compile its
partitions lazily and fault-tolerantly, compile repeated blocks in place, stack the wrappers
around a dynamo backend (``build_backend``), say what is compiling, and diagnose graph breaks.

Outside ``compiler`` these names are imported from here (or, the most used, from ``compiler``
itself); the modules below them are this package's own."""

from .backend_chain import build_backend
from .backends import BackendFn, SettingError, resolve_backend, valid_backend_names, valid_modes
from .diagnose import Diagnoser, Report
from .graph_kind import produces_gradients
from .keywords import keyword_signature, refuse_unknown_keywords, setting_names
from .options import CompileOptions
from .partition import DYNAMO_CONTROL_FLOW, FALLBACKS, LazyPartition, PartitionRecord, compile_partitions
from .progress import ProgressTicker, compiling
from .regional import block_containers, block_lists, check_blocks_setting, compile_blocks, find_blocks
from .split import SplitGraph, ensure_tuple_output, split_graph

__all__ = [
    "BackendFn", "SettingError", "resolve_backend", "valid_backend_names", "valid_modes", "CompileOptions",
    "split_graph", "ensure_tuple_output", "SplitGraph",
    "produces_gradients", "FALLBACKS", "PartitionRecord", "compile_partitions", "LazyPartition", "DYNAMO_CONTROL_FLOW",
    "find_blocks", "block_containers", "block_lists", "compile_blocks", "check_blocks_setting",
    "build_backend", "keyword_signature", "refuse_unknown_keywords", "setting_names",
    "ProgressTicker", "compiling", "Diagnoser", "Report",
]
