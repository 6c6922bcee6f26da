"""The physical limit of a DDP step and every row's distance from it, plus each row's
ratio to the best peer (see Note [Physical limit of a step]).

Note [Physical limit of a step]
-------------------------------
Background: overlap efficiency ``(compute + comm - step) / min(compute, comm)`` has a
ceiling below 1 whenever communication outlasts backward, so it cannot say how far a
mode is from the best step the model and the link allow. The limit can.

Derivation (DDP): a synchronised step must run forward, run backward (which makes every
gradient), carry every gradient byte over the link, and step the optimizer. Nothing is
sent before forward ends; the optimizer starts once backward has ended and the last
byte arrived; backward and the link may overlap completely, neither takes less than
alone. So ``step >= fwd + max(bwd, comm) + opt =: limit``, and ``step_over_limit`` is
>= 1, 1.0 a perfect step.

Parts, measured in the same job as the modes: fwd, bwd from each mode's ``no_sync``
step, opt from its synchronised steps (the smallest median over the modes, so the bound
holds for every mode); comm one all-reduce of one flat float32 tensor of all gradient
bytes over the job's link (the real shaped link, the simulated link's charge, or
loopback): one message pays one latency, no bucketing carries the bytes faster.

Compressed gradients (PowerSGD): ``comm`` is the link time of what crosses (the P and Q
factors and the tensors left uncompressed, one flat message), and the power iteration
is work no schedule avoids: per compressed matrix ``M = grad + E``, ``P = M orth(Q)``,
``orth(P)``, ``Q = M^T P``, ``approx = P Q^T``, ``E = M - approx``. It runs on the device
that runs backward (one core per rank on the CPU runs, one stream on a GPU), so it adds
to backward there, never to the link: ``step >= fwd + max(bwd + compress, comm) + opt``.
``compress`` is that arithmetic timed inside a backward that runs it on its own core, every
rank at once (``measure_powersgd_in_backward``): the model's eager forward and backward with
the iteration run on each compressed gradient as autograd accumulates it, the seconds spent
in it summed per round, the median on rank 0's clock. It is also timed alone on the same
shapes (``measure_powersgd_compute``, reported as ``compress_alone``), where its buffers stay
in cache and nothing else runs; in a step they cannot. The products with the rank-r factors
are in the fastest form known here (``project`` and ``project_back``, Note [Products with a
rank-r factor]), not PyTorch's hook's form, so no implementation pays for a slower product here;
uncompressed rows have ``compress = 0``, and the bound is as before. The difference of whole
forward-and-backward rounds with and without the iteration would also charge what it evicts
from backward's caches; it was tried and was noisier than the iteration itself (-5 to +18 ms
on rounds of 224 to 258 ms, 16 rounds), so the limit does not charge that part.

Not tighter on purpose: the first and last gradients' ready times would need
per-parameter timings not measured, so the bound stays valid, only less tight. It
does not charge CPU contention between gloo and compute, and an optimizer applied per
bucket could beat it by at most ``opt``.

FSDP2 (every unit resharded after forward): all-gather every parameter for forward and
again for backward, reduce-scatter every gradient, one link and one device, so
``step >= max(fwd + bwd, 2 ag + rs, fwd + rs) + opt``, with ``ag``/``rs`` one flat
collective of all parameter bytes, fwd and bwd from an unsharded copy without
communication, opt the fastest FSDP mode's sharded step. Each collective is timed as one
collective of all the bytes and as ``CHUNKS`` collectives of a part each, issued back to back,
and the faster counts: over the shaped links a single transfer started on an idle link was
measured slower than the same bytes in a stream of smaller ones (at 100 Mbit one all-gather of
6.3 MiB took 352 ms, a traced step's forward moved them in 288 ms), and a bound a real step
beats is no bound. ``rs`` is also the faster of gloo's ``reduce_scatter_tensor`` and an
``all_to_all_single`` whose received rows each rank sums: gloo's reduce-scatter carries every
byte of the buffer (as long as an all-reduce, twice an all-gather), while a reduce-scatter need
only move the bytes other ranks own, as an all-gather does; the row records which
(``limit_reduce_scatter_via``). Rows measured before 2026-11-28 timed one
``reduce_scatter_tensor`` and one all-gather only. With ``reduce_dtype=bf16``
``rs`` is in bf16; FSDP2's replicate gathers nothing, so its limit is DDP's. Each row's
best peer reduces the same way (sharded or replicated, same dtype).

Best peer: the peers' row (eager DDP, PyTorch's splitter, compiled autograd's reducer,
every cap) with the least median step; ``ratio_vs_best_peer`` is the median of
per-round ratios to it, with its IQR.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .stats import median, ratio_summary

__all__ = ["LimitParts", "FSDPLimitParts", "limit_parts", "add_limit_columns", "measure_comm", "measure_fsdp_comm",
           "measure_powersgd_compute", "measure_powersgd_in_backward", "powersgd_shapes", "PEER_MODES",
           "FSDP_PEER_MODES", "against_peers", "wire_kind", "wire_numel"]

PEER_MODES = ("eager", "builtin", "compiled_autograd",  # what users run today (the modes we must beat)
              "eager_bf16", "builtin_bf16", "compiled_autograd_bf16",  # the same with the bf16 hook a user registers
              "eager_powersgd")  # and with PyTorch's PowerSGD hook
WIRE_BYTES = {"fp32": 4, "bf16": 2}  # bytes per gradient element on the link, by a row's reduce_dtype
FSDP_PEER_MODES = ("eager", "per_block",  # FSDP2 as is, and torchtitan's per-block compile recipe
                   "eager_bf16", "per_block_bf16",  # the same with MixedPrecisionPolicy(reduce_dtype=bf16)
                   "replicate_eager", "replicate_per_block", "replicate_whole")  # FSDP2's replicate, as users run it


def wire_kind(row: dict) -> str:
    """What a row's gradients cross the link as: its compression, else its reduce dtype."""
    return row.get("compression") or row.get("reduce_dtype", "fp32")


