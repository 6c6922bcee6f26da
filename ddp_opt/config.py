"""``DDPCompileConfig``: every setting of ``compile_ddp`` in one frozen dataclass,
validated when built, so that a bad setting fails before any compile, link
measurement or process-group collective, and an entry point (the launcher) can
build it up front and report the error in its own terms (``SettingError.setting``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Sequence

from compiler import (FALLBACKS, BackendFn, SettingError, cache_settings, check_blocks_setting, not_compiled,
                      resolve_backend)

from .advice import API_SPELLING, Spelling
from .autoplan import LinkEstimate
from .cost import CostModel
from .traced import STRATEGIES

__all__ = ["DDPCompileConfig"]


@dataclass(frozen=True)
class DDPCompileConfig:
    """How ``compile_ddp`` compiles a DDP model; see ``compile_ddp`` for each field.

    Raises (when built):
        SettingError: a value that cannot work; ``.setting`` names the field.
        TypeError: a value of the wrong kind (``link``, ``wrap_backend``).
    """

    backend: str | Callable = "inductor"
    mode: str | None = None
    options: Mapping[str, Any] | None = None
    dynamic: bool | None = None
    fullgraph: bool = False
    fallback: str = not_compiled("warn", why="what happens when a compile fails; nothing of it is cached")
    split: bool = True
    check_plans: bool = not_compiled(True, why="a check across ranks before the compile")
    align_buckets: bool = not_compiled(True, why="DDP's runtime buckets, after the compile")
    bucket_cap_mb: str | None = None
    link: LinkEstimate | CostModel | Callable | None = not_compiled(
        None, why="a measure that differs run to run; the plan it gives is in the graphs, which the artifacts' "
                  "own keys hash")
    cache_dir: str | os.PathLike | None = not_compiled(None, why="where the cache is kept")
    regional: bool = False
    blocks: str | Sequence[str] = "auto"
    share_compile: bool = not_compiled(True, why="which rank compiles, not what")
    share_timeout_s: float = not_compiled(7200.0, why="how long a rank waits")
    strategy: str = "split"
    wrap_backend: Callable[[Callable], Callable] | None = not_compiled(
        None, why="an observer of the backend (Diagnoser().wrap); its output is the backend's")
    torch_compile_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # How messages name a setting: an entry point of its own (the launcher) passes its spelling.
    spelling: Spelling = not_compiled(API_SPELLING, why="how messages name settings")

    def __post_init__(self) -> None:
        self.resolve_backend()  # unknown backend, mode or options fail here, naming the valid ones
        if self.fallback not in FALLBACKS:
            raise SettingError(
                "fallback",
                f"compile_ddp(fallback={self.fallback!r}): expected one of {', '.join(FALLBACKS)}: 'warn' runs a "
                "partition that fails to compile eagerly (the others stay compiled), 'raise' stops on the error.",
            )
        object.__setattr__(self, "blocks", check_blocks_setting(self.blocks, "compile_ddp"))
        self._check_plan_choice()
        self._check_strategy()
        if self.cache_dir is not None and (not str(self.cache_dir) or os.path.isfile(self.cache_dir)):
            raise SettingError(
                "cache_dir",
                f"compile_ddp(cache_dir={self.cache_dir!r}) is not a directory: it must name a directory (created "
                "if missing) to keep one compile-cache file per model and config in. Pass a directory path, or "
                "cache_dir=None to turn the persistent cache off.",
            )
        if not self.share_timeout_s > 0:
            raise SettingError(
                "share_timeout_s",
                f"compile_ddp(share_timeout_s={self.share_timeout_s!r}): expected a positive number of seconds, the "
                "longest a rank waits for another rank's compile (Note [Shared compile]). Give the longest "
                "compile you expect with margin; the default is 7200.",
            )
        if self.wrap_backend is not None and not callable(self.wrap_backend):
            raise TypeError(f"compile_ddp(wrap_backend={self.wrap_backend!r}): expected a callable backend -> backend, "
                            "such as compiler.diagnose.Diagnoser().wrap, or None.")

    def _check_plan_choice(self) -> None:
        if self.bucket_cap_mb not in (None, "auto"):
            raise SettingError(
                "bucket_cap_mb",
                f"compile_ddp(bucket_cap_mb={self.bucket_cap_mb!r}): expected None (split at DDP's own caps) or "
                "'auto' (choose the buckets from a cost model of the link and the model). A fixed cap belongs on "
                "DDP: DistributedDataParallel(model, bucket_cap_mb=4), which compile_ddp follows.",
            )
        if self.link is not None and not isinstance(self.link, (LinkEstimate, CostModel)) and not callable(self.link):
            raise TypeError(
                f"compile_ddp(link={self.link!r}): expected None (measure dist.all_reduce), a probe callable "
                "(tensor) -> Future, a ddp_opt.LinkEstimate(alpha_s, bandwidth) or a ddp_opt.CostModel."
            )
        if (self.bucket_cap_mb is not None or self.link is not None) and (not self.split or self.regional):
            which = "split=False" if not self.split else "regional=True"
            given = "bucket_cap_mb='auto'" if self.bucket_cap_mb == "auto" else "link=..."
            raise SettingError(
                "bucket_cap_mb" if self.bucket_cap_mb is not None else "link",
                f"compile_ddp({given}, {which}): the cost model chooses (or predicts) where to split the graph, "
                f"and {which} does not split it at planned buckets. Drop one of the two.",
            )

    def _check_strategy(self) -> None:
        if self.strategy not in STRATEGIES:
            raise SettingError(
                "strategy",
                f"compile_ddp(strategy={self.strategy!r}): expected one of {', '.join(map(repr, STRATEGIES))}: "
                "'split' splits the forward graph at the bucket boundaries and lets DDP's reducer all-reduce "
                "(the default); 'traced' all-reduces inside one compiled backward graph (Note [Traced strategy]).",
            )
        if self.strategy == "traced" and (not self.split or self.regional):
            which = "split=False" if not self.split else "regional=True"
            raise SettingError(
                "strategy",
                f"compile_ddp(strategy='traced', {which}): the traced strategy compiles the whole forward and "
                f"traces the gradient all-reduces into the backward graph, and {which} chooses another way to "
                "compile. Drop one of the two (strategy='split' is the default).",
            )

    def resolve_backend(self) -> BackendFn:
        """The dynamo backend each partition (or block) is compiled with."""
        return resolve_backend(self.backend, mode=self.mode, options=dict(self.options) if self.options else None,
                               dynamic=self.dynamic)

    @property
    def uses_cost_model(self) -> bool:
        return self.bucket_cap_mb is not None or self.link is not None

    def changed_from_default(self) -> list[str]:
        """Names of the fields that differ from their defaults."""
        default = DDPCompileConfig()
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]

    def cache_settings(self) -> dict[str, Any]:
        """The settings that change what is compiled, as the compile-cache key sees them:
        every field not declared ``not_compiled`` (Note [Settings in the cache key])."""
        return cache_settings(self)
