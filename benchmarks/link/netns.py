"""Two nodes on one machine: Linux network namespaces joined by a rate-shaped veth pair.

    with shaped_network("800mbit") as net:
        procs = [net.popen(i, ["torchrun", "--nnodes", "2", "--node-rank", str(i), ...]) for i in (0, 1)]

Note [A shaped link between namespaces]

Background
    A comm hook that delays DDP's bucket futures (``benchmarks.link.shaping``) only works for
    modes that go through DDP's reducer; all-reduces that compiled autograd traces
    into the backward graph never reach it. A real link between real processes
    charges every mode the same way, whoever issues the collectives.

Algorithm
    - Two namespaces ``<prefix><pid>n0`` and ``<prefix><pid>n1``, each with ``lo`` up
      and one end of a veth pair (``veth0`` in node 0, ``veth1`` in node 1), addressed
      ``10.213.0.1/30`` and ``10.213.0.2/30``. Both ends live inside the namespaces,
      so the addresses never meet the host's routes or any other machine.
    - Each end's egress is shaped with ``tc qdisc ... root tbf rate RATE``: the
      kernel here has no ``netem``, so the link has a rate but no added delay. The
      token bucket holds ~10 ms of traffic (at least 64 KiB): a burst of that size
      passes at once, everything after it at the rate.
    - Processes run in a node with ``ip netns exec``; :meth:`ShapedNetwork.env`
      gives the variables that bind gloo to the veth (``GLOO_SOCKET_IFNAME``), and
      NCCL (its sockets, and a host id per node so that it never joins the nodes'
      GPUs past the link). Both nodes see the machine's GPUs: ``place_rank`` counts
      the ranks of both (Note [Benchmark device] in ``benchmarks.harness.device``).
      ``/etc/netns/<namespace>/hosts`` (which ``ip netns exec`` mounts over
      ``/etc/hosts``) names the two addresses ``node0`` and ``node1``, and the
      machine's hostname, which the namespaces share, as the node's own address:
      c10d's rendezvous resolves it to decide which node hosts its store. The
      workers of the other node would resolve it to their own address, so torchrun
      gets ``--local-addr`` with the node's address (:meth:`ShapedNetwork.torchrun`).
    - Teardown deletes both namespaces, which removes the veth pair and its qdiscs
      with them, and their ``/etc/netns`` folders. It runs when the ``with`` block ends, also on an exception,
      Ctrl-C or SIGTERM (turned into ``SystemExit`` while the block runs); a
      namespace of this prefix left by a process that was SIGKILLed is removed the
      next time a network is made (its pid is in its name, and that pid is gone).

Notes
    Needs root (or CAP_NET_ADMIN) and the ``ip`` and ``tc`` tools;
    :func:`unavailable_reason` says what is missing, and the benchmarks fall back
    to the comm-hook link (``--link``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from typing import Iterator, Sequence

__all__ = ["Node", "ShapedNetwork", "parse_rate", "rate_bits_per_s", "unavailable_reason", "shaped_network",
           "namespaces", "PREFIX"]

PREFIX = "dcnet"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_ETC_NETNS = "/etc/netns"


@dataclass(frozen=True)
class Node:
    """One node: a namespace, its end of the veth pair and its address there."""

    namespace: str
    ifname: str
    addr: str


@dataclass(frozen=True)
class ShapedNetwork:
    """Two nodes joined by a veth pair shaped to ``rate`` in each direction."""

    rate: str
    nodes: tuple[Node, Node]

    def command(self, node: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run inside node ``node``."""
        return ["ip", "netns", "exec", self.nodes[node].namespace, *cmd]

    def env(self, node: int) -> dict[str, str]:
        """Variables that make gloo (and torchrun's c10d store) use the veth, and NCCL too:
        its sockets on the veth, and a host id of the node's own, so that NCCL takes the two
        nodes for two hosts instead of joining their GPUs over this machine's P2P or shared
        memory, past the link (not yet run: the one GPU machine seen had one GPU, gloo)."""
        ifname = self.nodes[node].ifname
        return {"GLOO_SOCKET_IFNAME": ifname, "TP_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname,
                "NCCL_HOSTID": self.nodes[node].namespace, "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
                "NCCL_IB_DISABLE": "1"}

    def torchrun(self, node: int, port: int, nproc: int, job: Sequence[str], python: str = "python") -> list[str]:
        """``torchrun`` for node ``node`` of a 2-node job with c10d rendezvous on node 0's
        address; ``job`` is what follows (``-m launch.train ...``)."""
        return [python, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-id", f"netns{os.getpid()}",
                "--rdzv-endpoint", f"{self.nodes[0].addr}:{port}", "--local-addr", self.nodes[node].addr, *job]

    def popen(self, node: int, cmd: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``cmd`` in node ``node`` with :meth:`env` added to ``env`` (default: ours)."""
        return subprocess.Popen(self.command(node, cmd), env={**(env or os.environ), **self.env(node)}, **kwargs)


def parse_rate(text: str) -> str:
    """``800mbit`` (tc's spelling) checked and returned; ``shaped:`` in front is accepted."""
    rate = text.removeprefix("shaped:").strip().lower()
    if not _RATE.match(rate):
        raise ValueError(f"{text!r} is not a link rate: give a number and one of {', '.join(_UNITS)} "
                         "(tc's units, bits per second), e.g. shaped:800mbit (100 MB/s) or shaped:200mbit.")
    return rate


def rate_bits_per_s(rate: str) -> float:
    """``800mbit`` -> 8e8."""
    number, unit = _RATE.match(parse_rate(rate)).groups()
    return float(number) * _UNITS[unit]


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the {' and '.join(missing)} tool(s) are not installed (iproute2)"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN), and this process is not root"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def namespaces(prefix: str = PREFIX) -> list[str]:
    """The namespaces on this machine whose names start with ``prefix``."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _sh(*args: str, namespace: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", namespace] if namespace else []) + list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"'{' '.join(cmd)}' failed (exit {proc.returncode}): {proc.stderr.strip()}")


def _remove_stale(prefix: str) -> None:
    """Delete namespaces of ``prefix`` whose creating process is gone (SIGKILLed holders)."""
    for name in namespaces(prefix):
        m = re.match(rf"^{re.escape(prefix)}(\d+)n\d$", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _teardown([name])


def _burst_bytes(rate: str) -> int:
    return max(64 * 1024, int(rate_bits_per_s(rate) / 8 * 0.010))


def _teardown(names: Sequence[str]) -> None:
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(os.path.join(_ETC_NETNS, name), ignore_errors=True)


def _write_hosts(nodes: Sequence[Node]) -> None:
    """Inside node i, ``node0``/``node1`` name the two addresses and the machine's hostname
    names node i's own (torchrun's c10d rendezvous resolves it to decide who hosts the store)."""
    names = "".join(f"{n.addr} node{i}\n" for i, n in enumerate(nodes))
    for node in nodes:
        folder = os.path.join(_ETC_NETNS, node.namespace)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hosts"), "w") as f:
            f.write(f"127.0.0.1 localhost\n{names}{node.addr} {socket.gethostname()}\n")


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) inside the block, so ``finally`` clauses run."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def shaped_network(rate: str, prefix: str = PREFIX) -> Iterator[ShapedNetwork]:
    """Two namespaces joined by a veth pair shaped to ``rate``; removed on exit.

    Raises:
        RuntimeError: namespaces cannot be made here (the reason), or a setup command failed.
    """
    rate = parse_rate(rate)
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot make a shaped network: {reason}")
    _remove_stale(prefix)
    base = f"{prefix}{os.getpid()}"
    nodes = (Node(f"{base}n0", "veth0", "10.213.0.1"), Node(f"{base}n1", "veth1", "10.213.0.2"))
    made: list[str] = []
    with _sigterm_exits():
        try:
            for node in nodes:
                made.append(node.namespace)  # first: a half-made namespace is removed too
                _sh("ip", "netns", "add", node.namespace)
                _sh("ip", "link", "set", "lo", "up", namespace=node.namespace)
            _sh("ip", "link", "add", "veth0", "netns", nodes[0].namespace, "type", "veth", "peer", "name", "veth1",
                "netns", nodes[1].namespace)
            _write_hosts(nodes)
            burst = _burst_bytes(rate)
            for node in nodes:
                ns = node.namespace
                _sh("ip", "addr", "add", f"{node.addr}/30", "dev", node.ifname, namespace=ns)
                _sh("ip", "link", "set", node.ifname, "up", namespace=ns)
                _sh("tc", "qdisc", "add", "dev", node.ifname, "root", "tbf", "rate", rate, "burst", str(burst),
                    "latency", "100ms", namespace=ns)
            yield ShapedNetwork(rate, nodes)
        finally:
            _teardown(made)
