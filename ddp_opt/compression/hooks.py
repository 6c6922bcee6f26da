"""Gradients all-reduced in a narrower dtype (``compile_ddp(reduce_dtype=torch.bfloat16)``),
under every strategy.

Note [Reduced-precision all-reduce]

Background
    Where the link dominates, the step's limit ``fwd + max(bwd, comm) + opt`` moves only
    when fewer bytes cross. DDP's ``bf16_compress_hook`` refuses gloo by name though gloo
    all-reduces bf16, and the traced strategy's python reducer calls a hook per gradient,
    which no bucket hook fits.

Algorithm
    The arithmetic is DDP's ``_compress_hook`` everywhere, so each element is reduced the
    same way wherever its bucket ends: ``sum over ranks of bf16(g) / world_size`` in the
    reduce dtype, widened back for the optimizer.
    - Reducer strategies: :func:`bucket_hook`, registered by ``compile_ddp`` and again
      when realignment re-creates the reducer.
    - Traced: ``gradient_hook`` (``ddp_opt.strategies.traced.backward``), traced into the backward; the fusion pass
      concatenates each bucket's narrowed gradients into one all-reduce. Caps count
      gradient bytes, as DDP's do (``TracedPlan.wire_scale``).
    - The ``auto`` link probe all-reduces in the reduce dtype (:func:`link_probe`).

Numerics
    - bf16 keeps fp32's exponent range, so nothing overflows that fp32 would not; each
      rank's gradient keeps 8 bits; division by a power-of-two world size is exact. The
      optimizer, its state and the parameters stay fp32.
    - fp16 overflows above 65504: dividing before the sum keeps it in range; a loss
      scale is the user's (the launcher offers bf16 only).
    - Gradients are taken to be fp32 (the first parameter's dtype); bf16 gradients get
      caps and a fitted bandwidth off by that factor, performance only.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the bucket hook's
# annotations with the real types.
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .powersgd import PowerSGD, forget_buckets, powersgd_hook

__all__ = ["REDUCE_DTYPES", "OwnHook", "ReduceState", "bucket_hook", "hook_conflict", "link_probe",
           "own_hook", "parse_reduce_dtype"]

# The dtypes gradients may be all-reduced in, by the names a config may give them.
REDUCE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16, "fp32": None, "float32": None}


def parse_reduce_dtype(value: Any) -> torch.dtype | None:
    """``value`` (a torch dtype, one of ``REDUCE_DTYPES``' names, or None) as the narrower
    dtype to reduce in, or None for the gradients' own (fp32); ValueError otherwise."""
    if value is None or value == torch.float32:
        return None
    if value in (torch.bfloat16, torch.float16):
        return value
    if isinstance(value, str) and value.lower() in REDUCE_DTYPES:
        return REDUCE_DTYPES[value.lower()]
    raise ValueError(f"reduce_dtype={value!r} is not a dtype gradients can be all-reduced in: pass "
                     "torch.bfloat16 or torch.float16 (or 'bf16', 'fp16'), or None (or 'fp32') for their own dtype.")


def hook_conflict(entry: str, own: "OwnHook", hook: str) -> ValueError:
    """The refusal of ``own``'s setting (``reduce_dtype`` or ``compression``) on a DDP module
    that already has the comm hook ``hook``."""
    name = own.name
    return ValueError(
        f"{entry}({own.setting}) all-reduces the gradients through a comm hook of its own, and the comm "
        f"hook {hook!r} is already registered on this DDP module; DDP calls one hook. Drop {name} to keep "
        f"your hook, or register no hook and keep {name}.")


@dataclass(frozen=True)
class OwnHook:
    """The comm hook ``compile_ddp`` registers itself for ``reduce_dtype`` or ``compression``."""

    name: str  # the setting: "reduce_dtype" or "compression"
    value: str  # its value, normalised: "torch.bfloat16", "'powersgd:4:10'"
    state: Any
    bucket: Callable  # DDP's comm hook (the reducer strategies)
    spec: Any  # the setting's value as the strategies read it: the PowerSGD spec, or the dtype

    @property
    def setting(self) -> str:
        return f"{self.name}={self.value}"

    def buckets_changed(self) -> None:
        """DDP's bucket layout changed (realignment): drop what the state keeps per bucket."""
        forget_buckets(self.state)


def own_hook(group: dist.ProcessGroup, reduce_dtype: torch.dtype | None,
             compression: PowerSGD | None) -> OwnHook | None:
    """The hook for the (validated) settings, or None when neither is set."""
    if compression is not None:
        return OwnHook("compression", repr(str(compression)), compression.state(group), powersgd_hook, compression)
    if reduce_dtype is not None:
        state = ReduceState(group, reduce_dtype)
        return OwnHook("reduce_dtype", str(reduce_dtype), state, bucket_hook, reduce_dtype)
    return None


@dataclass(frozen=True)
class ReduceState:
    """What a hook needs: the group to reduce over and the dtype on the wire."""

    group: dist.ProcessGroup
    dtype: torch.dtype

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)


def bucket_hook(state: ReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's comm hook (the reducer strategies): the bucket all-reduced in ``state.dtype``
    and averaged, then written back into the bucket in its own dtype."""
    wire = bucket.buffer().to(state.dtype).div_(state.world_size)
    fut = dist.all_reduce(wire, group=state.group, async_op=True).get_future()

    def widen(fut: torch.futures.Future) -> torch.Tensor:
        out = bucket.buffer()
        out.copy_(fut.value()[0])
        return out

    return fut.then(widen)


def link_probe(dtype: torch.dtype, group: dist.ProcessGroup) -> Callable[[torch.Tensor], Any]:
    """The cost model's link probe for gradients reduced in ``dtype``: ``tensor`` (the
    gradient bytes) all-reduced as the hooks send it."""

    def probe(tensor: torch.Tensor) -> Any:
        return dist.all_reduce(tensor.to(dtype), group=group, async_op=True)

    return probe