def wire_numel(params, compression: str | None) -> int:
    """Elements each rank sends per step: every gradient's, or under PowerSGD the P and Q of each
    matrix worth compressing (PyTorch's rule: ``(n + m) r`` at least halves ``n m``) and the rest."""
    params = list(params)
    return sum((n + m) * r if n else p.numel() for p, (n, m, r) in zip(params, _compressed_shapes(params, compression)))


@dataclass(frozen=True)
class LimitParts:
    """Seconds of each part of the limit (Note [Physical limit of a step])."""

    fwd_s: float
    bwd_s: float
    opt_s: float
    comm_s: float
    compress_s: float = 0.0  # the power iteration's own compute, on backward's device (0: not compressed)
    compress_alone_s: float = 0.0  # the same iteration timed alone (reported beside it; not in the limit)

    @property
    def limit_s(self) -> float:
        return self.fwd_s + max(self.bwd_s + self.compress_s, self.comm_s) + self.opt_s

    def columns(self) -> dict:
        return {"limit_ms": self.limit_s * 1e3, "limit_fwd_ms": self.fwd_s * 1e3, "limit_bwd_ms": self.bwd_s * 1e3,
                "limit_opt_ms": self.opt_s * 1e3, "limit_comm_ms": self.comm_s * 1e3,
                "limit_compress_ms": self.compress_s * 1e3, "limit_compress_alone_ms": self.compress_alone_s * 1e3,
                "link_bound": self.comm_s > self.bwd_s + self.compress_s}


@dataclass(frozen=True)
class FSDPLimitParts:
    """Seconds of each part of an FSDP2 step's limit (Note [Physical limit of a step])."""

    fwd_s: float
    bwd_s: float
    opt_s: float
    ag_s: float  # one all-gather of every parameter
    rs_s: float  # one reduce-scatter of every gradient, the fastest way measured
    rs_via: str = "reduce_scatter_tensor"  # that way

    @property
    def limit_s(self) -> float:
        return max(self.fwd_s + self.bwd_s, 2 * self.ag_s + self.rs_s, self.fwd_s + self.rs_s) + self.opt_s

    def columns(self) -> dict:
        return {"limit_ms": self.limit_s * 1e3, "limit_fwd_ms": self.fwd_s * 1e3, "limit_bwd_ms": self.bwd_s * 1e3,
                "limit_opt_ms": self.opt_s * 1e3, "limit_allgather_ms": self.ag_s * 1e3,
                "limit_reduce_scatter_ms": self.rs_s * 1e3, "limit_reduce_scatter_via": self.rs_via,
                "link_bound": 2 * self.ag_s + self.rs_s > self.fwd_s + self.bwd_s}


