"""Enforced alignment: give DDP's reducer the partitions as its bucket caps.

Note [Bucket realignment]

Background
    DDP rebuilds its buckets once, after its first iteration, in the order gradients
    became ready. Under a split, compiled graph that order differs from the reverse graph
    order the plan counted in, so runtime buckets straddle partitions.

Algorithm
    After the first step, re-create DDP's reducer as DDP does when unpickled, with
    per-bucket rebuild caps equal to the planned partition sizes in gradient-ready order.
    Each partition's gradients become ready together, after the previous one's, so a
    bucket capped at exactly its partition's size closes at the partition's end: the
    rebuilt buckets *are* the partitions.

Notes
    - Comm hooks live on the reducer: those registered through
      ``CompiledDDP.register_comm_hook`` are registered again; one registered on the DDP
      module before ``compile_ddp`` cannot be recovered, so that case is refused
      (``align_buckets=False`` keeps DDP's buckets).
    - Every DDP setting the user chose holds on the new reducer as on the old. DDP's own
      ``_ddp_init_helper`` builds it from DDP's attributes, so ``gradient_as_bucket_view`` and
      (torch >= 2.15) ``batched_grad_copy`` and ``lazy_bucket_allocation`` carry over by
      themselves; ``forward_sync_buffers`` (``broadcast_buffers`` before 2.15) is read by DDP's
      forward, not the reducer. What lives only in the reducer is set again, as
      ``DDP.__setstate__`` does: ``static_graph`` and manual finalization (torch >= 2.15,
      ``require_manual_backward_finalization``; lost, the new reducer finalizes by itself and
      the user's ``finalize_backward()`` raises). ``tests/ddp_opt/test_ddp_realign_settings.py`` trains
      each past realignment against eager DDP: a setting a new torch keeps only in its reducer
      fails there first, and is carried in ``_torch_internals.rebuild_reducer`` or refused in
      ``compile_ddp``.
    - With ``static_graph=True`` the new reducer is static too; realigned buckets appear
      one step later.
    - Alignment 1.0 is not always reachable (parameters outside every graph, buckets per
      dtype); :func:`check_realignment` measures it and warns with the likely cause.
    - DDP internals live in ``ddp_opt._torch_internals``; a torch lacking one turns
      realignment off with a warning naming it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch.nn.parallel import DistributedDataParallel

from .._torch_internals import is_ddp_ignored, rebuild_reducer, reducer_finalized, registered_hook_name
from .measure import Alignment, measure_alignment, runtime_buckets
from ..planning.buckets import Bucket, main_kind, param_kind, realign_caps

log = logging.getLogger(__name__)

__all__ = ["check_realignment", "never_rebuilds", "no_rebuild_warning", "registered_hook_name", "realign_reducer",
           "reducer_finalized"]


def never_rebuilds(ddp_model: DistributedDataParallel) -> bool:
    """Whether DDP will never rebuild its buckets: its reducer rebuilds them once, after the
    first iteration, only with ``static_graph=True`` or ``find_unused_parameters=False``."""
    return bool(getattr(ddp_model, "find_unused_parameters", False)) and not getattr(ddp_model, "static_graph", False)


def no_rebuild_warning(entry: str) -> str:
    """What :func:`never_rebuilds` costs and how to fix it, said once at compile time by ``entry``."""
    return (f"{entry}: this DDP module was built with find_unused_parameters=True and without static_graph, and "
            "such a DDP never rebuilds its gradient buckets, so they keep DDP's parameter-order layout instead of "
            "the graph partitions (bucket realignment cannot take effect): an all-reduce then waits for gradients "
            "of a later partition, and part of the overlap of communication with backward is lost; training stays "
            "correct. If every parameter gets a gradient at every step, build DDP with "
            "find_unused_parameters=False (HF Trainer: TrainingArguments(ddp_find_unused_parameters=False)); if "
            "the graph is static, static_graph=True. align_buckets=False silences this.")


def realign_reducer(ddp_model: DistributedDataParallel, buckets: list[Bucket],
                    hooks: list[tuple[Any, Callable]]) -> tuple[int, ...]:
    """Re-create DDP's reducer with rebuild caps equal to the partitions' sizes.

    Args:
        ddp_model: the DDP module; its reducer is replaced.
        buckets: the plan, in forward order.
        hooks: ``(state, hook)`` comm hooks to register on the new reducer.

    Returns:
        The caps given to the reducer, in gradient-ready order.
    """
    caps = realign_caps(buckets)
    rebuild_reducer(ddp_model, caps)
    for state, hook in hooks:
        ddp_model.register_comm_hook(state, hook)
    log.info("ddp_opt realigned DDP's buckets with the %d partitions (caps %s B)", len(caps), list(caps))
    return caps


def check_realignment(ddp_model: DistributedDataParallel, buckets: list[Bucket]) -> Alignment | None:
    """Measure the realigned buckets against the partitions; warn, with the likely
    cause and what to do, when some bucket straddles partitions."""
    alignment = measure_alignment(ddp_model, buckets)
    if alignment is None or alignment.fraction >= 1.0:
        return alignment
    minor = _only_minor_kinds_straddle(ddp_model, alignment)
    if minor:
        log.info(
            "compile_ddp realigned DDP's buckets with the partitions for the parameters of the main dtype/device; "
            "DDP buckets the %s parameters apart and reduces them after the others, as it does without compile "
            "(alignment %.2f of gradient bytes).", ", ".join(minor), alignment.fraction,
        )
        return alignment
    straddling = alignment.aligned.count(False)
    log.warning(
        "compile_ddp realigned DDP's buckets with the %d partitions, but %d of DDP's %d runtime buckets still "
        "straddle partitions (alignment %.2f of gradient bytes): their all-reduces wait for a later partition's "
        "backward, and that much overlap of communication with backward is lost. Likely cause: %s "
        "Training is correct either way; ddp_opt.measure_alignment(ddp_model, compiled.buckets) shows the "
        "buckets, and compile_ddp(..., align_buckets=False) keeps DDP's own buckets instead.",
        sum(1 for b in buckets if b.size), straddling, len(alignment.aligned), alignment.fraction,
        _likely_cause(ddp_model, buckets),
    )
    return alignment


def _only_minor_kinds_straddle(ddp_model: DistributedDataParallel, alignment: Alignment) -> list[str]:
    """The kinds of the straddling buckets when none of them is the kind with the most bytes; else []."""
    kind_of = {id(p): param_kind(p) for p in ddp_model.module.parameters()}
    pairs = [(kind_of[i], n, ok) for bucket, ok in zip(runtime_buckets(ddp_model), alignment.aligned) for i, n in bucket]
    straddling = {kind for kind, _, ok in pairs if not ok}
    kinds = {kind for kind, _, _ in pairs}
    main = main_kind((kind, n) for kind, n, _ in pairs)
    return sorted(straddling) if len(kinds) > 1 and main not in straddling else []


def _likely_cause(ddp_model: DistributedDataParallel, buckets: list[Bucket]) -> str:
    planned = {i for b in buckets for i in b.param_ids}
    reduced = [(n, p) for n, p in ddp_model.module.named_parameters() if p.requires_grad
               and not is_ddp_ignored(p)]
    outside = [n for n, p in reduced if id(p) not in planned]
    if outside:
        listed = ", ".join(outside[:4]) + (", ..." if len(outside) > 4 else "")
        return (f"{len(outside)} parameter(s) are in no compiled graph ({listed}): used in eager code between "
                "graph breaks, or not used by forward, so DDP buckets their gradients wherever they arrive. "
                "Remove the graph break around them (torch._dynamo.explain names it).")
    kinds = sorted({param_kind(p) for _, p in reduced})
    if len(kinds) > 1:
        return (f"the parameters come in {len(kinds)} dtype/device kinds ({', '.join(kinds)}); DDP buckets each "
                "kind apart and walks one list of caps per kind, so caps that close every kind's buckets at "
                "partition ends may not exist. Give the parameters one dtype (mixed precision by autocast keeps "
                "them so).")
    if getattr(ddp_model, "find_unused_parameters", False) and not ddp_model.static_graph:
        return ("DDP(find_unused_parameters=True) does not rebuild its buckets, so the new caps never take "
                "effect. Pass find_unused_parameters=False, or static_graph=True if the graph is static.")
    return ("the compiled partitions hand out their gradients in an order the plan did not expect "
            "(please report it with the output of ddp_opt.measure_alignment).")
