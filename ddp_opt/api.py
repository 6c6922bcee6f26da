"""compile_ddp: the user-facing entry point. Compile a DDP-wrapped model so that
its graph is split where DDP's real buckets are."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from compiler import resolve_backend

from .optimizer import DDPOptimizer
from .plan import Bucket, BucketCaps
from .realign import realign_reducer, reducer_finalized, registered_hook_name

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

    Calling it calls the DDP model, whose wrapped module ``compile_ddp`` compiled
    in place. Every other attribute (``parameters``, ``no_sync``, ``state_dict``,
    ``module``, ...) is the DDP model's, and checkpoints keep DDP's keys.

    Attributes:
        ddp_model: the wrapped DDP module.
        ddp_optimizer: the splitter, or None when compiled with ``split=False``.
        align_buckets: re-create DDP's reducer once, after the first step, so that
            its buckets equal the partitions (Note [Bucket realignment]).
        aligned_caps: the caps given to the reducer, once realigned.
    """

    def __init__(self, ddp_model: DistributedDataParallel, ddp_optimizer: DDPOptimizer | None,
                 align_buckets: bool = False) -> None:
        self.ddp_model = ddp_model
        self.ddp_optimizer = ddp_optimizer
        self.align_buckets = align_buckets and ddp_optimizer is not None and not ddp_model.static_graph
        if align_buckets and ddp_model.static_graph:
            log.info("compile_ddp: align_buckets is skipped for DDP(static_graph=True), whose reducer rebuilds "
                     "its buckets another way; DDP keeps its own buckets (see ddp_opt.measure_alignment).")
        self.aligned_caps: tuple[int, ...] | None = None
        self._comm_hooks: list[tuple[Any, Callable]] = []

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """``DistributedDataParallel.register_comm_hook``, kept across realignment."""
        self._comm_hooks.append((state, hook))
        self.ddp_model.register_comm_hook(state, hook)

    def _maybe_realign(self) -> None:
        if (self.align_buckets and self.aligned_caps is None and len(self.buckets) > 1
                and torch.is_grad_enabled() and reducer_finalized(self.ddp_model)):
            self.aligned_caps = realign_reducer(self.ddp_model, self.buckets, self._comm_hooks)

    @property
    def buckets(self) -> list[Bucket]:
        return self.ddp_optimizer.buckets if self.ddp_optimizer is not None else []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._maybe_realign()
        return self.ddp_model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set in __init__.
        return getattr(self.__dict__["ddp_model"], name)

    def __repr__(self) -> str:
        return f"CompiledDDP({self.ddp_model!r})"


def _keep_builtin_splitter_out(ddp_model: DistributedDataParallel) -> None:
    """Switch PyTorch's own DDP splitter off for the duration of each forward call.

    Dynamo hands a graph captured under an active DDP module to PyTorch's splitter
    whenever ``torch._dynamo.config.optimize_ddp`` is on; it would split our
    partitions again with its own caps. The patch is entered before forward and
    left after it, also when forward raises, so no global flag stays flipped."""
    scopes: list[contextlib.ExitStack] = []

    def enter(module, args):
        stack = contextlib.ExitStack()
        stack.enter_context(torch._dynamo.config.patch(optimize_ddp=False))
        scopes.append(stack)

    def leave(module, args, output):
        if scopes:
            scopes.pop().close()

    ddp_model.register_forward_pre_hook(enter)
    ddp_model.register_forward_hook(leave, always_call=True)


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
    check_plans: bool = True,
    wrap_backend: Callable[[Callable], Callable] | None = None,
    align_buckets: bool = True,
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
            The wrapped module's ``forward`` is compiled in place; compile
            before making copies of the module (``copy.deepcopy``), since a copy
            would share the compiled forward of the original.
        fallback: ``"warn"`` runs a partition that fails to compile eagerly,
            ``"raise"`` re-raises the backend's error.
        split: False compiles each captured graph whole (no overlap of gradient
            communication with backward; for comparison).
        check_plans: fail on every rank, with the first differing bucket named,
            when ranks plan different buckets (which would deadlock in backward).
        align_buckets: after the first step, make DDP's runtime buckets equal
            the partitions (otherwise DDP's rebuild can make a bucket straddle
            two partitions and wait for the later one). Register comm hooks
            through the returned object's ``register_comm_hook``. Not applied
            to ``DDP(static_graph=True)``.
        wrap_backend: applied to the backend dynamo calls (the splitter, or the
            plain backend with ``split=False``), e.g. ``Diagnoser().wrap`` to see
            every captured graph and its graph-break reason.
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
    inner = ddp_model.module
    if getattr(inner, "_compiled_call_impl", None) is not None or hasattr(inner.__dict__.get("forward"), "_torchdynamo_orig_callable"):
        raise RuntimeError(
            f"compile_ddp: the module inside this DDP ({type(ddp_model.module).__name__}) is already compiled "
            "(module.compile() or an earlier compile_ddp call). Compiling it again would nest two compilers. "
            "Call compile_ddp once, on a DDP model whose module is not compiled."
        )
    hook = registered_hook_name(ddp_model) if (align_buckets and split and not ddp_model.static_graph) else None
    if hook is not None:
        raise ValueError(
            f"compile_ddp(align_buckets=True) re-creates DDP's reducer after the first step so that its buckets "
            f"equal the graph partitions, and the comm hook {hook!r} already registered on this DDP module would "
            "be lost with the old reducer. Register the hook on the object compile_ddp returns instead "
            "(compiled.register_comm_hook(state, hook)), or pass align_buckets=False to keep DDP's own buckets."
        )
    backend_fn = resolve_backend(backend, mode=mode, options=options, dynamic=dynamic)
    optimizer = None
    if split:
        caps = caps_from_ddp(ddp_model)
        optimizer = DDPOptimizer(
            caps.bucket_bytes_cap, backend_fn, caps.first_bucket_cap,
            bucket_caps=caps.per_bucket_caps, fallback=fallback, check_plans=check_plans,
        )
        backend_fn = optimizer.compile_fn
    if wrap_backend is not None:
        backend_fn = wrap_backend(backend_fn)
    # Compile the wrapped module's forward in place, then let DDP call it (the
    # order torchtitan uses). torch.compile(ddp_model) would leave dynamo to find
    # frames below DDP's skipped forward, and it skips a torch.nn container's
    # forward (nn.Sequential) too, compiling nothing; nn.Module.compile() misses
    # it the same way. In place, state_dict keys stay DDP's.
    inner.forward = torch.compile(inner.forward, backend=backend_fn, dynamic=dynamic, fullgraph=fullgraph, **more)
    _keep_builtin_splitter_out(ddp_model)
    return CompiledDDP(ddp_model, optimizer, align_buckets=align_buckets)