def limit_parts(rows: Sequence[dict], comm_s: float, compress_s: float = 0.0,
                compress_alone_s: float = 0.0) -> LimitParts:
    """The limit of the rows' job: the fastest forward, backward and optimizer step of any
    row (their ``fwd_ms``, ``bwd_ms``, ``opt_ms`` medians; the optimizer step only of rows
    that step after backward: under the optimizer in backward the step after backward finds
    no gradients, and the update's time is inside backward), the measured ``comm_s`` and, for
    compressed gradients, the measured ``compress_s`` (``measure_powersgd_in_backward``; beside
    it ``compress_alone_s``, ``measure_powersgd_compute``)."""
    if not rows:
        raise ValueError("limit_parts needs the rows of at least one mode: the limit takes their fastest compute.")
    stepping = [r for r in rows if not r.get("optimizer_in_backward")] or rows
    return LimitParts(fwd_s=min(r["fwd_ms"] for r in rows) / 1e3, bwd_s=min(r["bwd_ms"] for r in rows) / 1e3,
                      opt_s=min(r["opt_ms"] for r in stepping) / 1e3, comm_s=comm_s, compress_s=compress_s,
                      compress_alone_s=compress_alone_s)


def _best_peer(rows: Sequence[dict], peers: Sequence[str], dtype: str = "fp32") -> dict | None:
    candidates = [r for r in rows if r["mode"] in peers and r.get("step_ms_rounds") and wire_kind(r) == dtype]
    return min(candidates, key=lambda r: r["step_ms_median"]) if candidates else None


def add_limit_columns(rows: list[dict], parts: LimitParts | FSDPLimitParts | dict[str, LimitParts],
                      peers: Sequence[str] = PEER_MODES) -> None:
    """Give every row ``limit_ms`` (and its parts), ``step_over_limit``, ``best_peer`` and
    ``ratio_vs_best_peer`` with its IQR (None where no peer ran). With ``parts`` per reduce dtype
    (DDP), a row's limit counts the bytes it sends and its best peer sends the same dtype; a row
    reduced in another dtype than fp32 also gets ``ratio_vs_best_fp32_peer``."""
    for r in rows:
        dtype = wire_kind(r)
        part = parts[dtype] if isinstance(parts, dict) else parts
        r.update(part.columns())
        r["step_over_limit"] = r["step_ms_median"] / (part.limit_s * 1e3)
        best = _best_peer(rows, peers, dtype)
        r["best_peer"] = best.get("runner", best["mode"]) if best is not None else None
        ratio = ratio_summary(r["step_ms_rounds"], best["step_ms_rounds"]) if best is not None else (None,) * 3
        r["ratio_vs_best_peer"], r["ratio_vs_best_peer_q1"], r["ratio_vs_best_peer_q3"] = ratio
        fp32 = _best_peer(rows, peers) if dtype != "fp32" else None
        if fp32 is not None:
            r["best_fp32_peer"] = fp32.get("runner", fp32["mode"])
            (r["ratio_vs_best_fp32_peer"], r["ratio_vs_best_fp32_peer_q1"],
             r["ratio_vs_best_fp32_peer_q3"]) = ratio_summary(r["step_ms_rounds"], fp32["step_ms_rounds"])


