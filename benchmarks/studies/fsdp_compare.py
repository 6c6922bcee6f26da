"""FSDP2 without compile vs per-block compile vs per-block compile with shard-unit
grouping and explicit prefetch (ours), side by side in one torchrun job (see Note
[Interleaved FSDP benchmark] in ``benchmarks.studies.fsdp_bench``).

    python -m benchmarks.studies.fsdp_compare --quick --json bench_out/fsdp_quick.json
    python -m benchmarks.studies.fsdp_compare --json bench_out/fsdp.json --readme docs/fsdp.md
    python -m benchmarks.studies.fsdp_compare --from-json bench_out/fsdp.json --readme docs/fsdp.md   # no run

Run outside torchrun, it relaunches itself under ``torch.distributed.run
--standalone --nproc-per-node N``; rank 0 prints progress to stderr and the table
to stdout, and writes the JSON rows, the plot and the docs page's section (``docs/fsdp.md``).

``--device auto`` (the default) runs on CUDA when ``torch.cuda.is_available()``,
else on the CPU over gloo; ``--device cuda`` without CUDA stops before launching
anything (exit code 2). On CUDA each rank takes GPU ``LOCAL_RANK % GPUs`` (NCCL
when every rank has a GPU of its own, else gloo; Note [Benchmark device] in
``benchmarks.harness.device``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from ..harness import report
from ..harness.cli import add_common_args, check_device, check_net, new_parser, fill_defaults, job_kwargs, process_group, publish
from ..harness.report import fmt, markdown_table, print0, terminal_table, update_section, with_iqr
from ..harness.torchrun import here_or_relaunched

__all__ = ["main", "parse_args", "format_table", "results_markdown", "replace_section", "section_body", "update_readme",
           "ROW_KEYS", "START", "END"]

# The keys every row carries; rows carry more (IQRs, unit sizes, compile seconds, limit parts, ...).
ROW_KEYS = ("mode", "backend", "net", "step_ms_median", "ratio_vs_per_block", "ratio_vs_best_peer", "limit_ms",
            "step_over_limit", "peak_mem_mib_per_rank", "loss_max_abs_diff", "units")

START = "<!-- bench:fsdp:start -->"
END = "<!-- bench:fsdp:end -->"

COMMAND_ENV = "BENCH_FSDP_COMMAND"  # the user's command line, handed to the workers by relaunch
QUICK = {"backend": "aot_eager", "warmup": 2, "steps": 20}
DEFAULTS = {"backend": "inductor", "warmup": 3, "steps": 30}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = new_parser("benchmarks.studies.fsdp_compare", __doc__, "aot_eager, 2 warmup + 20 measured rounds")
    p.add_argument("--modes", default="eager,per_block,grouped", help="comma-separated subset of the modes")
    p.add_argument("--shard-unit-mb", type=float, default=2.0, help="grouped: target MiB per shard unit (default 2)")
    p.add_argument("--prefetch", type=int, default=1, help="grouped: shard units all-gathered ahead (default 1)")
    p.add_argument("--steps", type=int, default=None, help="measured rounds (default 30)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured rounds (default 3)")
    add_common_args(p, layers=8, embd=128, embd_help="model width (default 128: ~0.76 MiB per block)",
                    plot_help="PNG of step time per mode")
    p.add_argument("--readme", default=None,
                   help=f"Markdown file whose {START} ... {END} section is rewritten from the rows")
    p.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                   help="with --readme: write the section from these row files (one table each), no run")
    p.add_argument("--memory-rounds", type=int, default=None,
                   help="after the timed job, one job per mode alone in its processes over the same link, measuring "
                        "the peak of live tensor bytes per rank over this many steps (on the CPU through a preloaded "
                        "malloc shim, Note [Live heap bytes]); default 0: no memory jobs, the timed job's "
                        "per-process figure")
    p.add_argument("--job-memory", default=None, help=argparse.SUPPRESS)  # a memory job's mode (set by the launcher)
    p.add_argument("--job-part", default=None, help=argparse.SUPPRESS)  # where a memory job writes its columns
    args = p.parse_args(argv)
    fill_defaults(args, QUICK if args.quick else DEFAULTS)
    if args.memory_rounds is None:
        args.memory_rounds = 0
    if args.from_json and not args.readme:
        p.error("--from-json only renders rows into --readme, and no --readme was given; give --readme docs/fsdp.md too")
    return args if args.from_json else check_device(p, check_net(p, args))  # rendering needs no device


def _cells(r: dict) -> list[str]:
    digits = ".1f" if str(r.get("peak_mem_kind", "")).startswith("live") else ".0f"  # live bytes: tens of MiB
    peak = "/".join(f"{m:{digits}}" for m in r["peak_mem_mib_per_rank"]) if r.get("peak_mem_mib_per_rank") else "-"
    units = f"{r['units']} ({_unit_sizes(r.get('unit_mib') or [])})"
    ratio = with_iqr(r.get("ratio_vs_per_block"), r.get("ratio_q1"), r.get("ratio_q3"))
    peer = with_iqr(r.get("ratio_vs_best_peer"), r.get("ratio_vs_best_peer_q1"), r.get("ratio_vs_best_peer_q3"))
    return [r["mode"], r["backend"], fmt(r["step_ms_median"], ".1f"), ratio, peer, fmt(r.get("step_over_limit"), ".2f"),
            fmt(r.get("compile_s"), ".1f"),
            peak, fmt(r.get("loss_max_abs_diff"), ".1e"), units, fmt(r.get("prefetch"), "d")]


def _unit_sizes(mib: Sequence[float]) -> str:
    if mib and len(set(mib)) == 1:
        return f"{mib[0]:.2f} each"
    return "/".join(f"{m:.2f}" for m in mib)


HEADERS = ["mode", "backend", "step ms", "vs per_block [IQR]", "vs best peer [IQR]", "step / limit", "compile s", "peak MiB/rank", "loss diff",
           "units (MiB each)", "prefetch"]


def _modes_text(rows: Sequence[dict]) -> str:
    """What each of the run's modes is, ours marked (a mode that is no peer)."""
    from .fsdp_bench import FSDP_MODES
    from ..harness.limit import FSDP_PEER_MODES

    def one(mode: str) -> str:
        summary = FSDP_MODES[mode].summary if mode in FSDP_MODES.names else "?"
        return f"`{mode}`{'' if mode in FSDP_PEER_MODES else ' (ours)'} = {summary}"

    return "; ".join(one(r["mode"]) for r in sorted(rows, key=lambda r: r.get("mode_order", 0)))


