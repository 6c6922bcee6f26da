"""compile_ddp: the user-facing entry point. Compile a DDP-wrapped model so that
its graph is split where DDP's real buckets are."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from compiler import resolve_backend

from .optimizer import DDPOptimizer
from .plan import Bucket, BucketCaps

log = logging.getLogger(__name__)

__all__ = ["CompiledDDP", "caps_from_ddp", "compile_ddp"]


def caps_from_ddp(ddp_model: DistributedDataParallel) -> BucketCaps:
    """The caps DDP's reducer uses when it rebuilds its buckets after step 1.

    DDP's first bucket is capped at 1 MiB only when the user left
    ``bucket_cap_mb`` unset; with ``bucket_cap_mb=X`` every bucket, the first
    included, is capped at X MiB. ``bucket_cap_mb_list`` gives one cap per bucket.
    """
    config = getattr(ddp_model, "_bucket_config", None)
    if config is not None:  # torch >= 2.13
        return BucketCaps(
            bucket_bytes_cap=int(config.bucket_bytes_cap),
            first_bucket_cap=int(config.first_bucket_bytes_cap),
            per_bucket_caps=tuple(int(c) for c in config.per_bucket_bytes_caps),
        )
    cap = int(ddp_model.bucket_bytes_cap)
    uses_default = bool(getattr(ddp_model, "bucket_bytes_cap_default", False))
    first = min(torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, cap) if uses_default else cap
    per_bucket = tuple(int(c) for c in getattr(ddp_model, "bucket_bytes_cap_list", ()) or ())
    return BucketCaps(cap, first, per_bucket)


class CompiledDDP:
    """What the training loop calls in place of the DDP model.

    Calls run the compiled model with PyTorch's own DDP splitter switched off for
    the duration of the call only (``optimize_ddp=False`` is patched around it, so
    no global flag stays flipped). Every other attribute (``parameters``,
    ``no_sync``, ``state_dict``, ``module``, ...) is the DDP model's.

    Attributes:
        ddp_model: the wrapped DDP module.
        ddp_optimizer: the splitter, or None when compiled with ``split=False``.
        compiled: the ``torch.compile``d DDP module.
    """

    def __init__(self, ddp_model: DistributedDataParallel, compiled: Callable, ddp_optimizer: DDPOptimizer | None) -> None:
        self.ddp_model = ddp_model
        self.compiled = compiled
        self.ddp_optimizer = ddp_optimizer

    @property
    def buckets(self) -> list[Bucket]:
        return self.ddp_optimizer.buckets if self.ddp_optimizer is not None else []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(optimize_ddp=False):
            return self.compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set in __init__.
        return getattr(self.__dict__["ddp_model"], name)

    def __repr__(self) -> str:
        return f"CompiledDDP({self.ddp_model!r})"


def compile_ddp(
    ddp_model: DistributedDataParallel,
    *,
    backend: str | Callable = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    fallback: str = "warn",
    split: bool = True,
    **more: Any,
) -> CompiledDDP:
    """Compile a DDP model, split at the bucket boundaries DDP really uses.

    Args:
        ddp_model: a ``DistributedDataParallel`` module.
        backend: dynamo backend name (``"inductor"``, ``"aot_eager"``, ...) or a
            callable ``(gm, example_inputs) -> callable``.
        mode, options: inductor mode and options, as for ``torch.compile``.
        dynamic: as for ``torch.compile``.
        fullgraph: as for ``torch.compile``; applies to the wrapped module's
            forward (the bucket splits are not graph breaks in dynamo's sense).
        fallback: ``"warn"`` runs a partition that fails to compile eagerly,
            ``"raise"`` re-raises the backend's error.
        split: False compiles each captured graph whole (no overlap of gradient
            communication with backward; for comparison).
        **more: passed on to ``torch.compile``.

    Returns:
        A :class:`CompiledDDP`; call it as you would call ``ddp_model``.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"compile_ddp expects a DistributedDataParallel module, got {type(ddp_model).__name__}. "
            "Wrap the model first: compile_ddp(DistributedDataParallel(model, ...)); for a model "
            "without DDP use torch.compile directly."
        )
    backend_fn = resolve_backend(backend, mode=mode, options=options, dynamic=dynamic)
    optimizer = None
    if split:
        caps = caps_from_ddp(ddp_model)
        optimizer = DDPOptimizer(
            caps.bucket_bytes_cap, backend_fn, caps.first_bucket_cap,
            bucket_caps=caps.per_bucket_caps, fallback=fallback,
        )
        backend_fn = optimizer.compile_fn
    compiled = torch.compile(ddp_model, backend=backend_fn, dynamic=dynamic, fullgraph=fullgraph, **more)
    return CompiledDDP(ddp_model, compiled, optimizer)

