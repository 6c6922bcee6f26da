"""A recompile on one rank only, longer than the process group's timeout: what PyTorch's
own mechanisms do, and what ``compile_ddp``'s step gate does (Note [Step gate]).

    python -m benchmarks.studies.step_gate_peers                 # every mode, one 2-rank gloo job each
    python -m benchmarks.studies.step_gate_peers --modes gate    # one mode

Two gloo ranks on this machine train a small MLP for 4 steps; at step 2 rank 1 alone gets a
batch of another size (a shape only it sees), so rank 1 alone recompiles, and that
recompile sleeps ``--sleep`` seconds (default 10) in the backend, past the process group's
``--timeout`` (default 6 s). Modes:

- ``torch_compile``: ``torch.compile(DDP(model))``, PyTorch's DDPOptimizer;
- ``guard_collectives``: the same with ``torch.compiler.set_enable_guard_collectives(True)``
  (every rank recompiles when one must);
- ``compiler_collectives``: the same with ``torch._dynamo.config.enable_compiler_collectives``
  as well (ranks that compile together agree on shapes);
- ``gate``: ``compile_ddp(DDP(model))`` (its step gate on, the default);
- ``no_gate``: ``compile_ddp(..., step_gate=False)``.

Each line says how every rank ended (finished, or the first error) and after how long.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import socket
import time
from typing import Sequence

MODES = ("torch_compile", "guard_collectives", "compiler_collectives", "gate", "no_gate")


def _rank(rank: int, mode: str, port: int, sleep_s: float, timeout_s: float, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    state = {"step": 0, "slept": False}

    def backend(gm, example_inputs):
        if rank == 1 and state["step"] >= 1 and not state["slept"]:
            state["slept"] = True
            time.sleep(sleep_s)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    class Net(nn.Module):  # not an nn.Sequential: torch.compile(DDP(nn.Sequential(...))) compiles nothing
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)],
                                      nn.Linear(64, 1))

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=1)  # PyTorch's splitter refuses caps under 1 MiB
    if mode in ("gate", "no_gate"):
        from ddp_opt import compile_ddp

        model = compile_ddp(ddp, backend=backend, step_gate=mode == "gate")
    else:
        if mode in ("guard_collectives", "compiler_collectives"):
            torch.compiler.set_enable_guard_collectives(True)
        if mode == "compiler_collectives":
            torch._dynamo.config.enable_compiler_collectives = True
        model = torch.compile(ddp, backend=backend)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    start = time.perf_counter()
    try:
        for step in range(4):
            state["step"] = step
            rows = 6 if (rank == 1 and step == 2) else 8
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(100 * step + rank))
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        outcome = f"finished, {time.perf_counter() - start:.1f} s" + (f", recompiled for {sleep_s:.0f} s" if state["slept"]
                                                                       else "")
    except Exception as e:  # noqa: BLE001 - reported, the point of the run
        first = re.sub(r"\[/[^\]]*\] ", "", str(e).strip().splitlines()[0])[:90]  # no source paths
        outcome = f"failed after {time.perf_counter() - start:.1f} s: {type(e).__name__}: {first}"
    queue.put((rank, outcome))
    queue.close()
    queue.join_thread()
    os._exit(0)  # no teardown: a peer may be gone


def run_mode(mode: str, sleep_s: float, timeout_s: float) -> list[str]:
    """Each rank's outcome in one 2-rank job of ``mode``."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, mode, port, sleep_s, timeout_s, queue)) for r in range(2)]
    for p in procs:
        p.start()
    outcomes = {}
    for _ in procs:
        try:
            rank, outcome = queue.get(timeout=sleep_s + timeout_s + 120)
            outcomes[rank] = outcome
        except Exception:  # noqa: BLE001 - a rank that never reports
            break
    for p in procs:
        p.kill()
    return [outcomes.get(r, "hung (no report)") for r in range(2)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--sleep", type=float, default=10.0, help="seconds rank 1's recompile takes")
    p.add_argument("--timeout", type=float, default=6.0, help="the process group's timeout, seconds")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"unknown mode(s) {unknown}: the modes are {', '.join(MODES)}")
    import torch

    print(f"torch {torch.__version__}; rank 1 recompiles alone for {args.sleep:.0f} s, the process group's "
          f"timeout is {args.timeout:.0f} s\n")
    print("| mode | rank 0 | rank 1 |\n|---|---|---|")
    for mode in modes:
        r0, r1 = run_mode(mode, args.sleep, args.timeout)
        print(f"| {mode} | {r0} | {r1} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