def _limit_text(rows: Sequence[dict]) -> str:
    """The physical limit of each way the run's modes reduce (sharded per dtype, replicate), and what
    the best peer is; empty for rows without limits."""
    kinds: dict[str, dict] = {}
    for r in rows:
        if r.get("limit_ms") is not None:
            kinds.setdefault("replicate" if r.get("replicate") else r.get("reduce_dtype", "fp32"), r)
    if not kinds:
        return ""
    named = len(kinds) > 1
    texts = []
    for kind, r in kinds.items():
        head = f"{kind + ': ' if named else ''}{r['limit_ms']:.1f} ms = "
        compute, opt = f"fwd {r['limit_fwd_ms']:.1f}", f"opt {r['limit_opt_ms']:.1f}"
        if kind == "replicate":
            texts.append(f"{head}{compute} + max(bwd {r['limit_bwd_ms']:.1f}, all-reduce {r['limit_comm_ms']:.1f}) + {opt}")
        else:
            rs = f"reduce-scatter{' in ' + kind if named else ''} {r['limit_reduce_scatter_ms']:.1f}"
            via = str(r.get("limit_reduce_scatter_via", ""))
            if via.startswith("all_to_all"):
                rs += " (an all-to-all and a sum, faster here than gloo's reduce_scatter_tensor)"
            texts.append(f"{head}max({compute} + bwd {r['limit_bwd_ms']:.1f}, 2 x all-gather "
                         f"{r['limit_allgather_ms']:.1f} + {rs}, fwd + reduce-scatter) + {opt}")
    peers = sorted({r["best_peer"] for r in rows if r.get("best_peer")})
    split = any(r.get("limit_reduce_scatter_via") for r in kinds.values())  # rows since the limit also tries 8 parts
    bytes_text = ("all the parameter bytes over the same link, each the faster of one collective of all the bytes and "
                  "8 of an eighth each, back to back" if split else "all the parameter bytes over the same link")
    return (f" Physical limit{'s' if named else ''} {'; '.join(texts)}: fwd and bwd of an unsharded copy with no "
            "communication, one all-gather and one reduce-scatter (replicate: one all-reduce) of "
            f"{bytes_text}, the fastest optimizer step of the modes that reduce that way "
            "(Note [Physical limit of a step] in `benchmarks.harness.limit`); step / limit = 1.0 is a perfect step. "
            "Best peer = the fastest "
            "peer that reduces the same way (sharded or replicate, in the same dtype; here "
            f"{', '.join(f'`{p}`' for p in peers)}).")


