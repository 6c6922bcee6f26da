"""PowerSGD's step for one of DDP's CPU buckets, run whole on the calling thread: PyTorch's
``powerSGD_hook`` arithmetic and memories, with the products taken in their fast form.

Note [PowerSGD of a bucket]

Background
    Under the reducer strategies (split, whole, regional) ``compile_ddp`` compresses through
    DDP's comm hook. PyTorch's ``powerSGD_hook`` takes ``M Q`` and ``M^T P`` as ``bmm``
    products whose outputs have r columns, the slow kernel on the CPU (Note [Products with a
    rank-r factor] in ``factors.py``). The traced strategy already took them transposed;
    under the reducer strategies the slow form ran on the core that runs backward.

Algorithm
    :func:`compress_bucket` does what PyTorch's hook does, in its order, with
    ``use_error_feedback=True``, ``warm_start=True`` and unbatched matrices (what
    ``PowerSGD.state`` makes), synchronously: its caller, ``powersgd_hook``, runs each bucket
    whole on the state's worker thread (Note [PowerSGD compression]).

    1. Before ``start_powerSGD_iter``: the bucket divided by the world size and all-reduced.
    2. ``M = bucket + E`` (E per bucket index, zeros at first), in the bucket.
    3. Each gradient whose matrix ``shape[0] x rest`` PowerSGD's rule compresses
       (``factors.compressed_shape``, at PyTorch's default rate) gets a P and
       a Q, slices of the bucket's P and Q memories, laid out as the hook lays them: grouped by
       shape in first-seen order. The bucket's first compressed step draws each Q as the hook
       does (``torch.randn`` under ``fork_rng``, seeded from ``state.rng``), later ones keep it.
    4. The other gradients' all-reduce started (asynchronous, as the hook starts it); each Q
       orthogonalised, ``P = M Q`` while it runs; the other gradients' mean written back, then
       the P's all-reduced; each P orthogonalised, ``Q = M^T P``; the Q's all-reduced and
       divided; ``P Q^T`` written into the bucket.
       A bucket with no other gradients (or no matrix) skips that all-reduce, on every rank
       alike: the buckets are the same on every rank, and so is the collectives' order.
       Started first, that all-reduce's link time and the wait for the slower rank pass
       under the P products (measured faster than issuing it after them: docs/compression.md).
    5. ``E = M - result``, each gradient's slice of E written just before its result replaces
       M in the bucket. PyTorch's hook copies the whole bucket at step 2 to take E as ``copy -
       bucket`` at the end; no copy here, so the hook needs a bucket's bytes less (under a
       one-bucket plan, all the gradients' bytes), at the same step time and with the same
       losses (measured: docs/compression.md).

    The state is PyTorch's ``PowerSGDState`` (its memories by bucket index, its step count,
    its compression counters), so realignment's ``forget_buckets`` and a user reading the
    counters see what they saw with PyTorch's hook.

Numerics
    Equal to PyTorch's hook up to the float rounding of the products
    (tests/ddp_opt/test_ddp_powersgd.py: step by step against eager DDP with PyTorch's hook).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from .factors import compressed_shape, orthogonalize, project, project_back

__all__ = ["compress_bucket"]


def compress_bucket(state, bucket) -> torch.Tensor:
    """One DDP bucket through PowerSGD with ``state`` (a ``PowerSGDState`` with error feedback
    and warm start), synchronously; returns the bucket's buffer, reduced (Note [PowerSGD of a
    bucket])."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        dist.all_reduce(buffer.div_(world), group=group)
        state.maybe_increase_iter(bucket)
        return buffer
    index = bucket.index()
    error = state.error_dict.get(index)
    if error is None:
        error = state.error_dict[index] = torch.zeros_like(buffer)
    buffer.add_(error)
    by_shape: dict[tuple[int, int, int], list[torch.Tensor]] = defaultdict(list)
    plain = []
    for grad in bucket.gradients():
        shape = compressed_shape(grad, state.matrix_approximation_rank)
        state.total_numel_before_compression += grad.numel()
        if shape is None:
            plain.append(grad)
            state.total_numel_after_compression += grad.numel()
        else:
            n, m, rank = shape
            by_shape[shape].append(grad.view(n, m))
            state.total_numel_after_compression += (n + m) * rank
    shapes = [shape for shape, group_ in by_shape.items() for _ in group_]
    matrices = [matrix for group_ in by_shape.values() for matrix in group_]
    if plain:
        flat = torch.cat([grad.reshape(-1) for grad in plain])
        reducing = dist.all_reduce(flat, group=group, async_op=True)
    ps, qs = _memories(state, index, shapes, buffer)
    for matrix, p, q in zip(matrices, ps, qs):
        q.copy_(orthogonalize(q))
        p.copy_(project(matrix, q))
    if plain:
        reducing.wait()
        flat.div_(world)
        offset = 0
        for grad in plain:
            mean = flat[offset:offset + grad.numel()].view_as(grad)
            torch.sub(grad, mean, out=_at(error, grad, buffer))
            grad.copy_(mean)
            offset += grad.numel()
    if matrices:
        dist.all_reduce(state.p_memory_dict[index], group=group)
        for matrix, p, q in zip(matrices, ps, qs):
            p.copy_(orthogonalize(p))
            q.copy_(project_back(matrix, p))
        dist.all_reduce(state.q_memory_dict[index], group=group)
        state.q_memory_dict[index].div_(world)
        for matrix, p, q in zip(matrices, ps, qs):
            torch.addmm(matrix, p, q.t(), alpha=-1, out=_at(error, matrix, buffer))
            torch.mm(p, q.t(), out=matrix)
    state.maybe_increase_iter(bucket)
    return buffer


def _at(tensor: torch.Tensor, view: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` (shaped as ``base``) at the place where ``view`` lies in ``base``, in ``view``'s
    shape."""
    offset = (view.data_ptr() - base.data_ptr()) // base.element_size()
    if not 0 <= offset <= base.numel() - view.numel():  # DDP's GradBucket gives views of its buffer
        raise RuntimeError("PowerSGD's bucket hook was given a gradient that does not lie in the bucket's buffer; "
                           "it writes each result into the buffer it returns. This is a bug: please report it "
                           "with your torch version.")
    return tensor.view(-1)[offset:offset + view.numel()].view(view.shape)


def _memories(state, index: int, shapes: list[tuple[int, int, int]], like: torch.Tensor
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The bucket's P and Q memories, one slice per matrix of ``shapes`` (``(n, m, r)``); made, with
    each Q drawn as PyTorch's hook draws it, at the bucket's first compressed step."""
    fresh = index not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[index] = like.new_empty(sum(n * r for n, _, r in shapes))
        state.q_memory_dict[index] = like.new_empty(sum(m * r for _, m, r in shapes))
    ps, qs, p_at, q_at = [], [], 0, 0
    for n, m, r in shapes:
        ps.append(state.p_memory_dict[index][p_at:p_at + n * r].view(n, r))
        qs.append(state.q_memory_dict[index][q_at:q_at + m * r].view(m, r))
        p_at, q_at = p_at + n * r, q_at + m * r
    if fresh:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(1, *q.shape, device="cpu", dtype=like.dtype)[0])
    return ps, qs
