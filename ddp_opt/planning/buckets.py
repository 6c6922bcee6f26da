"""Bucket planning: which node of a captured forward graph belongs to which
gradient bucket. A pure function of the graph and the caps; nothing runs.

Note [Bucket planning]

Background
    After its first iteration DDP rebuilds its buckets from the order in which
    gradients became ready, filling the first up to ``first_bucket_bytes_cap`` and
    each later one up to ``bucket_bytes_cap`` (or bucket k up to
    ``bucket_cap_mb_list[k]``); a bucket closes as soon as it reaches its cap.

Algorithm
    - Walk the forward graph in reverse (backward's order). A gradient is ready when
      the backward of its parameter's *first* forward use is done, so tied weights
      count once. Each parameter adds ``numel * element_size`` to the open bucket;
      ``_ddp_ignored`` parameters, frozen parameters and buffers never count.
    - A full bucket closes before the next node, but only once it has an output used
      outside it: a partition without outputs cannot be split.
    - Cut inside ``autocast`` and grad-mode regions as anywhere: ``split_module``
      re-enters each region in every partition it cuts through. That needs partition
      indices that never decrease along the nodes, and treats a region's enter -> exit
      link as no data edge (``_has_external_output``).
    - Never cut inside ``inference_mode``: ``split_module`` does not re-enter it. A
      parameter-free preamble joins the bucket that follows it.

Notes
    - Parameters are found on placeholders (``meta["grapharg"]``), ``get_attr``
      nodes and ``call_module`` targets.
    - As DDP does, each dtype and device ("kind") fills its own buckets against its
      own run of caps; the graph is cut where any kind's bucket is full, so a kind
      with few bytes keeps one bucket open across partitions (:func:`kind_groups`).
    - Other mode switches (forward AD, saved-tensor hooks, ``sdpa_kernel``) are not
      tracked, as in PyTorch's splitter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import fx

from .._torch_internals import (AUTOCAST_EXIT, INFERENCE_MODE_ENTER, INFERENCE_MODE_EXIT, INFERENCE_REGIONS,
                               is_ddp_ignored, placeholder_parameter, warn_if_missing_at_import)

log = logging.getLogger(__name__)

__all__ = ["Bucket", "BucketCaps", "format_buckets", "group_by_caps", "kind_groups", "main_kind", "param_kind",
           "partition_map", "plan_buckets", "plan_details", "realign_caps", "split_caps"]

MiB = 1024 * 1024


@dataclass
class Bucket:
    """One gradient bucket = one graph partition.

    Attributes:
        size: bytes of the parameters counted in this bucket.
        params: names of those parameters.
        param_ids: ``id()`` of each of those parameters (the real tensors).
        nodes: the FX nodes of the partition, in reverse graph order.
        cap: the byte cap this bucket was filled against.
        param_bytes: bytes of each parameter, as DDP counts them.
        param_kinds: ``"dtype@device"`` of each parameter: DDP buckets each kind apart.
    """

    size: int = 0
    params: list[str] = field(default_factory=list)
    nodes: list[fx.Node] = field(default_factory=list)
    param_ids: list[int] = field(default_factory=list)
    cap: int = 0
    param_bytes: list[int] = field(default_factory=list)
    param_kinds: list[str] = field(default_factory=list)
    opcount_increased_to_capture_external_output: int = 0
    paramsize_before_opcount_increase: int = 0


@dataclass(frozen=True)
class BucketCaps:
    """Byte caps in gradient-ready order, as DDP's rebuilt buckets use them.

    Attributes:
        bucket_bytes_cap: cap of every bucket after the first.
        first_bucket_cap: cap of the first bucket (the last layers' gradients);
            ``None`` means the same as ``bucket_bytes_cap``.
        per_bucket_caps: when not empty, bucket k's cap is
            ``per_bucket_caps[min(k, len - 1)]`` and the two fields above are unused.
    """

    bucket_bytes_cap: int
    first_bucket_cap: int | None = None
    per_bucket_caps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        named = [("bucket_bytes_cap", self.bucket_bytes_cap)]
        if self.first_bucket_cap is not None:
            named.append(("first_bucket_cap", self.first_bucket_cap))
        named += [(f"per_bucket_caps[{i}]", c) for i, c in enumerate(self.per_bucket_caps)]
        for name, value in named:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"{name}={value!r}: bucket caps are byte counts and must be positive integers. "
                    "Use e.g. 25 * 1024 * 1024 for DDP's default 25 MiB."
                )
        if not self.per_bucket_caps and self.first_bucket_cap is not None and self.first_bucket_cap > self.bucket_bytes_cap:
            raise ValueError(
                f"first_bucket_cap={self.first_bucket_cap} is larger than bucket_bytes_cap="
                f"{self.bucket_bytes_cap}: the first bucket exists to start communication early, so it "
                "must not be larger than the others. Lower first_bucket_cap or leave it unset."
            )

    def cap_for(self, k: int) -> int:
        """Cap of the k-th bucket in gradient-ready order (0 = first ready)."""
        if self.per_bucket_caps:
            return self.per_bucket_caps[min(k, len(self.per_bucket_caps) - 1)]
        if k == 0 and self.first_bucket_cap is not None:
            return self.first_bucket_cap
        return self.bucket_bytes_cap


def group_by_caps(sizes: Sequence[int], caps: BucketCaps) -> list[int]:
    """Bucket lengths for gradients of ``sizes`` bytes (gradient-ready order): bucket k
    closes once its bytes reach ``caps.cap_for(k)``; the last one takes what is left."""
    lengths: list[int] = []
    count = total = 0
    for size in sizes:
        count += 1
        total += size
        if total >= caps.cap_for(len(lengths)):
            lengths.append(count)
            count = total = 0
    if count:
        lengths.append(count)
    return lengths


def split_caps(caps: Sequence[int], most: int) -> tuple[int, ...]:
    """``caps`` with each cap above ``most`` bytes replaced by as few equal caps of at most ``most`` as add up to
    at least it: bucket k's gradients cut into smaller buckets at the same order."""
    split: list[int] = []
    for cap in caps:
        pieces = -(-cap // most)
        split += [-(-cap // pieces)] * pieces
    return tuple(split)


def plan_buckets(gm: fx.GraphModule, caps: BucketCaps) -> list[Bucket]:
    """Assign every node of ``gm`` (but placeholders and output) to a bucket.

    Args:
        gm: a forward graph, as dynamo captured it (or built by hand).
        caps: the byte caps, in gradient-ready order.

    Returns:
        Buckets in forward-graph order: ``buckets[-1]`` holds the last layers and
        fills first during backward. Never empty.
    """
    owner = _first_use_of_params(gm)
    cuttable = _cuttable_after(gm)
    ready = [Bucket(cap=caps.cap_for(0))]  # ready[0] = first bucket in backward order
    # DDP's open bucket per dtype/device kind: its bytes so far and how many of that kind's buckets closed.
    open_bytes: dict[str, int] = {}
    closed: dict[str, int] = {}
    for node in reversed(gm.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        cur = ready[-1]
        full = [k for k, n in open_bytes.items() if n >= caps.cap_for(closed.get(k, 0))]
        if full:
            if node in cuttable and _has_external_output(cur):
                for k in full:
                    open_bytes[k], closed[k] = 0, closed.get(k, 0) + 1
                cur = Bucket(cap=caps.cap_for(closed[full[0]]))
                ready.append(cur)
            else:
                if cur.opcount_increased_to_capture_external_output == 0:
                    cur.paramsize_before_opcount_increase = cur.size
                cur.opcount_increased_to_capture_external_output += 1
        for name, param in owner.get(node, ()):
            nbytes, kind = param.numel() * param.element_size(), param_kind(param)
            cur.size += nbytes
            cur.params.append(name)
            cur.param_ids.append(id(param))
            cur.param_bytes.append(nbytes)
            cur.param_kinds.append(kind)
            open_bytes[kind] = open_bytes.get(kind, 0) + nbytes
        cur.nodes.append(node)

    buckets = list(reversed(ready))
    if len(buckets) > 1 and buckets[0].size == 0:
        assert not buckets[0].params, "a zero-size bucket cannot hold counted parameters"
        buckets[1].nodes.extend(buckets[0].nodes)
        del buckets[0]
    return buckets


def param_kind(param: torch.Tensor) -> str:
    """The key DDP buckets a parameter by: its dtype and device."""
    return f"{str(param.dtype).removeprefix('torch.')}@{param.device}"


def main_kind(kind_bytes) -> str:
    """The kind with the most bytes among ``(kind, bytes)`` pairs (ties: the first by name)."""
    totals: dict[str, int] = {}
    for kind, n in kind_bytes:
        totals[kind] = totals.get(kind, 0) + n
    return max(sorted(totals), key=totals.__getitem__)


def kind_groups(buckets: list[Bucket]) -> list[set[int]]:
    """Parameter-id sets of each partition's parameters of one kind: the partitions
    themselves when every parameter has one dtype and device."""
    groups = []
    for b in buckets:
        by_kind: dict[str, set[int]] = {}
        for i, kind in zip(b.param_ids, b.param_kinds or [""] * len(b.param_ids)):
            by_kind.setdefault(kind, set()).add(i)
        groups.extend(by_kind.values())
    return groups


def realign_caps(buckets: list[Bucket]) -> tuple[int, ...]:
    """Per-bucket rebuild caps (gradient-ready order) that close DDP's buckets at the
    partitions' ends: each partition's size; with several dtype/device kinds, each
    partition's bytes of the kind with the most bytes (DDP walks one list of caps
    per kind, so the other kinds' buckets close where those caps say)."""
    if len({k for b in buckets for k in b.param_kinds}) <= 1:
        return tuple(b.size for b in reversed(buckets) if b.size > 0)
    main = main_kind((k, n) for b in buckets for n, k in zip(b.param_bytes, b.param_kinds))
    sizes = (sum(n for n, k in zip(b.param_bytes, b.param_kinds) if k == main) for b in reversed(buckets))
    return tuple(s for s in sizes if s > 0)


def partition_map(buckets: list[Bucket]) -> dict[fx.Node, int]:
    """Node -> partition index (forward order), the policy for ``compiler.split_graph``."""
    return {node: i for i, b in enumerate(buckets) for node in b.nodes}


def plan_details(buckets: list[Bucket]) -> list[dict]:
    """Buckets as plain data (bytes, cap, node and parameter names), for logs and traces."""
    return [
        {"bytes": b.size, "cap": b.cap, "params": list(b.params), "nodes": [n.name for n in reversed(b.nodes)]}
        for b in buckets
    ]


def format_buckets(buckets: list[Bucket]) -> str:
    """A table of buckets in forward order: index, bytes, cap, parameter names."""
    from tabulate import tabulate

    rows = []
    for i, b in enumerate(buckets):
        names = b.params or ["(no parameters)"]
        rows.append((i, b.size, b.cap, len(b.nodes), names[0]))
        rows.extend(("", "", "", "", n) for n in names[1:])
    return tabulate(rows, headers=("bucket", "bytes", "cap", "nodes", "parameters"), tablefmt="simple")


# --- finding parameters in a graph -------------------------------------------------


def _is_counted(value: object) -> bool:
    return (
        isinstance(value, torch.nn.Parameter)
        and value.requires_grad
        and not is_ddp_ignored(value)
    )


def _params_read_by(gm: fx.GraphModule, node: fx.Node, seen_modules: set) -> list[tuple[str, torch.nn.Parameter]]:
    found = []
    for inp in node.all_input_nodes:
        if inp.op == "placeholder":
            hit = placeholder_parameter(inp)
            if hit is not None:
                found.append(hit)
        elif inp.op == "get_attr":
            found.extend(_attr_param(gm, inp))
    if node.op == "get_attr":
        found.extend(_attr_param(gm, node))
    elif node.op == "call_module" and node.target not in seen_modules:
        seen_modules.add(node.target)
        found.extend((f"{node.target}.{n}", p) for n, p in gm.get_submodule(node.target).named_parameters())
    return found


def _attr_param(gm: fx.GraphModule, node: fx.Node) -> list[tuple[str, torch.nn.Parameter]]:
    value = getattr(gm, str(node.target), None)
    return [(str(node.target), value)] if isinstance(value, torch.nn.Parameter) else []


def _first_use_of_params(gm: fx.GraphModule) -> dict[fx.Node, list[tuple[str, torch.nn.Parameter]]]:
    """Each counted parameter, keyed by the node of its first forward use."""
    owner: dict[fx.Node, list] = {}
    seen_params: set[int] = set()
    seen_modules: set = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        for name, param in _params_read_by(gm, node, seen_modules):
            if id(param) in seen_params or not _is_counted(param):
                continue
            seen_params.add(id(param))
            owner.setdefault(node, []).append((name, param))
    return owner


def _cuttable_after(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes after which the graph may be cut: anywhere but inside an
    ``inference_mode`` region, which ``split_module`` does not re-enter (autocast
    and grad-mode regions it does; see Note [Bucket planning])."""
    warn_if_missing_at_import(INFERENCE_REGIONS, "bucket planning may cut a captured graph inside an inference_mode "
                              "region, which split_module does not re-enter")
    depth, ok = 0, set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is INFERENCE_MODE_ENTER:
            depth += 1
        elif node.op == "call_function" and node.target is INFERENCE_MODE_EXIT:
            depth -= 1
        if depth == 0:
            ok.add(node)
    return ok


def _has_external_output(bucket: Bucket) -> bool:
    # An autocast region's enter -> exit link is not an output: split_module
    # re-enters the region in the later partition instead of passing it along.
    inside = set(bucket.nodes)
    return any(user not in inside and user.target is not AUTOCAST_EXIT for node in bucket.nodes for user in node.users)