def format_table(rows: Sequence[dict]) -> str:
    return terminal_table(HEADERS, [_cells(r) for r in rows])


def results_markdown(rows: Sequence[dict], describe: bool = True) -> str:
    """One run's rows as a Markdown paragraph (what, how measured; left out with
    ``describe=False``), the command and the table."""
    if not rows:
        return "(no rows)"
    r0 = rows[0]
    kind = r0.get("peak_mem_kind", "")
    if kind.startswith("live tensor bytes"):
        mem = ("peak MiB/rank = the most CPU tensor bytes live at once in each rank over a step (forward, backward, "
               "optimizer step), counted by a malloc shim preloaded into the ranks (Note [Live heap bytes] in "
               "`benchmarks.harness.heap_peak`), each mode alone in its processes over the same link after the timed "
               f"rounds ({r0.get('memory_rounds', '?')} steps after its compiling step and one more)")
    elif kind.startswith("cuda"):
        mem = "peak MiB/rank = `torch.cuda.max_memory_allocated` per rank over the measured steps"
    else:
        mem = ("peak MiB/rank = each rank's process RSS high-water mark (`ru_maxrss`) at the end of the job, "
               "the same for every mode (all modes share the process; CPU has no per-mode allocator counter)")
    text = (
        f"FSDP2 over plain {r0.get('transport', 'gloo').split()[0]} (the simulated link of the DDP benchmark is a DDP comm "
        + (f"hook and does not apply to FSDP; here two nodes joined by a link shaped to {r0['net'].split(':')[1]}), "
           if r0.get("net", "local") != "local" else "hook and does not apply to FSDP; on one machine this is loopback), ")
        + f"world size {r0.get('world_size', '?')}, "
        + (f"device `{r0['device']}`, " if r0.get("device") else "") +
        f"{r0.get('model', '')}, {r0.get('param_mib', 0):.1f} MiB of float32 parameters; modes interleaved "
        f"round by round. {_modes_text(rows)}. Ratios are medians of per-round ratios to `per_block` (`-` where it "
        "did not run; IQR in brackets; below 1 is faster). compile s = first step minus the median step (cold: "
        "`torch._dynamo.reset()` and a fresh "
        f"inductor cache dir before each compiled mode); loss diff = max over ranks and steps of |loss - eager's loss|; {mem}. "
        "Absolute times drift between tables with the machine's load; compare modes within a table."
        + _limit_text(rows)
    )
    parts = [text] if describe else []
    run = f"{r0.get('rounds', '?')} measured rounds after {r0.get('warmup', '?')} warmup"
    parts.append(f"Command ({run}): `{r0['command']}`" if r0.get("command") else f"{run}:")
    parts.append(markdown_table(HEADERS, [_cells(r) for r in sorted(rows, key=lambda r: r.get("mode_order", 0))]))
    return "\n\n".join(parts)


def replace_section(text: str, body: str) -> str:
    """``text`` with everything between the FSDP markers replaced by ``body``."""
    return report.replace_section(text, body, START, END)


def section_body(runs: Sequence[Sequence[dict]], sources: Sequence[str] = (), target: str = "PAGE.md") -> str:
    """The FSDP section's text: one table per run, then the command that regenerates it.

    Args:
        runs: each run's rows, as ``--json`` writes them.
        sources: the JSON paths the runs were read from, named in the footer.
        target: the file's path as the footer's command names it.
    """
    body = "\n\n".join(results_markdown(rows, describe=i == 0) for i, rows in enumerate(runs))
    src = " ".join(sources) if sources else "ROWS.json"
    return body + f"\n\nGenerated by `python -m benchmarks.studies.fsdp_compare --from-json {src} --readme {target}`."


def update_readme(runs: Sequence[Sequence[dict]], target: str | Path, sources: Sequence[str] = ()) -> str:
    """Rewrite ``target``'s FSDP section with one table per run (``section_body``); return the new body."""
    return update_section(target, section_body(runs, sources, str(target)), START, END)