def _timed(collective, device, repeats: int, at_least: float = 0.0) -> float:
    """Median seconds (rank 0's clock) of ``repeats`` calls of ``collective()``, a barrier before each."""
    import torch.distributed as dist

    from .device import clock

    times = []
    for _ in range(max(repeats, 1)):
        dist.barrier()
        t0 = clock(device)
        collective()
        times.append(max(clock(device) - t0, at_least))
    return median(times)


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def measure_comm(nbytes: int, device, transfer_s, repeats: int, dtype: str = "fp32") -> float:
    """Median seconds of all-reducing one flat tensor of ``nbytes`` in ``dtype`` (a ``WIRE_BYTES``
    name) on the default group; each time at least ``transfer_s(nbytes)`` (a simulated link's
    charge; ``lambda n: 0.0`` for a real link)."""
    import torch
    import torch.distributed as dist

    flat = torch.zeros(max(nbytes // WIRE_BYTES[dtype], 1), dtype=_torch_dtype(dtype), device=device)
    return _timed(lambda: dist.all_reduce(flat), flat.device, repeats, transfer_s(nbytes))


def powersgd_shapes(params, compression: str | None) -> list[tuple[int, int, int]]:
    """``(n, m, r)`` of each gradient matrix PowerSGD compresses (PyTorch's rule, as ``wire_numel``)."""
    return [shape for shape in _compressed_shapes(params, compression) if shape[0]]


def _compressed_shapes(params, compression: str | None) -> list[tuple[int, int, int]]:
    """Per parameter ``(n, m, r)`` where PowerSGD compresses its gradient, ``(0, 0, 0)`` where not."""
    from ddp_opt.compression.powersgd import parse_compression
    from ddp_opt.compression.factors import compressed_shape

    spec = parse_compression(compression)
    return [(spec and compressed_shape(p, spec.rank)) or (0, 0, 0) for p in params]


def _power_iteration(grad, error, q) -> None:
    """One step of PowerSGD on one gradient matrix, ``error`` and ``q`` updated in place."""
    from ddp_opt.compression.factors import power_iteration

    power_iteration(grad, error, q)


def measure_powersgd_compute(shapes: Sequence[tuple[int, int, int]], device, repeats: int) -> float:
    """Median seconds (rank 0's clock; no collective) of one step's power iteration over matrices of
    ``shapes`` (``powersgd_shapes``): per matrix ``M = grad + E``, ``P = M orth(Q)``, ``orth(P)``,
    ``Q = M^T P``, ``approx = P Q^T``, ``E = M - approx`` (Note [Physical limit of a step]), the
    products with the factors in their fastest form (``project``, ``project_back``)."""
    import torch

    from .device import clock

    generator = torch.Generator().manual_seed(0)
    mats = [(torch.randn(n, m, generator=generator).to(device), torch.zeros(n, m, device=device),
             torch.randn(m, r, generator=generator).to(device)) for n, m, r in shapes]

    def once() -> None:
        for grad, error, q in mats:
            _power_iteration(grad, error, q)

    once()  # warm: allocator, QR workspaces
    times = []
    for _ in range(max(repeats, 1)):
        t0 = clock(device)
        once()
        times.append(clock(device) - t0)
    return median(times)


def measure_powersgd_in_backward(model, batch, compression: str, device, repeats: int) -> float:
    """Median seconds (rank 0's clock; no collective) the power iteration takes inside a
    backward that runs it on its own core, every rank at once.

    Each round runs ``model(*batch)``'s forward and backward with the iteration of
    ``measure_powersgd_compute`` run on each compressed gradient as soon as autograd has
    accumulated it (a post-accumulate-grad hook, so it interleaves with backward as a bucket
    hook does), and sums the seconds spent in those hooks. A barrier starts each round, so the
    ranks' backwards and iterations share the machine's caches as they do in a step. This is
    the ``compress`` of Note [Physical limit of a step]."""
    import torch
    import torch.distributed as dist

    from .device import clock

    generator = torch.Generator().manual_seed(0)
    params = list(model.parameters())
    chosen = {id(p): (n, m, r) for p, (n, m, r) in zip(params, _compressed_shapes(params, compression)) if n}
    state = {key: (torch.zeros(n, m, device=device), torch.randn(m, r, generator=generator).to(device))
             for key, (n, m, r) in chosen.items()}
    spent = [0.0]

    def iterate(p) -> None:
        t0 = clock(device)
        n, m, _ = chosen[id(p)]
        _power_iteration(p.grad.view(n, m), *state[id(p)])
        spent[0] += clock(device) - t0

    handles = [p.register_post_accumulate_grad_hook(iterate) for p in params if id(p) in chosen]
    times = []
    try:
        for i in range(max(repeats, 1) + 1):  # the first warms the allocator and the QR workspaces
            if dist.is_initialized():
                dist.barrier()
            spent[0] = 0.0
            model(*batch)[1].backward()
            model.zero_grad(set_to_none=True)
            times.append(spent[0])
    finally:
        for h in handles:
            h.remove()
    return median(times[1:])


CHUNKS = (1, 8)  # the limit's collectives: all bytes in one, or in this many back to back; the faster counts


def measure_fsdp_comm(nbytes: int, device, repeats: int, rs_dtypes: Sequence[str] = ("fp32",)
                      ) -> tuple[float, dict[str, float], dict[str, str]]:
    """Median seconds (the fastest way of those tried) to all-gather ``nbytes`` of float32 (the whole,
    gathered size) on the default group, and to reduce-scatter the same elements in each of
    ``rs_dtypes`` (``WIRE_BYTES`` names), by dtype; and how the fastest reduce-scatter was made, by
    dtype. Tried (Note [Physical limit of a step]): one collective of all the bytes or ``CHUNKS`` of them
    issued back to back, and for the reduce-scatter ``reduce_scatter_tensor`` or an
    ``all_to_all_single`` whose received rows each rank sums."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()

    def chunked(make, chunks: int, dtype) -> float:
        """``chunks`` collectives of ``nbytes / chunks`` each, issued together, all awaited."""
        shard = max(nbytes // 4 // world // chunks, 1)
        bufs = [make(torch.zeros(shard * world, dtype=dtype, device=device), shard) for _ in range(chunks)]

        def run() -> None:
            for work in [start() for start, _ in bufs]:
                work.wait()
            for _, finish in bufs:
                finish()

        return _timed(run, torch.device(device), repeats)

    def all_gather(full, shard):
        part = full[:shard].clone()
        return (lambda: dist.all_gather_into_tensor(full, part, async_op=True)), (lambda: None)

    def reduce_scatter(full, shard):
        out = full[:shard].clone()
        return (lambda: dist.reduce_scatter_tensor(out, full, async_op=True)), (lambda: None)

    def all_to_all(full, shard):
        received = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(received, full, async_op=True)), \
            (lambda: received.view(world, -1).sum(0))

    ag = min(chunked(all_gather, k, torch.float32) for k in CHUNKS)
    rs, via = {}, {}
    for dtype in rs_dtypes:
        timed = {}
        for name, make in (("reduce_scatter_tensor", reduce_scatter), ("all_to_all_single + sum", all_to_all)):
            for k in CHUNKS:
                timed[name if k == 1 else f"{name}, {k} back to back"] = chunked(make, k, _torch_dtype(dtype))
        via[dtype] = min(timed, key=timed.__getitem__)
        rs[dtype] = timed[via[dtype]]
    return ag, rs, via


def against_peers(rows: Sequence[dict], default_cap: float = 25.0) -> list[dict]:
    """Each of our ``auto`` rows against every peer mode that sends the same dtype, at its default
    cap and at its best cap (median of per-round ratios with IQR; below 1 is faster), with its
    ``step_over_limit``."""
    ours = [r for r in rows if r["mode"] not in PEER_MODES and r.get("bucket_cap_mb") == "auto"
            and r.get("step_ms_rounds")]
    out = []
    for mine in ours:
        for peer in PEER_MODES:  # those sending the same dtype
            runs = [r for r in rows if r["mode"] == peer and r.get("step_ms_rounds")
                    and wire_kind(r) == wire_kind(mine)]
            if not runs:
                continue
            default = next((r for r in runs if r.get("bucket_cap_mb") == default_cap), None)
            best = min(runs, key=lambda r: r["step_ms_median"])
            for which, other in (("default", default), ("best", best)):
                if other is not None:
                    mid, lo, hi = ratio_summary(mine["step_ms_rounds"], other["step_ms_rounds"])
                    out.append({"ours": mine["runner"], "peer": other["runner"], "which": which, "ratio": mid,
                                "ratio_q1": lo, "ratio_q3": hi, "step_over_limit": mine.get("step_over_limit")})
    return out
