"""Starting benchmark processes: a benchmark module under torchrun when it was started
as a plain script (``relaunch``), and the checked child runs of the benchmarks that
time whole jobs (``torchrun_command``, ``run_checked``, and ``run_main_job``: one run of
the main job in a new process, its ``metrics.json`` read back)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

__all__ = ["inside_torchrun", "relaunch", "relaunch_on_nodes", "here_or_relaunched", "torchrun_command",
           "run_checked", "job_env", "run_main_job"]

RDZV_PORT = 29541  # node 0's c10d rendezvous port, inside its own namespace


def inside_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ


def torchrun_command(module: str, args: Sequence[str], nproc: int) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=N -m module args``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *args]


def _without_nproc(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def relaunch(module: str, argv: Sequence[str], nproc: int, command_env: str) -> int:
    """Start ``python -m module argv`` on ``nproc`` local ranks; return torchrun's exit code.

    The user's own command line is passed to the workers in ``command_env`` so that
    the results can record how to reproduce them. ``--nproc`` is the launcher's, not the
    workers': torchrun's parser takes it for an abbreviation of its own ``--nproc-per-node``
    and stops, so it is left out of the workers' arguments."""
    cmd = torchrun_command(module, _without_nproc(argv), nproc)
    print(f"launching: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    env = dict(os.environ, **{command_env: shlex.join(["python", "-m", module, *argv])})
    return subprocess.call(cmd, env=env)


def relaunch_on_nodes(module: str, argv: Sequence[str], nproc: int, command_env: str, rate: str) -> int:
    """Start ``python -m module argv`` as a 2-node torchrun job, ``nproc // 2`` ranks per node,
    each node in its own network namespace and the nodes joined by a link shaped to ``rate``
    (Note [A shaped link between namespaces] in ``benchmarks.link.netns``); return the first
    non-zero exit code of the two nodes' torchrun, or 0. Both nodes are killed, and the
    namespaces removed, when this returns, raises or is interrupted."""
    from .device import machine_env
    from ..link.netns import shaped_network

    job = ["-m", module, *_without_nproc(argv)]
    env = dict(os.environ, **{command_env: shlex.join(["python", "-m", module, *argv])})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                    env.get("PYTHONPATH")) if p)
    # torchrun sets OMP_NUM_THREADS=1 only for more than one rank per node; here the two nodes share
    # one machine, and a rank per node with every core's threads oversubscribed it (measured: a
    # 2-core machine's forward and backward took twice the one-thread time, load average 4).
    env.setdefault("OMP_NUM_THREADS", "1")
    with shaped_network(rate) as net:
        cmds = [net.torchrun(node, RDZV_PORT, nproc // 2, job, python=sys.executable) for node in (0, 1)]
        for node, cmd in enumerate(cmds):
            print(f"launching node {node} ({net.nodes[node].namespace}, {net.nodes[node].addr}, link {rate}): "
                  f"{shlex.join(cmd)}", file=sys.stderr, flush=True)
        # Both nodes see this machine's GPUs: place_rank counts the ranks of both (Note [Benchmark device]).
        procs = [net.popen(node, cmd, env={**env, **machine_env(node, nproc // 2)}, start_new_session=True)
                 for node, cmd in enumerate(cmds)]
        try:
            codes = [p.wait() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    return next((c for c in codes if c), 0)


def here_or_relaunched(module: str, argv: Sequence[str], nproc: int, command_env: str,
                       worker: Callable[[], int], net: str = "local") -> int:
    """``worker()`` when this process is a torchrun rank; otherwise ``relaunch`` the module,
    on this machine's loopback (``net="local"``) or as two nodes over a shaped link
    (``net="shaped:RATE"``)."""
    if inside_torchrun():
        return worker()
    if net != "local":
        return relaunch_on_nodes(module, argv, nproc, command_env, net.removeprefix("shaped:"))
    return relaunch(module, argv, nproc, command_env)


def run_checked(cmd: Sequence[str], *, env: Mapping[str, str], timeout: float, what: str | None = None,
                cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` to the end with its output captured.

    Raises:
        RuntimeError: it exited non-zero; the message carries the tail of its output.
    """
    proc = subprocess.run(list(cmd), cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{what or shlex.join(cmd)} failed with exit code {proc.returncode}, so this benchmark has no "
            f"result for it. The tail of its output follows; run `{shlex.join(cmd)}` alone to see all of it."
            f"\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def job_env(inductor_dir: str | Path | None = None, **extra: str) -> dict[str, str]:
    """This environment for a benchmark's child job: one thread per rank (as torchrun sets it)
    unless set, ``TORCHINDUCTOR_CACHE_DIR`` only where given, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.setdefault("OMP_NUM_THREADS", "1")
    if inductor_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    env.update(extra)
    return env


def run_main_job(overrides: Sequence[str], run_dir: Path, *, nproc: int, env: Mapping[str, str], timeout: float,
                 entry: Sequence[str] = ("launch.train",), what: str | None = None) -> tuple[dict, float]:
    """One run of the main job in a new process: ``python -m launch.train OVERRIDES`` (under
    torchrun for ``nproc`` > 1; ``entry`` = a wrapper module and its arguments, such as
    ``("benchmarks.studies.rank_inductor", "launch.train")``), its Hydra run directory ``run_dir``.
    Returns its ``metrics.json`` and the wall seconds of the whole process.

    Raises:
        RuntimeError: the job failed (``run_checked``).
    """
    module, *args = entry
    args = [*args, *overrides, f"hydra.run.dir={run_dir}"]
    cmd = torchrun_command(module, args, nproc) if nproc > 1 else [sys.executable, "-m", module, *args]
    t0 = time.perf_counter()
    run_checked(cmd, env=env, timeout=timeout, what=what, cwd=Path.cwd())
    wall = time.perf_counter() - t0
    return json.loads((Path(run_dir) / "metrics.json").read_text()), wall
