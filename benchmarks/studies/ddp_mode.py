"""The DDP benchmark's mode interface: :class:`DDPMode`, what a mode does and reports, and
:class:`DDPRunner`, one mode's model and measurements (the modes: ``benchmarks.studies.modes_ddp``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Sequence

from torch.nn.parallel import DistributedDataParallel as DDP

from .._torch_internals import BuiltinBuckets
from ..harness.core import Runner
from ..link.shaping import SimulatedLink
from ..harness.report import cap_label

__all__ = ["DEFAULT_CAP", "DDPMode", "DDPRunner"]

DEFAULT_CAP = 25.0  # DDP's and PyTorch's splitter's default bucket_cap_mb


@dataclass(kw_only=True)
class DDPRunner(Runner):
    """One mode's DDP model, compiled callable, optimizer and measurements."""

    mode: DDPMode
    ddp: DDP
    fn: Callable
    cap: float | str | None = None  # set in a sweep, where one mode runs at several caps
    ddp_cap_mb: float | str | None = None  # the bucket_cap_mb the DDP model was made with
    compiler: Any = None  # compiled_autograd: the backend its backward graphs compile with
    sync_fb_s: list[float] = field(default_factory=list)  # forward+backward with all-reduce, per measured round
    nosync_fb_s: list[float] = field(default_factory=list)  # the same under no_sync
    nosync_fwd_s: list[float] = field(default_factory=list)  # its forward alone
    opt_s: list[float] = field(default_factory=list)  # the optimizer step of the synchronised step
    link_s: list[float] = field(default_factory=list)
    buckets_per_step: list[int] = field(default_factory=list)
    bucket_bytes: list[int] = field(default_factory=list)  # DDP's buckets in launch order, last sync step
    compiles: list[int] = field(default_factory=list)  # dynamo graphs compiled, per step
    builtin_log: BuiltinBuckets | None = None

    @property
    def label(self) -> str:
        """``ours@4``, ``ours@auto`` in a sweep; the mode alone otherwise."""
        return self.mode.name if self.cap is None else f"{self.mode.name}@{cap_label(self.cap)}"


class DDPMode:
    """How one mode compiles the DDP model, and what it can report about itself."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line: what the mode runs
    compiled: ClassVar[bool] = True
    plans_auto: ClassVar[bool] = False  # takes cap "auto" and a cost model
    takes_hook: ClassVar[bool] = True  # its gradients go through DDP's reducer, and so the simulated link
    reduce_dtype: ClassVar[str] = "fp32"  # what its gradients cross the link in
    compression: ClassVar[str | None] = None  # how they are compressed ("powersgd:R:START"); None: not
    in_backward: ClassVar[bool] = False  # the optimizer steps inside backward (compile_ddp(..., optimizer=opt))

    def construct(self) -> ContextManager:
        """What the mode's DDP model is made inside."""
        return contextlib.nullcontext()

    def wrap(self, r: DDPRunner, backend: str, cap: float | str, link: SimulatedLink, cost_model: Any) -> None:
        """Set ``r.fn`` to the callable a step runs; register the comm hook."""
        self.register_hook(r, link)

    def register_hook(self, r: DDPRunner, link: SimulatedLink) -> None:
        """The comm hook on the mode's DDP model: the simulated link's."""
        r.ddp.register_comm_hook(link, SimulatedLink.hook)

    def during_step(self, r: DDPRunner) -> ContextManager:
        """What a timed step runs inside."""
        return contextlib.nullcontext()

    def partitions(self, r: DDPRunner) -> int | None:
        return 1

    def plan(self, r: DDPRunner) -> list | None:
        """The planned buckets (``ddp_opt.Bucket``, backward order), for modes that plan."""
        return None

    def fused_bytes(self, r: DDPRunner) -> list[int] | None:
        """Bytes of each all-reduce fused into the synchronised compiled backward (gradient-ready
        order), for modes that fuse by our pass; None where unknown."""
        return None

    def alignment(self, r: DDPRunner) -> float | None:
        """Fraction of gradient bytes whose runtime DDP bucket is exactly one partition; None
        where there are no partitions or their plan is not known."""
        return None

    def prediction(self, r: DDPRunner) -> Any:
        """The cost model's prediction for the plan (``ddp_opt`` Timeline), if any."""
        return None

    def sweep_caps(self, caps: Sequence[float | str]) -> list[float | str]:
        """The caps a sweep (``benchmarks.studies.sweep``) runs this mode at."""
        return [DEFAULT_CAP]
