"""The setup both DDP entry points run on the DDP module: :func:`compile_ddp` at once,
:func:`compile_for_ddp` when its model first runs under DDP. See the Note below.

Note [One setup for both entry points]

Background
    ``compile_ddp`` and ``compile_for_ddp`` (``ddp_opt.compile_first``) wrote the same steps
    twice, and the copies drifted: a torch without realignment's internals was warned about
    by one and silently turned realignment off in the other, and a comm hook registered on
    DDP before compiling was a ``ValueError`` in one and a warning in the other. A user who
    switches entry point must meet the same outcome for the same DDP module.

Algorithm
    :func:`prepare`, in this order, for either entry point:

    1. The comm hook registered on DDP, and ours (``reduce_dtype=``, ``compression=``): both
       at once is refused (:func:`ddp_opt.compression.hooks.hook_conflict`).
    2. The optimizer in backward (``optimizer=``): refused beside a registered hook or
       ``find_unused_parameters=True`` (:func:`in_backward_for`).
    3. Whether DDP's buckets are realigned with the partitions (where the strategy's rules say
       ``realigns``: every strategy but traced, which leaves DDP's reducer out), each case with
       one outcome:

       - this torch lacks realignment's internals: one feature-off warning, DDP keeps its
         buckets;
       - DDP will never rebuild its buckets (``find_unused_parameters=True`` without
         ``static_graph``): a warning naming the entry point, DDP keeps its buckets;
       - a comm hook registered on DDP: a Python hook is registered again on the new reducer
         (``CommHooks``); a built-in (C++) one cannot be read back, so a warning says so and
         DDP keeps its buckets;
       - a strategy of ``one_partition`` (``"whole"``) has one partition, so nothing above
         applies but the first.

    A warning that says DDP keeps its buckets also says the plan is not in control
    (Note [In control, once]). What differs between the entry points stays in them: when
    DDP's first iteration is (``compile_for_ddp`` runs inside it), and what only
    ``compile_ddp`` takes (``strategy="traced"`` and ``"regional"``, ``bucket_cap_mb="auto"``,
    ``cache_dir``).

Notes
    ``tests/ddp_opt/test_ddp_entry_points.py`` runs the same bad cases through both entry
    points and asserts the same error or the same warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.nn.parallel import DistributedDataParallel

from ._torch_internals import REALIGN_SUPPORTED, python_comm_hooks, realign_unsupported_warning, registered_hook_name
from .alignment.realign import never_rebuilds, no_rebuild_warning
from .compression.hooks import OwnHook, hook_conflict, own_hook
from .config import DDPCompileConfig
from .strategies.rules import RULES
from .control import ControlFacts, backend_name
from .in_backward.stepper import BucketStep

__all__ = ["Prepared", "prepare", "in_backward_for", "own_hook_for", "builtin_hook_warning"]


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` decided for one DDP module.

    Attributes:
        hook: the name of the comm hook registered on DDP, or None.
        own: our comm hook (``reduce_dtype=``, ``compression=``), or None.
        in_backward: the optimizer in backward (``optimizer=``), or None.
        align: whether DDP's buckets are realigned with the partitions.
        in_control: False where a warning said DDP keeps its own buckets against the plan.
        control: the facts of the in-control line (Note [In control, once]) known at compile time.
    """

    hook: str | None
    own: OwnHook | None
    in_backward: BucketStep | None
    align: bool
    in_control: bool
    control: ControlFacts


def prepare(entry: str, ddp_model: DistributedDataParallel, config: DDPCompileConfig, strategy: str,
            stacklevel: int) -> Prepared:
    """The checks and decisions both entry points make on ``ddp_model`` (see the Note); ``entry``
    names the entry point in every message, ``stacklevel`` is the user's frame for warnings, seen
    from the caller of this function.

    Raises:
        ValueError: a registered comm hook beside ``reduce_dtype=``/``compression=`` or
            ``optimizer=``; ``optimizer=`` with ``find_unused_parameters=True``.
    """
    hook = registered_hook_name(ddp_model)
    own = own_hook_for(ddp_model, config)
    if hook is not None and own is not None:
        raise hook_conflict(entry, own, hook)
    in_backward = in_backward_for(entry, ddp_model, config, hook)
    align, in_control = _alignment(entry, ddp_model, config.align_buckets and RULES[strategy].realigns, strategy, hook,
                                   stacklevel + 2)
    control = ControlFacts(entry, backend_name(config.backend), in_control,
                           kept=None if config.align_buckets else "align_buckets=False")
    return Prepared(hook, own, in_backward, align, in_control, control)


def _alignment(entry: str, ddp_model: DistributedDataParallel, align: bool, strategy: str, hook: str | None,
               stacklevel: int) -> tuple[bool, bool]:
    """``(align, in_control)``: whether DDP's buckets are realigned, and False where a warning said
    they are not though the plan asked for it."""
    if not align:
        return False, True
    if not REALIGN_SUPPORTED:
        realign_unsupported_warning(entry)
        return False, False
    if RULES[strategy].one_partition:
        return True, True
    if never_rebuilds(ddp_model):
        warnings.warn(no_rebuild_warning(entry), stacklevel=stacklevel)
        return False, False
    if hook is not None and not python_comm_hooks(ddp_model):  # a built-in hook: not kept, not seen
        warnings.warn(builtin_hook_warning(entry, hook), stacklevel=stacklevel)
        return False, False
    return True, True


def builtin_hook_warning(entry: str, hook: str) -> str:
    """The warning for a comm hook realignment cannot register again on DDP's new reducer."""
    return (f"{entry}: the comm hook {hook!r} registered on the DDP module is a built-in one, which cannot be "
            "registered again when DDP's reducer is re-created to realign its buckets, so the buckets are left as "
            "DDP made them. Register a Python hook (ddp.register_comm_hook(state, hook): it is kept), or pass "
            "align_buckets=False to silence this.")


def in_backward_for(entry: str, ddp_model: DistributedDataParallel, config: DDPCompileConfig,
                    hook: str | None) -> BucketStep | None:
    """The optimizer in backward of ``config.optimizer``, or None; refused where it cannot be exact."""
    if config.optimizer is None:
        return None
    if hook is not None:
        raise ValueError(
            f"{entry}(optimizer=...) follows each bucket's reduction with its update through a comm hook of "
            f"its own, and the comm hook {hook!r} is already registered on this DDP module; DDP calls one hook. "
            "Drop the hook (reduce_dtype= and compression= work with optimizer=), or drop optimizer= and call "
            "optimizer.step() after backward.")
    if ddp_model.find_unused_parameters:
        raise ValueError(
            f"{entry}(optimizer=...) with find_unused_parameters=True: DDP hands an unused parameter's bucket a "
            "zero gradient, and updating from it would move that parameter (momentum, weight decay) where "
            "optimizer.step() after backward leaves it alone. Pass find_unused_parameters=False (with static_graph="
            "True if some parameters are unused every step), or drop optimizer=.")
    return BucketStep(config.optimizer)


def own_hook_for(ddp_model: DistributedDataParallel, config: DDPCompileConfig) -> OwnHook | None:
    """The comm hook of ``reduce_dtype`` or ``compression`` on DDP's group; else None."""
    return own_hook(ddp_model.process_group, config.reduce_dtype, config.compression)
