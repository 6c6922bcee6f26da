"""``DDPCompileConfig``: every setting of ``compile_ddp`` in one frozen dataclass,
validated when built, so that a bad setting fails before any compile, link
measurement or process-group collective, and an entry point (the launcher) can
build it up front and report the error in its own terms (``SettingError.setting``).

How a graph is compiled (backend, mode, ..., ``share``) is ``compiler.CompileOptions``,
which this config extends; ``compile_ddp``'s keywords are this dataclass's fields
(``from_keywords``), so a new field is a new keyword with no other edit.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Sequence

import torch

from compiler import FALLBACKS, CompileOptions, SettingError, check_blocks_setting, not_compiled
from compiler.graph import keyword_signature as config_signature, setting_names

from .advice import API_SPELLING, Spelling
from .planning.solver import LinkEstimate
from .compression.hooks import REDUCE_DTYPES, parse_reduce_dtype
from .compression.powersgd import PowerSGD, parse_compression
from .planning.cost import CostModel
from .in_backward.stepper import refusal as optimizer_refusal
from .strategies.rules import RULES, refusal

__all__ = ["DDPCompileConfig", "STRATEGIES"]

# The ways compile_ddp compiles a DDP model, each in a line; their rules are ddp_opt.strategies.rules.RULES
# (Note [Traced strategy], Note [Regional compile]).
STRATEGIES = {name: rules.says for name, rules in RULES.items()}

# Fields that are not keywords of compile_ddp: how messages name a setting, and what **more collects.
_NOT_KEYWORDS = ("spelling", "torch_compile_kwargs")


@dataclass(frozen=True)
class DDPCompileConfig(CompileOptions):
    """How ``compile_ddp`` compiles a DDP model; see ``compile_ddp`` for each field
    (the first ones are ``compiler.CompileOptions``'s).

    Raises (when built):
        SettingError: a value that cannot work; ``.setting`` names the field.
        TypeError: a value of the wrong kind (``link``, ``wrap_backend``).
    """

    OWNER = "compile_ddp"

    strategy: str = "split"
    fallback: str = not_compiled("warn", why="what happens when a compile fails; nothing of it is cached")
    check_plans: bool = not_compiled(True, why="a check across ranks before the compile")
    align_buckets: bool = not_compiled(True, why="DDP's runtime buckets, after the compile")
    bucket_cap_mb: str | None = None
    link: LinkEstimate | CostModel | Callable | None = not_compiled(
        None, why="a measure that differs run to run; the plan it gives is in the graphs, which the artifacts' "
                  "own keys hash")
    blocks: str | Sequence[str] = "auto"
    reduce_dtype: torch.dtype | str | None = None
    compression: PowerSGD | str | None = not_compiled(
        None, why="a comm hook on DDP's reducer, outside the compiled graphs; under 'traced', part of the "
                  "compiled backward graph, which the artifacts' own keys hash")
    step_gate: bool = not_compiled(True, why="a wait in the store before each step's first collective; no graph "
                                             "changes")
    optimizer: torch.optim.Optimizer | None = not_compiled(
        None, why="the user's optimizer, run per bucket after each reduction (Note [Optimizer in backward])")
    wrap_backend: Callable[[Callable], Callable] | None = not_compiled(
        None, why="an observer of the backend (Diagnoser().wrap); its output is the backend's")
    torch_compile_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # How messages name a setting: an entry point of its own (the launcher) passes its spelling.
    spelling: Spelling = not_compiled(API_SPELLING, why="how messages name settings")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fallback not in FALLBACKS:
            raise SettingError(
                "fallback",
                f"compile_ddp(fallback={self.fallback!r}): expected one of {', '.join(FALLBACKS)}: 'warn' runs a "
                "partition that fails to compile eagerly (the others stay compiled), 'raise' stops on the error.",
            )
        if self.strategy not in STRATEGIES:
            raise SettingError(
                "strategy",
                f"compile_ddp(strategy={self.strategy!r}): expected one of "
                + "; ".join(f"{name!r}: {what}" for name, what in STRATEGIES.items()) + ".",
            )
        object.__setattr__(self, "blocks", check_blocks_setting(self.blocks, "compile_ddp"))
        object.__setattr__(self, "reduce_dtype", self._checked_reduce_dtype())
        object.__setattr__(self, "compression", self._checked_compression())
        self._check_plan_choice()
        self._check_optimizer()
        if self.wrap_backend is not None and not callable(self.wrap_backend):
            raise TypeError(f"compile_ddp(wrap_backend={self.wrap_backend!r}): expected a callable backend -> backend, "
                            "such as compiler.Diagnoser().wrap, or None.")

    @classmethod
    def from_keywords(cls, entry: str, settings: Mapping[str, Any]) -> DDPCompileConfig:
        """The config for ``entry(**settings)`` (``compile_ddp``, ``compile_for_ddp``): each
        field is a keyword (Note [Keywords from a config]); any other keyword must be one of
        ``torch.compile``'s and is passed on to it."""
        settings = dict(settings)
        known = {f.name for f in fields(cls)} - {"spelling"}
        more = {k: settings.pop(k) for k in list(settings) if k not in known}
        _check_torch_compile_keywords(entry, more, known)
        if more:
            settings["torch_compile_kwargs"] = {**settings.get("torch_compile_kwargs", {}), **more}
        return cls(**settings)

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
        why = refusal(self.strategy, self.uses_cost_model)
        if why is not None:
            given = "bucket_cap_mb='auto'" if self.bucket_cap_mb == "auto" else "link=..."
            raise SettingError("bucket_cap_mb" if self.bucket_cap_mb is not None else "link",
                               f"compile_ddp({given}, strategy={self.strategy!r}): {why}.")

    def _checked_reduce_dtype(self) -> torch.dtype | None:
        try:
            return parse_reduce_dtype(self.reduce_dtype)
        except ValueError:
            names = ", ".join(repr(name) for name in REDUCE_DTYPES)
            raise SettingError(
                "reduce_dtype",
                f"compile_ddp(reduce_dtype={self.reduce_dtype!r}): expected torch.bfloat16 or "
                f"torch.float16 (or one of {names}), the dtype the gradients are all-reduced in, or None to reduce "
                "them in their own dtype. bf16 halves the bytes on the wire and keeps fp32's range "
                "(Note [Reduced-precision all-reduce]).",
            ) from None

    def _checked_compression(self) -> PowerSGD | None:
        given = f"compile_ddp(compression={self.compression!r}"
        try:
            spec = parse_compression(self.compression)
        except ValueError as e:
            raise SettingError("compression", f"{given}): {e} Or pass compression=None to reduce the "
                                              "gradients as they are (Note [PowerSGD compression]).") from None
        if spec is not None and self.reduce_dtype is not None:
            raise SettingError("compression", f"{given}, reduce_dtype={self.reduce_dtype}): both choose how the "
                                              "gradients cross the link, through one comm hook each, and DDP calls "
                                              "one hook. Pass one of the two.")
        return spec

    def _check_optimizer(self) -> None:
        if self.optimizer is None:
            return
        why = optimizer_refusal(self.optimizer)
        if why is not None:
            raise SettingError("optimizer", f"compile_ddp(optimizer=...): {why}.")

    @property
    def uses_cost_model(self) -> bool:
        return self.bucket_cap_mb is not None or self.link is not None


def keyword_signature(*leading: inspect.Parameter) -> inspect.Signature:
    """The signature of an entry point taking ``leading`` then every setting as a keyword
    (``help(compile_ddp)`` lists them), ``config=`` and ``**more`` for ``torch.compile``."""
    return config_signature(
        DDPCompileConfig, leading, skip=_NOT_KEYWORDS,
        trailing=(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None),
                  inspect.Parameter("more", inspect.Parameter.VAR_KEYWORD)))


def _check_torch_compile_keywords(entry: str, more: Mapping[str, Any], known: set[str]) -> None:
    """Every keyword that is not a setting must be ``torch.compile``'s own, which is passed on."""
    passed_on = set(inspect.signature(torch.compile).parameters) - {"model"} - known
    for name in more:
        if name in passed_on:
            continue
        near = (difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.55)  # a setting first
                or difflib.get_close_matches(name, sorted(known | passed_on), n=1))
        settings = ", ".join(setting_names(DDPCompileConfig, skip=_NOT_KEYWORDS))
        raise TypeError(
            f"{entry}() got an unexpected keyword argument {name!r}: it is neither a setting of {entry} "
            f"(the fields of ddp_opt.DDPCompileConfig: {settings}) nor one of torch.compile's keywords, which "
            f"{entry} passes on ({', '.join(sorted(passed_on)) or 'none'})."
            + (f" Did you mean {near[0]}=?" if near else ""))
