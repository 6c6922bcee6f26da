"""``CompileOptions``: how a graph is compiled, the settings every entry point shares.

``ddp_opt.DDPCompileConfig`` and ``fsdp_opt.FSDPCompileConfig`` extend it with what only
they do, and the launcher's ``compile`` group maps onto its fields one to one, so a
compile setting has one name, one default and one rule wherever it is given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Mapping

from .backends import BackendFn, SettingError, resolve_backend
from ..cache.settings_key import cache_settings, not_compiled

__all__ = ["CompileOptions"]


@dataclass(frozen=True)
class CompileOptions:
    """How each graph (partition or block) is compiled.

    Attributes:
        backend: a dynamo backend name (``"inductor"``, ``"aot_eager"``, ...) or a
            callable ``(gm, example_inputs) -> callable``.
        mode: an inductor mode (``"max-autotune-no-cudagraphs"``, ...); inductor only.
        options: inductor config options (``{"shape_padding": True}``); inductor only.
        dynamic: as for ``torch.compile``.
        fullgraph: as for ``torch.compile``: True fails on a graph break instead of
            compiling the pieces around it (a block compiled alone, a whole forward).
            False by default everywhere, as in ``torch.compile``; the diagnoser
            (``compiler.Diagnoser``) names every break.
        cache_dir: a persistent compile cache (Note [Compile cache]); None: off.
            Loading a cache is loading code: the directory must be as trusted as the
            training code.
        share: the first rank to reach a graph's compile does it and the others load
            its artifacts, and no rank leaves a graph's compile before every rank that
            compiles it is done (Note [Shared compile]); False: every rank compiles
            every graph, with no barrier.
        share_timeout_s: the longest a rank waits for another rank's compile.

    Raises (when built):
        SettingError: a value that cannot work; ``.setting`` names the field.
    """

    # How messages name the object the settings were given to (``compile_ddp(...)``).
    OWNER: ClassVar[str] = "CompileOptions"

    backend: str | Callable = "inductor"
    mode: str | None = None
    options: Mapping[str, Any] | None = None
    dynamic: bool | None = None
    fullgraph: bool = False
    cache_dir: str | os.PathLike | None = not_compiled(None, why="where the cache is kept")
    share: bool = not_compiled(True, why="which rank compiles, not what")
    share_timeout_s: float = not_compiled(7200.0, why="how long a rank waits")

    def __post_init__(self) -> None:
        if self.options is not None:
            object.__setattr__(self, "options", dict(self.options) or None)
        self.resolve_backend()  # unknown backend, mode or options fail here, naming the valid ones
        if self.cache_dir is not None and (not str(self.cache_dir) or os.path.isfile(self.cache_dir)):
            raise SettingError(
                "cache_dir",
                f"{self.OWNER}(cache_dir={self.cache_dir!r}) is not a directory: it must name a directory (created "
                "if missing) to keep one compile-cache file per model and config in. Pass a directory path, e.g. "
                "cache_dir='/scratch/compile_cache', or cache_dir=None to turn the persistent cache off.",
            )
        if isinstance(self.share_timeout_s, bool) or not isinstance(self.share_timeout_s, (int, float)) \
                or not self.share_timeout_s > 0:
            raise SettingError(
                "share_timeout_s",
                f"{self.OWNER}(share_timeout_s={self.share_timeout_s!r}): expected a positive number of seconds, "
                "the longest a rank waits for another rank's compile (Note [Shared compile]). Give the longest "
                "compile you expect with margin; the default is 7200.",
            )

    def resolve_backend(self) -> BackendFn:
        """The dynamo backend each graph is compiled with."""
        return resolve_backend(self.backend, mode=self.mode, options=self.options, dynamic=self.dynamic)

    def compile_options(self) -> CompileOptions:
        """These settings alone, without what a subclass adds."""
        return CompileOptions(**{f.name: getattr(self, f.name) for f in fields(CompileOptions)})

    def cache_settings(self) -> dict[str, Any]:
        """The settings that change what is compiled, as the compile-cache key sees them:
        every field not declared ``not_compiled`` (Note [Settings in the cache key])."""
        return cache_settings(self)

