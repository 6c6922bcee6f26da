"""The optimizer in backward (``compile_ddp(..., optimizer=opt)``) against the same strategy
without it: peak memory and step time, interleaved, over no link and shaped links (see
Note [Optimizer in backward study]).

    python -m benchmarks.studies.optimizer_in_backward --out benchmarks/results/optimizer_in_backward.json
    python -m benchmarks.studies.optimizer_in_backward --quick --out /tmp/oib.json    # aot_eager, no link, small
    python -m benchmarks.studies.optimizer_in_backward --render --out benchmarks/results/optimizer_in_backward.json

One 2-rank torchrun job per link and batch (``--links none,200,800``: loopback, then two nodes in
network namespaces joined by a link shaped to 200 and 800 Mbit/s, ``benchmarks.link.netns``; needs
root and iproute2; ``--batches 8,1`` sequences per rank); the rows of all of them go to ``--out``.
``--render`` writes the docs block of ``docs/benchmarks/optimizer-in-backward.md`` from that JSON
(as ``benchmarks.render.pages`` does).

Note [Optimizer in backward study]
----------------------------------
Background
    With ``optimizer=`` each bucket is updated right after its reduction and its gradients
    freed (Note [Optimizer in backward]), so the gradients never all live at once, and the
    update of every bucket but the last may hide behind backward and the link.

Algorithm
    1. One job per link and batch; in it, per strategy (``split``, ``traced``) at ``bucket_cap_mb="auto"``,
       two copies of the repository's GPT from one seed, each with its own AdamW: one compiled
       without ``optimizer=`` (``optimizer.step()`` after backward), one with it. A strategy
       that ``compile_ddp`` refuses with ``optimizer=`` gets two rows ``skipped`` with its message.
       Where the torch's DDP takes ``lazy_bucket_allocation`` (2.15), a peer row: eager DDP built
       with it (DDP's own caps, ``optimizer.step()`` after backward), mode ``eager``.
    2. Interleaved rounds (``benchmarks.harness.rounds``): each round every copy in turn, the
       order rotating, runs a synchronised step and a ``no_sync`` step, a barrier before each.
       ``ratio_vs_without``: median (IQR) of per-round ratios of the step to the same
       strategy's step without the optimizer in backward.
    3. Peak memory per rank over the synchronised step (forward, backward, ``optimizer.step()``,
       ``zero_grad()``): on a GPU ``torch.cuda.max_memory_allocated``; on the CPU the live tensor
       bytes of the rank's process, every thread included, counted by a shim preloaded into the
       ranks (Note [Live heap bytes] in ``benchmarks.harness.heap_peak``; ``peak_heap_mib``: the
       peak of its whole heap, compiled graphs and Python objects too). Measured in a
       2-rank job per mode after the timed job, over the same link, with only that mode's copy
       in each process (``--memory-rounds`` steps after one warm-up): what a rank holds between
       steps is part of its peak (DDP's bucket buffers, given back between steps under the
       optimizer in backward, Note [Bucket buffers between steps]), which a process holding
       every mode's copy would count for all rows alike. ``peak_mib`` is the most over ranks and
       steps; ``peak_shared_mib`` keeps the timed job's (every copy in the process).
    4. The limit (``limit_columns``), from parts measured in the same job: fwd and bwd the
       fastest ``no_sync`` medians, opt the fastest ``optimizer.step() + zero_grad()`` median of
       the rows without, comm one all-reduce of all gradient bytes after the rounds
       (Note [Physical limit of a step]). Without: ``fwd + max(bwd, comm) + opt``. With: a bucket's
       update starts once its bytes have arrived and shares the rank's compute with backward
       (one core per rank here, one stream on a GPU), so
       ``fwd + max(bwd + opt, comm + opt_last)``, ``opt_last = opt * last bucket bytes /
       all gradient bytes`` for the bucket reduced last. The gain it allows is
       ``min(comm - bwd, opt - opt_last)`` on a link-bound step and none on a compute-bound one.

Notes
    - AdamW (fp32 state), the update whose memory argument the feature is made for; the
      other DDP studies step SGD.
    - ``--render`` and ``benchmarks.render.pages`` read the JSON only; the ranks run
      ``benchmarks.studies.optimizer_in_backward_ranks``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

from ..harness.cli import rendered_parser
from ..harness.report import fmt, markdown_table, print0, write_json
from ..render.optimizer_in_backward_report import HEADERS, PAGE, START, done_when, limit_columns, render, row_cells

log = logging.getLogger(__name__)

__all__ = ["STRATEGIES", "parse_args", "main"]

STRATEGIES = ("split", "traced")
COMMAND_ENV = "BENCH_OPT_IN_BWD_COMMAND"
QUICK = {"backend": "aot_eager", "links": "none", "batches": "8", "rounds": 3, "warmup": 1, "layers": 2, "embd": 128}
FULL = {"backend": "inductor", "links": "none,200,800", "batches": "8,1", "rounds": 20, "warmup": 3, "layers": 4,
        "embd": 256}


def _links(text: str) -> tuple[str, ...]:
    """``none`` (loopback) and shaped links' rates in tc's units: ``200`` and ``200mbit`` give ``200mbit``."""
    from ..link.netns import parse_rate

    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    try:
        links = tuple(t if t == "none" else parse_rate(t + "mbit" if t.replace(".", "", 1).isdigit() else t)
                      for t in names)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--links {text!r}: {e} Each link is a rate in Mbit/s or none (loopback), "
                                         "e.g. none,200,800.") from None
    if not links:
        raise argparse.ArgumentTypeError(f"--links {text!r} names no link: pass e.g. none,200,800 (Mbit/s)")
    return links


def _batches(text: str) -> tuple[int, ...]:
    batches = tuple(int(t) for t in text.split(",") if t.strip().isdigit())
    if not batches or min(batches) < 1 or len(batches) != len([t for t in text.split(",") if t.strip()]):
        raise argparse.ArgumentTypeError(f"--batches {text!r}: give positive sequences per rank, e.g. 8,1")
    return batches


def _strategies(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names or set(names) - set(STRATEGIES):
        raise argparse.ArgumentTypeError(f"--strategies {text!r}: choose from {', '.join(STRATEGIES)} (default both)")
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = rendered_parser("benchmarks.studies.optimizer_in_backward", __doc__, PAGE, START)
    p.add_argument("--quick", action="store_true",
                   help="aot_eager, no link, 1 warmup + 3 rounds, 2x128 GPT (flags given explicitly still win)")
    p.add_argument("--links", type=_links, default=None,
                   help="comma-separated: none (loopback) and shaped rates in Mbit/s (default none,200,800)")
    p.add_argument("--strategies", type=_strategies, default=STRATEGIES, help="split, traced (default both)")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds per job (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured rounds per job (default 3)")
    p.add_argument("--backend", default=None, help="dynamo backend (default inductor)")
    p.add_argument("--layers", type=int, default=None, help="GPT blocks (default 4)")
    p.add_argument("--embd", type=int, default=None, help="GPT width (default 256: ~12.6 MiB of gradients)")
    p.add_argument("--batches", type=_batches, default=None,
                   help="sequences per rank per step, one job per link and batch (default 8,1: activations above "
                        "the gradients, then below them)")
    p.add_argument("--memory-rounds", type=int, default=3,
                   help="synchronised steps measured in each mode's own memory job (default 3)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu",
                   help="where the ranks run (default cpu; cuda: peak from torch.cuda.max_memory_allocated)")
    # Set by the launcher for each link's job; not for users.
    p.add_argument("--job-link", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-batch", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-memory", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, {"links": _links, "batches": _batches}.get(key, lambda v: v)(value))
    if not args.render and (args.rounds < 1 or args.warmup < 0):
        p.error(f"--rounds {args.rounds} --warmup {args.warmup}: a result needs at least one measured round; pass "
                "--rounds 1 or more and --warmup 0 or more.")
    return args


# --- running: one torchrun job per link and batch ------------------------------------------------


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``extra`` for the block (the jobs started in it inherit them)."""
    old = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(old)