def _config(args: argparse.Namespace):
    """The ``fsdp_bench.FSDPBenchConfig`` of the flags; raises ValueError on a bad mode or setting."""
    from .fsdp_bench import FSDPBenchConfig

    return FSDPBenchConfig(**job_kwargs(args), shard_unit_mb=args.shard_unit_mb, prefetch=args.prefetch)


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from .fsdp_bench import FSDP_MODES, run_fsdp, run_fsdp_memory
    from ..harness.plot import plot_rows

    cfg = _config(args)
    if args.job_memory is not None:
        with process_group(cfg.device, f"fsdp_compare memory [{args.job_memory}]"):
            columns = run_fsdp_memory(cfg, args.job_memory)
            if columns is not None:
                Path(args.job_part).write_text(json.dumps(columns))
        return 0
    with process_group(cfg.device, "fsdp_compare"):
        print0(f"fsdp_compare: {dist.get_world_size()} ranks over {dist.get_backend()}, backend {cfg.backend}, "
               f"{cfg.warmup} warmup + {cfg.rounds} measured rounds, modes {list(cfg.modes)}, "
               f"grouped: shard_unit_mb={cfg.shard_unit_mb:g} prefetch={cfg.prefetch}")
        print0(FSDP_MODES.describe(cfg.modes))
        t0 = time.perf_counter()
        rows = run_fsdp(cfg)
        if dist.get_rank() == 0:
            print(format_table(rows), flush=True)
            print0(f"fsdp_compare: done in {time.perf_counter() - t0:.0f} s.")
            publish(rows, args, module="benchmarks.studies.fsdp_compare", command_env=COMMAND_ENV,
                    plot=lambda path: plot_rows(rows, path))
            if args.readme:
                update_readme([rows], args.readme, [args.json] if args.json else ())
                print0(f"updated {args.readme}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.from_json:
        update_readme([json.loads(Path(p).read_text()) for p in args.from_json], args.readme, args.from_json)
        print(f"updated {args.readme}")
        return 0
    _config(args)  # fail before launching anything
    from ..harness.torchrun import inside_torchrun

    if inside_torchrun() or args.job_memory is not None or args.memory_rounds == 0:
        return here_or_relaunched("benchmarks.studies.fsdp_compare", argv, args.nproc, COMMAND_ENV,
                                  lambda: _worker(args), net=args.net)
    return _timed_then_memory(args, argv)


def _timed_then_memory(args: argparse.Namespace, argv: list[str]) -> int:
    """The timed job, then one memory job per mode over the same link (``--memory-rounds``), whose
    columns replace the rows' peak memory; the JSON and the page's section are written again."""
    import shutil
    import tempfile

    from ..harness.heap_peak import build_shim, preload_env
    from ..harness.report import write_json

    folder = Path(tempfile.mkdtemp(prefix="fsdp-memory-"))  # private (0700): the rows, the shim, the parts
    try:
        rows_path = args.json or str(folder / "rows.json")
        timed = _without(argv, "--readme") + ([] if args.json else ["--json", rows_path])
        code = here_or_relaunched("benchmarks.studies.fsdp_compare", timed, args.nproc, COMMAND_ENV,
                                  lambda: 0, net=args.net)
        if code != 0 or not Path(rows_path).exists():
            return code or 1
        rows = json.loads(Path(rows_path).read_text())
        env = preload_env(build_shim(folder) if args.device == "cpu" else None, {})
        for row in rows:
            part = folder / f"{row['mode']}.json"
            job = [*_without(_without(argv, "--readme"), "--json"), "--modes", row["mode"], "--job-memory",
                   row["mode"], "--job-part", str(part), "--steps", str(args.memory_rounds), "--warmup", "1"]
            old = dict(os.environ)
            os.environ.update(env)
            try:
                code = here_or_relaunched("benchmarks.studies.fsdp_compare", job, args.nproc, COMMAND_ENV,
                                          lambda: 0, net=args.net)
            finally:
                os.environ.clear()
                os.environ.update(old)
            if code != 0 or not part.exists():
                print(f"fsdp_compare: the memory job of {row['mode']} failed (exit {code}); its row keeps the "
                      "timed job's memory columns", file=sys.stderr)
                continue
            row["peak_mem_shared"] = row.get("peak_mem_mib_per_rank")
            row.update(json.loads(part.read_text()))
        write_json(rows, rows_path)
        print(format_table(rows), flush=True)
        if args.readme:
            update_readme([rows], args.readme, [args.json] if args.json else ())
            print(f"updated {args.readme}")
        return 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag v`` or ``--flag=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
