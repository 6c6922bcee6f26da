"""Eager DDP vs PyTorch's splitter vs compiling without splitting vs ours, side by side
in one torchrun job, over a simulated inter-node link (see Note [Interleaved DDP
benchmark] in ``benchmarks.ddp_bench`` and Note [Simulated link] in ``benchmarks.link``).

    python -m benchmarks.ddp_compare --quick --json bench_out/quick.json
    python -m benchmarks.ddp_compare --caps 1,4,25 --link 1ms,100MB/s --json bench_out/full.json
    python -m benchmarks.ddp_compare --sweep --caps 1,4,25,auto --modes eager,builtin,ours --json bench_out/sweep.json
    python -m benchmarks.ddp_compare --modes eager,nosplit,ours,regional --baseline nosplit --layers 8 --caps 25 --link none

Run outside torchrun, it relaunches itself under ``torch.distributed.run
--standalone --nproc-per-node N``; rank 0 prints progress to stderr and the table
to stdout, and writes the JSON rows and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

from .cli import add_common_args, fill_defaults
from .report import cap_label, fmt, terminal_table, with_iqr
from .torchrun import inside_torchrun, relaunch

__all__ = ["main", "parse_args", "format_table", "ROW_KEYS"]

# The keys issue #4 asks for; rows carry more (IQRs, compute/comm, recompiles, ...).
ROW_KEYS = (
    "mode", "backend", "link", "bucket_cap_mb", "step_ms_median", "ratio_vs_builtin",
    "overlap", "compile_s", "partitions", "loss_max_abs_diff",
)

QUICK = {"backend": "aot_eager", "warmup": 3, "steps": 8, "caps": "4"}


def _floats(text: str) -> tuple[float | str, ...]:
    try:
        values = tuple("auto" if v.strip() == "auto" else float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(v != "auto" and v <= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of positive MiB values (or auto, with --sweep), e.g. 1,4,25,auto"
        )
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ddp_compare", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="aot_eager, 3 warmup + 8 measured rounds, cap 4 MiB (flags given explicitly still win)")
    p.add_argument("--modes", default="eager,builtin,nosplit,ours",
                   help="comma-separated modes: eager, builtin, nosplit, ours, regional (default: all but regional)")
    p.add_argument("--baseline", default=None,
                   help="the mode the ratio column divides by, round by round (default builtin)")
    p.add_argument("--link", default="1ms,100MB/s",
                   help="simulated link: none, 1ms,1GB/s, 1ms,100MB/s or ALPHA,BANDWIDTH (default 1ms,100MB/s)")
    p.add_argument("--caps", type=_floats, default=None,
                   help="DDP bucket_cap_mb values to sweep (default 1,4,25); auto = compile_ddp's cost-model plan "
                        "(needs --sweep)")
    p.add_argument("--sweep", action="store_true",
                   help="measure every (mode, cap) pair in ONE interleaved phase (benchmarks.sweep), no warm-compile "
                        "phase; eager/nosplit run once at cap 25")
    p.add_argument("--steps", type=int, default=None, help="measured rounds per cap (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured rounds per cap (default 3)")
    add_common_args(p, layers=4, embd=256, plot_help="PNG of step time vs cap",
                    embd_help="model width (default 256: ~12.6 MiB of gradients, enough link time to overlap)")
    p.add_argument("--cache-root", default=None, help="where fresh inductor cache dirs are made (default: tmp)")
    args = p.parse_args(argv)
    defaults = {"backend": "inductor", "warmup": 3, "steps": 10, "caps": "1,4,25"}
    return fill_defaults(args, QUICK if args.quick else defaults,
                         lambda key, value: _floats(value) if key == "caps" else value)


HEADERS = ["cap MiB", "mode", "step ms", "vs builtin [IQR]", "compute ms", "comm ms", "exposed ms", "pred exp ms",
           "overlap", "align", "cold s", "warm s", "warm aot h/m/b", "parts", "buckets", "recomp", "loss diff"]


def _cells(r: dict) -> list:
    ratio = with_iqr(r["ratio_vs_builtin"], r.get("ratio_q1"), r.get("ratio_q3"))
    if r.get("ratio_q1") is not None and r.get("ratio_baseline") and r["ratio_baseline"] != "builtin":
        ratio += f" vs {r['ratio_baseline']}"
    return [
        cap_label(r["bucket_cap_mb"]), r["mode"], fmt(r["step_ms_median"], ".1f"), ratio, fmt(r["compute_ms"], ".1f"),
        fmt(r["comm_ms"], ".1f"), fmt(r["exposed_comm_ms"], ".1f"), fmt(r.get("predicted_exposed_comm_ms"), ".1f"),
        fmt(r["overlap"], ".2f"), fmt(r.get("alignment"), ".2f"), fmt(r["compile_cold_s"], ".1f"),
        fmt(r["compile_warm_s"], ".1f"), _cache_cell(r.get("warm_cache")), fmt(r["partitions"], "d"), r["ddp_buckets"],
        r["recompiles"], fmt(r["loss_max_abs_diff"], ".1e"),
    ]


def format_table(rows: Sequence[dict]) -> str:
    """The rows as a terminal table (the README's comes from ``benchmarks.readme_results``)."""
    return terminal_table(HEADERS, [_cells(r) for r in rows])


def _cache_cell(events: dict | None) -> str:
    if not events or not any(events.values()):
        return "-"
    return f"{events['aot_hit']}/{events['aot_miss']}/{events['aot_bypass']}"


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from .ddp_bench import BenchConfig, run_cap
    from .link import SimulatedLink, parse_link
    from .report import print0

    cfg = BenchConfig(
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()), backend=args.backend,
        link=parse_link(args.link), caps=args.caps, warmup=args.warmup, rounds=args.steps, batch=args.batch,
        seq=args.seq, vocab=args.vocab, layers=args.layers, embd=args.embd, heads=args.heads, seed=args.seed,
        cache_root=args.cache_root, sweep=args.sweep, baseline=args.baseline,
    )
    dist.init_process_group("gloo")
    try:
        link = SimulatedLink(cfg.link)
        print0(f"ddp_compare: {dist.get_world_size()} ranks, backend {cfg.backend}, link {cfg.link.label}, "
               f"caps {list(cfg.caps)}, {cfg.warmup} warmup + {cfg.rounds} measured rounds, modes {list(cfg.modes)}")
        t0 = time.perf_counter()
        rows: list[dict] = []
        if cfg.sweep:
            from .sweep import run_sweep

            rows = run_sweep(cfg, link)
        else:
            for cap in cfg.caps:
                rows += run_cap(cfg, cap, link)
        if dist.get_rank() == 0:
            command = os.environ.get("BENCH_DDP_COMMAND", "python -m benchmarks.ddp_compare " + shlex.join(sys.argv[1:]))
            for row in rows:
                row["command"] = command
            print(format_table(rows), flush=True)
            if cfg.sweep:
                from .sweep import format_summary, sweep_summary

                summary = format_summary(sweep_summary(rows))
                if summary:
                    print("\n" + summary, flush=True)
            print0(f"ddp_compare: done in {time.perf_counter() - t0:.0f} s. compile s = first step minus median step; "
                   "cold = fresh inductor cache dir, warm = dynamo reset + same cache dir, same process.")
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(rows, indent=1))
                print0(f"wrote {args.json}")
            if args.plot:
                try:
                    import matplotlib  # noqa: F401
                except ImportError:
                    print0(f"not writing {args.plot}: matplotlib is not installed. Install the bench extra "
                           "(pip install -e .[bench]) or pass no --json/--plot to skip the plot.")
                else:
                    from .plot import plot_caps

                    title = f"{cfg.backend}, link {cfg.link.label}, {dist.get_world_size()} ranks"
                    plot_caps(rows, args.plot, title=title)
                    print0(f"wrote {args.plot}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from .link import parse_link

    parse_link(args.link)  # fail before launching anything
    if not inside_torchrun():
        return relaunch("benchmarks.ddp_compare", argv, args.nproc, "BENCH_DDP_COMMAND")
    return _worker(args)


if __name__ == "__main__":
    raise SystemExit(main())
