"""One compile for all ranks, and no collective timeout from compile skew.

Note [Shared compile]

Background
    Every rank of a data-parallel job compiles the same graphs: on one machine N
    concurrent compiles on the same cores; across machines, a rank served from a cache
    reaches the first collective long before one that compiles, and the collective
    times out although nothing is wrong.

Algorithm
    - :meth:`wrap_compile` wraps each graph's backend. A compile is keyed in the store
      by its graph-and-inputs digest, how often this rank met that digest, and the
      share secret's scope (Note [Share secret]). The first rank to reach a key claims
      it (atomic ``add``), compiles, and publishes ``save_cache_artifacts()`` (and on
      CPU its C++ kernels) with a sha256 and a MAC (``compiler.ranks.publication``). Other
      ranks get a :class:`Pending` and go on to their next compile; at the end of the
      graph (``resolve_pending``) they wait, verify (MAC, then Note [Checked artifact
      keys]), load, and call the backend, now served from AOTAutograd's cache. Backward
      is compiled with its forward, so no rank compiles amid backward's all-reduces.
    - :meth:`wrap_graph` wraps the whole captured graph; afterwards the rank waits
      until every peer compiling the same graph is done (Note [Compile barrier]), so
      the first collective after a compile starts on all ranks together.
    Every rank still calls the backend for every graph, so the plans and graphs are the
    ones an unshared run would have.

Why it cannot deadlock
    A rank waits for a publication only after another claimed it, and a claimer
    compiles and publishes (or publishes "failed") before anything else.

Notes
    - A rank compiles for itself, with one warning, when the publication is late
      (``timeout_s``), damaged, fails its MAC or key check, or fails to load. A dead
      or stopped peer ends every wait with ``PeerLost`` (Note [Peer liveness]).
    - The store, open to the network, is never trusted with code: a rank loads only
      what this job made (the MAC), only into Inductor's cache directory (docs/trust.md).
    - On one machine with one Inductor directory, ranks already share C++ kernel builds
      through its file locks; sharing saves the Python side (tracing, lowering).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx

from .. import _torch_internals as _ti
from .cputime import cpu_seconds
from ..cache.artifacts import inductor_cache_dir
from .barrier import POLL_S, GraphBarrier, key_label
from ..cache.kernels import collect_kernels, install_kernels, kernel_snapshot
from .liveness import Heartbeat, on_default_store
from .pending import Pending
from .publication import publish, receive
from .share_secret import ENV_FILE, ENV_VALUE, ShareSecret, announce_scope, job_secret, note_other_scopes

log = logging.getLogger(__name__)

__all__ = ["CompileShare", "Pending", "ShareStats", "backward_with_forward", "graph_digest", "share_for_group"]

_instances: dict[str, Iterator[int]] = {}


def graph_digest(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """sha256 of a graph's code, of the grad mode it is compiled under (an evaluation under
    ``no_grad`` can trace the same code as training, but compiles to another graph) and of its
    inputs' shapes, strides and dtypes."""
    h = hashlib.sha256(gm.code.encode())
    h.update(f"grad={torch.is_grad_enabled()}\n".encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            h.update(f"{tuple(x.shape)} {tuple(x.stride())} {x.dtype} {x.device.type} {x.requires_grad}\n".encode())
        else:
            h.update(f"{type(x).__name__} {x}\n".encode())
    return h.hexdigest()[:32]


@dataclass
class ShareStats:
    """What one rank's compiles did: counts, and seconds spent compiling and waiting."""

    compiled: int = 0  # compiled here, from scratch
    rejected: int = 0  # publications refused unloaded: not signed by a rank of this job, or unsafe keys
    loaded: int = 0  # served from another rank's artifacts
    fell_back: int = 0  # another rank's compile that this rank had to compile itself
    kernels_installed: int = 0  # C++ kernel files received from other ranks that this rank's Inductor dir lacked
    compile_s: float = 0.0  # wall seconds inside the backend
    compile_cpu_s: float = 0.0  # CPU seconds inside the backend (this process and its finished children)
    wait_s: float = 0.0  # waiting for other ranks' artifacts or for peers to finish a graph
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


class CompileShare:
    """Shared compile and compile barrier for one group of ranks (Note [Shared compile]).

    Args:
        store: a key-value store every rank of the group reaches (the default group's).
        rank: this process's global rank; ``ranks``: the group's global ranks.
        share: False keeps the barrier but every rank compiles for itself.
        timeout_s: longest wait for another rank's compile, or for a peer to finish a graph.
        grace_s: how long after this rank started a graph an idle peer (one that
            neither compiles nor waits at a barrier) may still start it.
        name: names the entry point in store keys (``ddp``, ``fsdp``); ``prefix``
            replaces the keys' prefix (default: name, group and creation index,
            equal across ranks in SPMD code).
        secret: signs and checks publications (Note [Share secret]); None: the job's,
            from the environment or made by this node's ranks.

    Raises:
        ShareSecretError: ``DISTCOMPILE_SHARE_SECRET_FILE`` names a file that cannot be used.
    """

    def __init__(self, store: Any, rank: int, ranks: Sequence[int], *, share: bool = True,
                 timeout_s: float = 7200.0, grace_s: float = 10.0, progress_s: float = 30.0,
                 name: str = "compile", prefix: str | None = None, secret: ShareSecret | None = None) -> None:
        self.store, self.rank, self.ranks = store, rank, list(ranks)
        self.share, self.timeout_s, self.progress_s = share, timeout_s, progress_s
        tag = "-".join(map(str, self.ranks)) if len(self.ranks) <= 8 else f"{ranks[0]}-{ranks[-1]}x{len(ranks)}"
        instance = next(_instances.setdefault(f"{name}/{tag}", itertools.count()))
        self.prefix = prefix or f"distcompile/share/{name}/{tag}/{instance}"
        self.stats = ShareStats()
        self.secret = (secret or job_secret(store)) if share else None
        if share and self.secret is None:  # job_secret said why
            self.share = False
            self._warn("no share secret (see the line above): this rank compiles every graph itself, sharing none")
        self._scopes_seen = not self.share or self.secret.cluster  # set once every peer's scope was compared
        if self.share:
            announce_scope(store, self.prefix, rank, self.secret)
        self._seen: dict[str, int] = {}  # how often this rank has met each key (graph digest) so far
        self._published: list[str] = []
        self._pending: list[Pending] = []
        # Waits end when the peer waited for dies or stops, or on SIGTERM (Note [Peer liveness]).
        Heartbeat.start(store, rank, self)
        self.barrier = GraphBarrier(store, rank, self.ranks, self.prefix, timeout_s=timeout_s, grace_s=grace_s,
                                    progress_s=progress_s, stats=self.stats, warn=self._warn)
        self.watch = self.barrier.watch

    def _key(self, kind: str, digest: str) -> str:
        """The store key of this rank's next occurrence of a graph: ranks that compile the same
        graphs get the same keys, in whatever order and however many other graphs they compile."""
        if kind == "c" and self.secret is not None:  # only ranks of one secret meet at a compile (Note [Share secret])
            kind = f"c/{self.secret.scope}"
        n = self._seen.get(f"{kind}/{digest}", 0)
        self._seen[f"{kind}/{digest}"] = n + 1
        return f"{self.prefix}/{kind}/{digest}/{n}"

    # -- one compile: the first rank to reach it compiles and publishes, the others load ------

    def wrap_compile(self, backend: Callable) -> Callable:
        """``backend`` with each compile done by one rank and loaded by the others (see the Note)."""

        def shared_compile(gm: fx.GraphModule, example_inputs: list) -> Callable:
            if not self.share:
                return self._compile(backend, gm, example_inputs)
            if not self._scopes_seen:
                self._scopes_seen = note_other_scopes(self.store, self.prefix, self.rank, self.ranks, self.secret)
            key = self._key("c", graph_digest(gm, example_inputs))
            if self.store.add(f"{key}/claim", 1) == 1:  # atomic: exactly one rank claims each compile
                self.store.set(f"{key}/owner", str(self.rank))
                root = inductor_cache_dir()
                files_before, keys_before = kernel_snapshot(root), _ti.cpp_kernel_keys()
                try:
                    out = self._compile(backend, gm, example_inputs)
                except BaseException:
                    self._publish(key, failed=True)  # the others must not wait for it
                    raise
                # the C++ kernels this compile built or loaded: a rank with another Inductor directory lacks them
                self._publish(key, collect_kernels(root, _ti.cpp_kernel_keys() - keys_before, files_before))
                return out
            pending = Pending(self, backend, gm, example_inputs, key)
            self._pending.append(pending)
            return pending

        return shared_compile

    def _load_or_compile(self, p: Pending) -> Callable:
        """A compile another rank claimed: its artifacts loaded, then the backend (a cache hit)."""
        payload = self._receive(p)
        if payload:
            artifacts, kernels = payload
            try:
                if kernels:  # kernels this rank's Inductor directory already has are left alone
                    self.stats.kernels_installed += len(install_kernels(kernels, inductor_cache_dir()))
                torch.compiler.load_cache_artifacts(artifacts)
            except Exception as e:  # noqa: BLE001 - a bad publication must never fail the job
                self._warn(f"could not load {self._owner(p)}'s compile artifacts for {p.label} "
                           f"({type(e).__name__}: {e}); compiling it on this rank instead")
                self.stats.fell_back += 1
            else:
                self.stats.loaded += 1
                return self._compile(p.backend, p.gm, p.example_inputs, count=False)
        return self._compile(p.backend, p.gm, p.example_inputs)

    def resolve_pending(self) -> None:
        """Load (or compile) every compile claimed by another rank, in order."""
        while self._pending:
            self._pending.pop(0).resolve()

    def _compile(self, backend: Callable, gm: fx.GraphModule, example_inputs: list, count: bool = True) -> Callable:
        t0, c0 = time.perf_counter(), cpu_seconds()
        try:
            with _ti.compile_backward_with_forward():
                return backend(gm, example_inputs)
        finally:
            self.stats.compile_s += time.perf_counter() - t0
            self.stats.compile_cpu_s += cpu_seconds() - c0
            self.stats.compiled += int(count)

    def _publish(self, key: str, kernels: bytes = b"", failed: bool = False) -> None:
        artifacts = None if failed else torch.compiler.save_cache_artifacts()
        artifacts = artifacts[0] if artifacts is not None and artifacts[0] else b""
        written, error = publish(self.store, key, artifacts, kernels, self.secret, failed)
        self._published += written
        if error is not None:
            self._warn(f"could not publish compile {key_label(key)} ({len(artifacts) + len(kernels)} bytes) in the "
                       f"store ({type(error).__name__}: {error}); the other ranks compile it themselves")
        log.debug("shared compile: published %s (%d part(s)%s)", key, len(written) - 1, ", failed" * bool(failed or error))

    def _owner(self, p: Pending) -> str:
        owner = self.store.get(k).decode(errors="replace") if self.store.check([k := f"{p.key}/owner"]) else "?"
        return f"rank {owner if owner.isdigit() else '?'}"  # what the store says: any client may have written it

    def _receive(self, p: Pending) -> tuple[bytes, bytes] | None:
        """The claiming rank's (artifacts, kernels) for a compile, or None when this rank must compile it."""
        what = f"another rank to compile {p.label}"
        if not self._wait([p.key], what, self.timeout_s, owner_key=f"{p.key}/owner"):
            self._warn(f"waited {self.timeout_s:.0f}s for {self._owner(p)} to compile {p.label} without an answer; "
                       "compiling it on this rank")
            self.stats.fell_back += 1
            return None
        got = receive(self.store, p.key, self.secret)
        if got.status in ("failed", "freed"):
            log.info("rank %d: %s's compile of %s %s; compiling it here too", self.rank, self._owner(p), p.label,
                     "failed" if got.status == "failed" else "was freed (every rank was past it)")
            return None
        owner, what = self._owner(p), f"compile artifacts for {p.label}"
        why = {"damaged": f"{owner}'s {what} are damaged (checksum mismatch); compiling it on this rank instead",
               "unsigned": f"the {what}, claimed by {owner}, are not signed by a rank of this job (their MAC does not "
                           f"verify: another client of the store wrote them, or the ranks hold different {ENV_FILE} "
                           f"or {ENV_VALUE} secrets); nothing loaded, compiling it on this rank",
               "refused": f"{owner}'s {what} are refused: they hold {got.problem}; nothing loaded, compiling it on "
                          "this rank"}
        if got.status != "ok":
            self._warn(why[got.status])
            self.stats.fell_back += 1
            self.stats.rejected += got.status in ("unsigned", "refused")
            return None
        return (got.artifacts, got.kernels) if got.artifacts else None

    def _free_published(self) -> None:
        """Every rank that compiles the graph is past it: free what this rank published (a rank
        that reaches one of these compiles later finds it freed and compiles it)."""
        for key in self._published:
            with contextlib.suppress(Exception):
                if key.rsplit("/", 1)[-1].startswith("part"):
                    self.store.delete_key(key)
                else:
                    self.store.set(key, json.dumps({"freed": True}))
        self._published.clear()

    def wrap(self, backend: Callable) -> Callable:
        """Both wrappers, for a backend that compiles each captured graph in one piece."""
        return self.wrap_graph(self.wrap_compile(backend))

    # -- one graph: nobody leaves before every rank that compiles it has compiled it ----------

    def wrap_graph(self, backend: Callable,
                   barrier_if: Callable[[Sequence[Any]], bool] | None = None) -> Callable:
        """``backend`` followed by a barrier over the group (see the Note).

        Args:
            barrier_if: given a graph's example inputs, whether a collective follows the graph
                that compile skew could time out (``compiler.produces_gradients`` for DDP, whose
                only collectives after a graph are its gradients' all-reduces). A graph it
                refuses (an evaluation under ``no_grad``, perhaps on one rank only) is compiled,
                and shared, without holding or waiting for any peer. None: every graph.
        """

        def compile_then_meet(gm: fx.GraphModule, example_inputs: list) -> Callable:
            if not self.barrier.on or (barrier_if is not None and not barrier_if(example_inputs)):
                out = backend(gm, example_inputs)
                self.resolve_pending()
                return out
            base = self._key("g", graph_digest(gm, example_inputs))
            started = self.barrier.enter(base)
            try:
                out = backend(gm, example_inputs)
                self.resolve_pending()
            except BaseException:  # a compile that raised (or a dynamo restart) must not leave peers waiting,
                with contextlib.suppress(RuntimeError):  # and a store gone with a failed peer must not hide why
                    self.barrier.done(base)
                raise
            self.barrier.done(base)
            self.barrier.meet(base, started)
            self._free_published()
            return out

        return compile_then_meet

    # -- waiting ------------------------------------------------------------------------------

    def _wait(self, keys: list[str], what: str, timeout_s: float, owner_key: str | None = None) -> bool:
        """Poll the store until every key is set (True) or ``timeout_s`` passes (False);
        progress is logged every ``progress_s``. The rank named at ``owner_key`` is watched:
        :class:`PeerLost` when it dies or stops, :class:`WaitInterrupted` on a stop request."""
        t0 = time.perf_counter()
        next_note = self.progress_s
        owner: list[int] = []
        try:
            while not self.store.check(keys):
                if not owner and owner_key is not None and self.store.check([owner_key]):
                    claimed = self.store.get(owner_key).decode()
                    owner = [int(claimed)] if claimed.isdigit() and int(claimed) in self.ranks else []
                self.watch.check(owner, what)
                waited = time.perf_counter() - t0
                if waited >= timeout_s:
                    return False
                if waited >= next_note:
                    log.info("rank %d: waiting for %s (%.0fs)", self.rank, what, waited)
                    next_note += self.progress_s
                time.sleep(POLL_S)
            return True
        finally:
            self.stats.wait_s += time.perf_counter() - t0

    def _warn(self, message: str) -> None:
        self.stats.warnings.append(message)
        log.warning("Shared compile, rank %d: %s.", self.rank, message)


def backward_with_forward(backend: Callable) -> Callable:
    """``backend`` compiling each graph's backward right after its forward, as a shared compile
    does (``CompileShare._compile``). AOTAutograd's cache key holds that setting, so with it a
    compile cache written by a shared compile serves a run without one (one rank, or
    ``share=False``) and the other way round (Note [Compile cache])."""
    def compile_fn(gm: fx.GraphModule, example_inputs: list) -> Callable:
        with _ti.compile_backward_with_forward():
            return backend(gm, example_inputs)

    return compile_fn


def share_for_group(ranks: Sequence[int] | None, **kw: Any) -> CompileShare | None:
    """A :class:`CompileShare` over ``ranks`` (None: the default group) on the default
    store, or None without an initialised process group of more than one rank."""
    found = on_default_store(ranks)
    return CompileShare(*found, **kw) if found is not None else None