def _run_links(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from ..harness.heap_peak import build_shim, preload_env
    from ..harness.torchrun import here_or_relaunched
    from ..link import netns

    shaped = [link for link in args.links if link != "none"]
    reason = netns.unavailable_reason() if shaped else None
    if reason is not None:
        raise SystemExit(f"optimizer_in_backward: --links {','.join(shaped)} need two network namespaces, which cannot "
                         f"be made here ({reason}); run as root with iproute2, or pass --links none.")
    command = os.environ.get(COMMAND_ENV, shlex.join(["python", "-m", "benchmarks.studies.optimizer_in_backward",
                                                      *argv]))
    folder = tempfile.mkdtemp(prefix="opt-in-bwd-")  # private (0700): the shim, the parts, the Inductor cache
    rows, failed = [], []
    t0 = time.perf_counter()
    try:
        lib = build_shim(folder) if args.device == "cpu" else None
        env = preload_env(lib, {})
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(folder) / "inductor")  # shared by the links' jobs: warm after one

        def launch(link: str, batch: int, part: Path, *extra: str) -> int | None:
            """One 2-rank job over ``link``; None when it wrote ``part``, else its exit code."""
            job_argv = [*argv, "--job-link", link, "--job-part", str(part), "--job-batch", str(batch), *extra]
            with _environ({**env, COMMAND_ENV: command}):
                code = here_or_relaunched("benchmarks.studies.optimizer_in_backward", job_argv, 2, COMMAND_ENV,
                                          lambda: 0, net="local" if link == "none" else f"shaped:{link}")
            return None if code == 0 and part.exists() else code

        for link, batch in ((link, batch) for batch in args.batches for link in args.links):
            part = Path(folder) / f"{link}-{batch}.json"
            load = os.getloadavg()[0]
            code = launch(link, batch, part)
            if code is not None:
                failed.append(link)
                print0(f"optimizer_in_backward: the {link} batch {batch} job failed (exit {code}); its rows are "
                       "missing")
                continue
            job_rows = json.loads(part.read_text())
            for row in job_rows:
                row.update(command=command, date=time.strftime("%Y-%m-%d"), loadavg=[load, os.getloadavg()[0]],
                           cpus=os.cpu_count())
                rows.append(row)
            for row in (r for r in job_rows if not r.get("skipped")):  # step 3: each mode alone in its process
                memory = Path(folder) / f"{link}-{batch}-{row['runner']}-memory.json"
                code = launch(link, batch, memory, "--job-memory", row["runner"], "--rounds", str(args.memory_rounds),
                              "--warmup", "1")
                if code is not None:
                    failed.append(f"{link} memory")
                    print0(f"optimizer_in_backward: the {link} batch {batch} memory job of {row['runner']} failed "
                           f"(exit {code}); its memory columns are those of the shared job")
                    continue
                row["peak_shared_mib"] = row["peak_mib"]  # every mode's copy in that process
                row.update(json.loads(memory.read_text()), memory_rounds=args.memory_rounds)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    limit_columns(rows)
    write_json(rows, args.out)
    print(markdown_table(HEADERS, [row_cells(r) for r in rows]), flush=True)
    for g in done_when(rows):
        print(f"{g['link']} batch {g['batch']} {g['mode']}: peak saved {fmt(g['peak_saved_of_grad'], '.2f')} x grad "
              f"bytes (at most {fmt(g['peak_saved_bound_of_grad'], '.2f')}); step ratio {fmt(g['ratio'], '.3f')}"
              + (f" ({g['why']})" if g["why"] else ""), flush=True)
    print(f"optimizer_in_backward: wrote {args.out} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 1 if failed else 0


def _worker(args: argparse.Namespace) -> int:
    from ..harness.cli import process_group
    from .optimizer_in_backward_ranks import InBackwardJob, run_job, run_memory_job

    cfg = InBackwardJob(device=args.device, backend=args.backend, warmup=args.warmup, rounds=args.rounds,
                        layers=args.layers, embd=args.embd, batch=args.job_batch, strategies=args.strategies,
                        link=args.job_link)
    with process_group(cfg.device, f"optimizer_in_backward [{args.job_link}]"):
        if args.job_memory is not None:
            run_memory_job(cfg, args.job_memory, args.job_part)
        else:
            run_job(cfg, args.job_part)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.render:
        render(args.out, args.page)
        print(f"updated {args.page}")
        return 0
    if args.job_link is not None:
        from ..harness.torchrun import inside_torchrun

        if inside_torchrun():
            return _worker(args)
    if args.device == "auto":
        from ..harness.device import resolve_device

        args.device = resolve_device("auto")
        argv = [*argv, "--device", args.device]
    return _run_links(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
