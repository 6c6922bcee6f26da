"""The on-disk role of ``compiler``: the persistent compile cache (``CompileCache``, opened
with ``open_cache``, saved by local rank 0), what an entry is valid for (its key and the
settings it was compiled under), the artifacts and C++ kernels it carries, and what the job
trusts on disk (Note [Trusted folders]: private runtime folder, files written without following
links, folders that load code checked for others' write access).

Outside ``compiler`` these names are imported from here (or ``CompileCache``,
``cache_settings`` and ``not_compiled`` from ``compiler``); the modules are this package's own."""

from .cache_key import CacheKey
from .settings_key import cache_settings, not_compiled
from .store import CompileCache, open_cache, save_on_local_rank0
from .trust import UnsafePath, read_private, runtime_dir, unsafe_folder, write_private

__all__ = [
    "CompileCache", "CacheKey", "open_cache", "save_on_local_rank0", "cache_settings", "not_compiled",
    "UnsafePath", "read_private", "runtime_dir", "unsafe_folder", "write_private",
]
