"""``build_backend``: the one place that stacks the wrappers around a dynamo backend
(shared compile, backward with forward, a strategy's transform, the user's wrapper,
the compile barrier), in the order Note [Backend wrapping order] explains.

It takes the pieces as arguments and knows nothing of DDP or FSDP: ``ddp_opt``
passes its splitter (or traced plan) as the transform, ``fsdp_opt`` none.

Note [Backend wrapping order]

Background
    Every entry point (``compile_ddp``, ``compile_for_ddp``, ``fsdp_opt.apply``)
    hands dynamo a backend made of the same layers. Stacked in another order they
    still run, but one rank can end up compiling inside a collective, or ranks
    compile the same graph twice, so the order is kept in one function.

Algorithm
    From the inside out:

    1. ``share.wrap_compile``: each compile is claimed by the first rank that reaches
       it and loaded by the others (Note [Shared compile]). Innermost, so that what is
       claimed is each graph the compiler really compiles (each partition, each
       block), not the captured graph before it is split. A shared compile already
       compiles the backward together with the forward.
    2. Without a share, ``backward_with_forward`` when asked: the backward compiles
       right after its forward, so no rank compiles it at the first backward, among
       backward's all-reduces and past the step gate (Note [Step gate]); and a cache
       entry is keyed as a shared compile keys it (Note [Compile cache]).
    3. The strategy's transform (DDP's splitter, the traced plan's forward backend):
       it splits or prepares the captured graph and calls the layers above for each
       piece.
    4. The user's ``wrap_backend``: it sees the backend dynamo calls (the splitter,
       or the plain backend), as documented, with every captured graph.
    5. ``share.wrap_graph``, outermost: no rank leaves a captured graph's compile
       before every rank that compiles it is done, so the first collective after the
       compile cannot time out on one rank's long compile. It covers everything the
       graph's compile does, the user's wrapper included; ``barrier_if`` says which
       graphs a collective follows.

Notes
    - Without a share, layers 1 and 5 are left out: one rank, or ``share=False``.
    - ``fsdp_opt`` compiles each block with no transform and no wrapper of the user:
      layers 1 and 5 only.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from ..ranks import share as _share
from ..ranks.share import CompileShare

log = logging.getLogger(__name__)

__all__ = ["build_backend"]

Backend = Callable[..., Any]


def build_backend(backend: Backend, *, share: CompileShare | None = None, backward_with_forward: bool = False,
                  transform: Callable[[Backend], Backend] | None = None,
                  wrap_backend: Callable[[Backend], Backend] | None = None,
                  barrier_if: Callable[[Sequence[Any]], bool] | None = None) -> Backend:
    """``backend`` wrapped in the order of Note [Backend wrapping order].

    Args:
        backend: the plain dynamo backend ``(gm, example_inputs) -> callable``.
        share: the group's :class:`compiler.ranks.share.CompileShare`; None leaves the
            shared compile and its barrier out.
        backward_with_forward: without a share, compile each backward right after its
            forward (a share does it anyway).
        transform: the strategy's ``backend -> backend`` (a splitter's ``compile_fn``);
            None: each captured graph compiles whole.
        wrap_backend: the user's ``backend -> backend``, given the transformed backend.
        barrier_if: given a graph's example inputs, whether the barrier holds for it;
            None: every graph.

    Returns:
        The backend to give ``torch.compile``.
    """
    if share is not None:
        backend = share.wrap_compile(backend)
    elif backward_with_forward:
        backend = _share.backward_with_forward(backend)
    if transform is not None:
        backend = transform(backend)
    if wrap_backend is not None:
        backend = wrap_backend(backend)
    if share is not None:
        backend = share.wrap_graph(backend, barrier_if=barrier_if)
    return backend
