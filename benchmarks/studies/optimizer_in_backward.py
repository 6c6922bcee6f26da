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
    2. Interleaved rounds (``benchmarks.harness.rounds``): each round every copy in turn, the
       order rotating, runs a synchronised step and a ``no_sync`` step, a barrier before each.
       ``ratio_vs_without``: median (IQR) of per-round ratios of the step to the same
       strategy's step without the optimizer in backward.
    3. Peak memory per rank over the synchronised step (forward, backward, ``optimizer.step()``,
       ``zero_grad()``): on a GPU ``torch.cuda.max_memory_allocated``; on the CPU the live heap
       bytes of the rank's process, every thread included, counted by a malloc shim preloaded
       into the ranks (Note [Live heap bytes] in ``benchmarks.harness.heap_peak``). ``peak_mib``
       is the most over ranks and rounds; both copies' weights and optimizer states are in it
       alike, so the difference between the two rows is the step's own.
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
from ..harness.report import fmt, markdown_table, print0, update_section, with_iqr, write_json

log = logging.getLogger(__name__)

__all__ = ["START", "END", "PAGE", "STRATEGIES", "parse_args", "limit_columns", "done_when", "results_markdown",
           "render", "main"]

START = "<!-- bench:optimizer-in-backward:start -->"
END = "<!-- bench:optimizer-in-backward:end -->"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "optimizer-in-backward.md"
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
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu",
                   help="where the ranks run (default cpu; cuda: peak from torch.cuda.max_memory_allocated)")
    # Set by the launcher for each link's job; not for users.
    p.add_argument("--job-link", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-batch", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, {"links": _links, "batches": _batches}.get(key, lambda v: v)(value))
    if not args.render and (args.rounds < 1 or args.warmup < 0):
        p.error(f"--rounds {args.rounds} --warmup {args.warmup}: a result needs at least one measured round; pass "
                "--rounds 1 or more and --warmup 0 or more.")
    return args


# --- pure: the limit, the done-when figures and the docs block, from the rows ------------------------


def _job(row: dict) -> tuple[str, int | None]:
    """The job a row was measured in: its link and batch."""
    return row["link"], row.get("batch")


def limit_columns(rows: list[dict]) -> list[dict]:
    """Each measured row with its limit and parts (Note [Optimizer in backward study], step 4), per job;
    each row with the optimizer in backward also with ``peak_saved_mib``, ``peak_saved_of_grad`` and
    ``limit_gain_ms`` against its strategy's row without."""
    for job in dict.fromkeys(_job(r) for r in rows):
        measured = [r for r in rows if _job(r) == job and not r.get("skipped")]
        without = [r for r in measured if not r["optimizer_in_backward"]]
        if not without:
            continue
        fwd, bwd = min(r["fwd_ms"] for r in measured), min(r["bwd_ms"] for r in measured)
        opt, comm = min(r["opt_ms"] for r in without), measured[0]["comm_ms"]
        for r in measured:
            last = r.get("last_bucket_mib")
            opt_last = opt * last / r["grad_mib"] if last is not None else 0.0  # unknown: 0 keeps it a bound
            limit = fwd + (max(bwd + opt, comm + opt_last) if r["optimizer_in_backward"] else max(bwd, comm) + opt)
            r.update(limit_ms=limit, limit_fwd_ms=fwd, limit_bwd_ms=bwd, limit_comm_ms=comm, limit_opt_ms=opt,
                     limit_opt_last_ms=opt_last if r["optimizer_in_backward"] else None, link_bound=comm > bwd,
                     step_over_limit=r["step_ms_median"] / limit)
        for r in measured:
            base = next((b for b in without if b["mode"] == r["mode"]), None)
            if r["optimizer_in_backward"] and base is not None:
                saved = _less(base, r, "peak_mib")
                freed = _less(base, r, "backward_end_mib")
                r.update(peak_saved_mib=saved, peak_saved_of_grad=saved / r["grad_mib"] if saved is not None else None,
                         backward_end_saved_of_grad=freed / r["grad_mib"] if freed is not None else None,
                         limit_gain_ms=base["limit_ms"] - r["limit_ms"])
    return rows


def _less(base: dict, r: dict, key: str) -> float | None:
    return base[key] - r[key] if base.get(key) is not None and r.get(key) is not None else None


def _why_not_faster(r: dict) -> str:
    """Why a row with the optimizer in backward did not step faster, from its limit's parts."""
    bwd, comm, opt, last = (r[f"limit_{k}_ms"] for k in ("bwd", "comm", "opt", "opt_last"))
    if not r["link_bound"]:
        return (f"compute-bound (bwd {bwd:.0f} ms >= comm {comm:.0f} ms): both limits are fwd + bwd + opt, so the "
                "update only moves into backward, where it competes for the same core")
    return (f"link-bound, but the limits allow at most min(comm - bwd, opt - opt_last) = min({comm - bwd:.0f}, "
            f"{opt - last:.0f}) = {r['limit_gain_ms']:.0f} ms ({r['limit_gain_ms'] / r['step_ms_median']:.0%} of the "
            f"step), inside the ratio's IQR [{r['ratio_vs_without_q1']:.3f}, {r['ratio_vs_without_q3']:.3f}]")


def _why_not_lower(r: dict) -> str:
    """Why a row with the optimizer in backward did not lower the peak by 0.8 of the gradient bytes."""
    own, activations, grad = r["peak_above_start_mib"], r["forward_end_mib"], r["grad_mib"]
    if own - activations < 0.2 * grad:
        return (f"the step's own peak ({own:.1f} MiB) is forward's activations ({activations:.1f} MiB live when "
                "forward ended) as backward starts, before any gradient exists to free")
    buckets = r.get("bucket_mib") or []
    text = (f"the step's own peak is {own:.1f} MiB, of which {activations:.1f} MiB are forward's activations; the "
            f"other {own - activations:.1f} MiB are backward's temporaries and the gradients live at once: a bucket's "
            "gradients live from its backward until its update")
    if buckets:
        text += (f", and the auto plan's {len(buckets)} bucket(s) are large (the largest {max(buckets):.1f} MiB, the "
                 f"last reduced {buckets[-1]:.1f} MiB, of {grad:.1f} MiB)")
    return text


def done_when(rows: Sequence[dict]) -> list[dict]:
    """Per link and strategy with the optimizer in backward measured: peak saved / gradient bytes
    (goal >= 0.8), the step ratio to the same strategy without (goal <= 1.00) and, where that
    ratio is above 1.00, why from the limit's parts."""
    out = []
    for r in rows:
        if r["optimizer_in_backward"] and not r.get("skipped") and "limit_gain_ms" in r:
            ratio = r["ratio_vs_without"]
            saved = r.get("peak_saved_of_grad")
            out.append({"link": r["link"], "batch": r.get("batch"), "mode": r["mode"], "peak_saved_of_grad": saved,
                        "memory_met": saved is not None and saved >= 0.8,
                        "backward_end_saved_of_grad": r.get("backward_end_saved_of_grad"), "ratio": ratio,
                        "ratio_q1": r["ratio_vs_without_q1"], "ratio_q3": r["ratio_vs_without_q3"],
                        "speed_met": ratio <= 1.0, "why": None if ratio <= 1.0 else _why_not_faster(r),
                        "memory_why": None if saved is None or saved >= 0.8 else _why_not_lower(r)})
    return out


HEADERS = ["link", "batch", "mode", "optimizer in backward", "step ms [IQR]", "vs without [IQR]", "peak MiB",
           "step's own peak MiB", "peak saved / grad bytes", "live at forward's end MiB", "live at backward's end MiB",
           "limit ms", "step / limit",
           "fwd / bwd / comm / opt / opt_last ms"]


def _cells(r: dict) -> list[str]:
    if r.get("skipped"):
        return [r["link"], fmt(r.get("batch"), "d"), r["mode"], "yes" if r["optimizer_in_backward"] else "no",
                "skipped (below)", *[""] * (len(HEADERS) - 5)]
    parts = " / ".join(fmt(r.get(f"limit_{k}_ms"), ".0f") for k in ("fwd", "bwd", "comm", "opt", "opt_last"))
    return [r["link"], fmt(r.get("batch"), "d"), r["mode"], "yes" if r["optimizer_in_backward"] else "no",
            with_iqr(r["step_ms_median"], r.get("step_ms_q1"), r.get("step_ms_q3"), ".0f"),
            with_iqr(r["ratio_vs_without"], r.get("ratio_vs_without_q1"), r.get("ratio_vs_without_q3")),
            fmt(r["peak_mib"], ".1f"), fmt(r.get("peak_above_start_mib"), ".1f"),
            fmt(r.get("peak_saved_of_grad"), ".2f"), fmt(r.get("forward_end_mib"), ".1f"),
            fmt(r.get("backward_end_mib"), ".1f"), fmt(r.get("limit_ms"), ".0f"),
            fmt(r.get("step_over_limit"), ".2f"), parts]


def _goal_line(g: dict) -> str:
    met = {True: "met", False: "not met"}
    return (f"- {g['link']}, batch {fmt(g['batch'], 'd')}, {g['mode']}: peak lowered by "
            f"{fmt(g['peak_saved_of_grad'], '.2f')} x the gradient bytes ({met[g['memory_met']]}, goal >= 0.8), live "
            f"bytes at backward's end by {fmt(g['backward_end_saved_of_grad'], '.2f')} x; step "
            f"{with_iqr(g['ratio'], g['ratio_q1'], g['ratio_q3'])} x without ({met[g['speed_met']]}, goal <= 1.00)"
            + (f": {g['why']}" if g["why"] else "") + (f"; memory: {g['memory_why']}" if g["memory_why"] else ""))


def results_markdown(rows: Sequence[dict]) -> str:
    """The docs block: how it was measured, the table, the done-when figures, the command."""
    measured = [r for r in rows if not r.get("skipped")]
    r0 = (measured or list(rows))[0]
    peak_how = ("torch.cuda.max_memory_allocated" if str(r0["device"]).startswith("cuda") else
                "the live heap bytes of the rank's process, every thread included (a malloc shim, "
                "`benchmarks/harness/heap_peak.py`)")
    text = (f"torch {r0['torch']}, {r0['device']}, {r0.get('date', '?')}: {r0['world_size']} ranks over gloo; links: "
            + ", ".join(dict.fromkeys(r["link"] for r in rows)) + " (none = loopback; a rate = two nodes in network "
            f"namespaces joined by a `tc tbf` link). {r0['model'].rsplit(', batch', 1)[0]}, batch "
            + ", ".join(str(b) for b in dict.fromkeys(r.get("batch") for r in rows)) + " sequences per rank (one job "
            f"per link and batch), {r0['grad_mib']:.1f} MiB of fp32 gradients, "
            f"AdamW, `{r0['backend']}`, `bucket_cap_mb=\"auto\"`; per job {r0.get('warmup', '?')} warm-up and "
            f"{r0.get('rounds', '?')} measured interleaved rounds. Peak: the most over ranks and rounds of {peak_how} "
            "during a synchronised step (forward, backward, `optimizer.step()`, `zero_grad()`); the step's own peak "
            "is that minus the bytes live when the step started (weights and optimizer states of every copy in "
            "the job); live at forward's and backward's end: the bytes live when the forward or `backward()` "
            "returned minus those at the start (median over rounds, most over ranks): forward's activations, and "
            "the gradients unless their updates freed them. vs without: median of per-round ratios to the same "
            "strategy without the optimizer in backward, IQR in brackets. limit: without "
            "`fwd + max(bwd, comm) + opt`, with `fwd + max(bwd + opt, comm + opt_last)`.")
    skipped = {r["mode"]: r["skipped"] for r in rows if r.get("skipped")}
    parts = [text, markdown_table(HEADERS, [_cells(r) for r in rows]),
             "\n".join(f"Skipped, {mode}: {why}" for mode, why in skipped.items())]
    goals = done_when(rows)
    if goals:
        parts.append("Against the goals:\n\n" + "\n".join(_goal_line(g) for g in goals))
    parts += [f"Command: `{r0['command']}`" if r0.get("command") else "",
              "Generated by `python -m benchmarks.render.pages` from `benchmarks/results/optimizer_in_backward.json`."]
    return "\n\n".join(p for p in parts if p)


def render(out: str | Path, page: str | Path = PAGE) -> str:
    """Rewrite ``page``'s block from the rows at ``out``; return the block."""
    return update_section(page, results_markdown(json.loads(Path(out).read_text())), START, END)


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
        for link, batch in ((link, batch) for batch in args.batches for link in args.links):
            part = Path(folder) / f"{link}-{batch}.json"
            load = os.getloadavg()[0]
            job_argv = [*argv, "--job-link", link, "--job-part", str(part), "--job-batch", str(batch)]
            with _environ({**env, COMMAND_ENV: command}):
                code = here_or_relaunched("benchmarks.studies.optimizer_in_backward", job_argv, 2, COMMAND_ENV,
                                          lambda: 0, net="local" if link == "none" else f"shaped:{link}")
            if code != 0 or not part.exists():
                failed.append(link)
                print0(f"optimizer_in_backward: the {link} batch {batch} job failed (exit {code}); its rows are "
                       "missing")
                continue
            for row in json.loads(part.read_text()):
                row.update(command=command, date=time.strftime("%Y-%m-%d"), loadavg=[load, os.getloadavg()[0]],
                           cpus=os.cpu_count())
                rows.append(row)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    limit_columns(rows)
    write_json(rows, args.out)
    print(markdown_table(HEADERS, [_cells(r) for r in rows]), flush=True)
    for g in done_when(rows):
        print(f"{g['link']} batch {g['batch']} {g['mode']}: peak saved {fmt(g['peak_saved_of_grad'], '.2f')} x grad "
              f"bytes; step ratio {fmt(g['ratio'], '.3f')}" + (f" ({g['why']})" if g["why"] else ""), flush=True)
    print(f"optimizer_in_backward: wrote {args.out} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 1 if failed else 0


def _worker(args: argparse.Namespace) -> int:
    from ..harness.cli import process_group
    from .optimizer_in_backward_ranks import InBackwardJob, run_job

    cfg = InBackwardJob(device=args.device, backend=args.backend, warmup=args.warmup, rounds=args.rounds,
                        layers=args.layers, embd=args.embd, batch=args.job_batch, strategies=args.strategies,
                        link=args.job_link)
    with process_group(cfg.device, f"optimizer_in_backward [{args.job_link}]"):
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
