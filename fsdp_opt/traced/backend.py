"""The dynamo backend of traced FSDP: AOTAutograd with the min-cut partitioner, the
re-gather tags on the joint graph, the collective schedule on every graph, and the
graph compiler (``aot_eager`` or Inductor, the latter per segment).

The order of the passes, and why:

1. Joint graph: ``tag_regathers`` (Note [Traced FSDP schedule]) before the min-cut
   partitioner, which then recomputes each resharded unit's all-gather in backward
   instead of saving its gathered parameters.
2. Forward, backward and inference graphs: ``plan_schedule`` then ``apply_schedule``;
   the placements are handed to ``on_schedule`` for the plan's table.
3. The compiler: ``aot_eager`` runs the scheduled graph as it is; Inductor compiles
   the segments between its collectives (Note [Compiled segments]).
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any, Callable, Sequence

from torch import fx

from .._torch_internals import aot_backend, inductor_config_patch, inductor_piece_compiler, min_cut_partition
from .schedule import Schedule, apply_schedule, plan_schedule, tag_regathers
from .segments import compile_segments

log = logging.getLogger(__name__)

__all__ = ["GRAPH_COMPILERS", "traced_backend"]

GRAPH_COMPILERS = ("aot_eager", "inductor")  # what traced FSDP compiles its graphs with


def traced_backend(compiler: str, *, prefetch: int, reduce_inflight: int, resharded: Callable[[], Sequence[bool]] | None,
                   on_schedule: Callable[[str, Schedule], None], extra_bytes: int = 0, mode: str | None = None,
                   options: dict | None = None, dynamic: bool | None = None) -> Callable:
    """A dynamo backend ``(gm, example_inputs) -> callable`` for the whole traced model.

    Args:
        compiler: ``"aot_eager"`` or ``"inductor"``.
        prefetch: all-gathers issued this many units ahead (Note [Traced FSDP schedule]).
        reduce_inflight: reductions issued before the oldest one is awaited.
        extra_bytes: how far prefetching may raise a graph's just-in-time peak memory.
        resharded: gives, per unit, whether backward gathers it again (read when a joint graph
            is partitioned); None: every unit.
        on_schedule: called with ``"forward"``, ``"backward"`` or ``"inference"`` and each
            graph's schedule, after the graph is reordered.
        mode, options, dynamic: Inductor's, as ``torch.compile`` takes them.
    """
    if compiler not in GRAPH_COMPILERS:  # pragma: no cover - checked where the setting is given
        raise ValueError(f"traced FSDP compiles with {GRAPH_COMPILERS}, not {compiler!r}")
    counter = itertools.count()

    def scheduled(kind: str, gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
        schedule = plan_schedule(gm, prefetch, reduce_inflight, inputs_freed=kind == "backward",
                                 extra_bytes=extra_bytes)
        apply_schedule(gm, schedule)
        on_schedule(kind, schedule)
        if compiler == "aot_eager":
            return gm
        piece = inductor_piece_compiler(is_backward=kind == "backward", graph_id=next(counter))
        with inductor_config_patch(mode, options, dynamic):
            return compile_segments(gm, example_inputs, piece)

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        tagged = tag_regathers(joint, resharded() if resharded is not None else None)
        log.debug("fsdp_opt traced: %d all-gather(s) tagged to run again in backward", tagged)
        return min_cut_partition(joint, joint_inputs, **kwargs)

    return aot_backend(
        fw_compiler=functools.partial(scheduled, "forward"),
        bw_compiler=functools.partial(scheduled, "backward"),
        inference_compiler=functools.partial(scheduled, "inference"),
        partition_fn=partition,
        inductor_decompositions=compiler == "inductor",
    )
