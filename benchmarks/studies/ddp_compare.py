"""Eager DDP vs PyTorch's splitter vs compiling without splitting vs ours, side by side
in one torchrun job, over a simulated inter-node link (see Note [Interleaved DDP
benchmark] in ``benchmarks.studies.ddp_bench`` and Note [Simulated link] in ``benchmarks.link.shaping``).

    python -m benchmarks.studies.ddp_compare --quick --json bench_out/quick.json
    python -m benchmarks.studies.ddp_compare --caps 1,4,25 --link 1ms,100MB/s --json bench_out/full.json
    python -m benchmarks.studies.ddp_compare --sweep --caps 1,4,25,auto --modes eager,builtin,ours --json bench_out/sweep.json
    python -m benchmarks.studies.ddp_compare --modes eager,nosplit,ours,regional --baseline nosplit --layers 8 --caps 25 --link none

Run outside torchrun, it relaunches itself under ``torch.distributed.run
--standalone --nproc-per-node N``; rank 0 prints progress to stderr and the table
to stdout, and writes the JSON rows and the plot.

``--device auto`` (the default) runs on CUDA when ``torch.cuda.is_available()``,
else on the CPU over gloo. On CUDA each rank takes GPU ``LOCAL_RANK % GPUs``, over
NCCL when every rank has a GPU of its own and over gloo when ranks must share one
(rank 0 says which, and why); step times wait for the GPU and every row gets the
peak GPU memory of its mode (``peak_mib``; Note [Benchmark device] in
``benchmarks.harness.device``). ``--device cuda`` on a machine without CUDA stops before
launching anything (exit code 2).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from ..harness.cli import add_common_args, check_device, check_net, new_parser, fill_defaults, job_kwargs, process_group, publish
from ..harness.report import cap_label, fmt, print0, terminal_table, with_iqr
from ..harness.torchrun import here_or_relaunched

__all__ = ["main", "parse_args", "format_table", "ROW_KEYS"]

# The keys every row carries; rows carry more (IQRs, compute/comm, limit parts, ...).
ROW_KEYS = (
    "mode", "backend", "net", "link", "bucket_cap_mb", "step_ms_median", "ratio_vs_builtin", "ratio_vs_best_peer",
    "limit_ms", "step_over_limit", "overlap", "compile_s", "partitions", "loss_max_abs_diff",
)

COMMAND_ENV = "BENCH_DDP_COMMAND"  # the user's command line, handed to the workers by relaunch
QUICK = {"backend": "aot_eager", "warmup": 3, "steps": 8, "caps": "4"}


def _floats(text: str) -> tuple[float | str, ...]:
    try:
        values = tuple("auto" if v.strip() == "auto" else float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(v != "auto" and v <= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of positive MiB values (or auto, with --sweep): each is a "
            "DDP bucket_cap_mb to measure. Pass e.g. 1,4,25 or, with --sweep, 1,4,25,auto"
        )
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = new_parser("benchmarks.studies.ddp_compare", __doc__, "aot_eager, 3 warmup + 8 measured rounds, cap 4 MiB")
    p.add_argument("--modes", default="eager,builtin,nosplit,ours",
                   help="comma-separated modes: eager, builtin, nosplit, ours, regional (default: all but regional)")
    p.add_argument("--baseline", default=None,
                   help="the mode the ratio column divides by, round by round (default builtin)")
    p.add_argument("--link", default=None,
                   help="simulated link (a DDP comm hook): none, 1ms,1GB/s, 1ms,100MB/s or ALPHA,BANDWIDTH (default "
                        "1ms,100MB/s; none with --net shaped:RATE, where the link is real)")
    p.add_argument("--caps", type=_floats, default=None,
                   help="DDP bucket_cap_mb values to sweep (default 1,4,25); auto = compile_ddp's cost-model plan "
                        "(needs --sweep)")
    p.add_argument("--sweep", action="store_true",
                   help="measure every (mode, cap) pair in ONE interleaved phase (benchmarks.studies.sweep), no warm-compile "
                        "phase; eager/nosplit run once at cap 25")
    p.add_argument("--keep-grads", action="store_true",
                   help="zero the gradients in place between steps (zero_grad(set_to_none=False), as launch does with "
                        "a compiled optimizer), so every backward adds to existing gradients (default: set to None)")
    p.add_argument("--steps", type=int, default=None, help="measured rounds per cap (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured rounds per cap (default 3)")
    add_common_args(p, layers=4, embd=256, plot_help="PNG of step time vs cap",
                    embd_help="model width (default 256: ~12.6 MiB of gradients, enough link time to overlap)")
    p.add_argument("--cache-root", default=None, help="where fresh inductor cache dirs are made (default: tmp)")
    args = p.parse_args(argv)
    defaults = {"backend": "inductor", "warmup": 3, "steps": 10, "caps": "1,4,25"}
    fill_defaults(args, QUICK if args.quick else defaults,
                  lambda key, value: _floats(value) if key == "caps" else value)
    check_net(p, args)
    if args.link is None:
        args.link = "none" if args.net != "local" else "1ms,100MB/s"
    elif args.net != "local" and args.link.strip().lower() != "none":
        p.error(f"--net {args.net} and --link {args.link} are two links at once: over a shaped network every bucket "
                "already pays the real link, and the simulated one would delay the modes that use DDP's reducer "
                "twice. Drop --link (or pass --link none) with --net, or use --net local with --link.")
    return check_device(p, args)


HEADERS = ["cap MiB", "mode", "step ms", "vs builtin [IQR]", "vs best peer", "step/limit", "compute ms", "comm ms", "exposed ms", "pred exp ms",
           "overlap", "align", "cold s", "warm s", "warm aot h/m/b", "parts", "buckets", "recomp", "peak MiB",
           "loss diff"]


def _cells(r: dict) -> list:
    ratio = with_iqr(r["ratio_vs_builtin"], r.get("ratio_q1"), r.get("ratio_q3"))
    if r.get("ratio_q1") is not None and r.get("ratio_baseline") and r["ratio_baseline"] != "builtin":
        ratio += f" vs {r['ratio_baseline']}"
    return [
        cap_label(r["bucket_cap_mb"]), r["mode"], fmt(r["step_ms_median"], ".1f"), ratio,
        fmt(r.get("ratio_vs_best_peer"), ".3f"), fmt(r.get("step_over_limit"), ".2f"), fmt(r["compute_ms"], ".1f"),
        fmt(r["comm_ms"], ".1f"), fmt(r["exposed_comm_ms"], ".1f"), fmt(r.get("predicted_exposed_comm_ms"), ".1f"),
        fmt(r["overlap"], ".2f"), fmt(r.get("alignment"), ".2f"), fmt(r["compile_cold_s"], ".1f"),
        fmt(r["compile_warm_s"], ".1f"), _cache_cell(r.get("warm_cache")), fmt(r["partitions"], "d"), r["ddp_buckets"],
        r["recompiles"], fmt(r.get("peak_mib"), ".0f"), fmt(r["loss_max_abs_diff"], ".1e"),
    ]


def format_table(rows: Sequence[dict]) -> str:
    """The rows as a terminal table (the docs' comes from ``benchmarks.render.readme_results``)."""
    return terminal_table(HEADERS, [_cells(r) for r in rows])


def _cache_cell(events: dict | None) -> str:
    if not events or not any(events.values()):
        return "-"
    return f"{events['aot_hit']}/{events['aot_miss']}/{events['aot_bypass']}"


def _config(args: argparse.Namespace):
    """The ``ddp_bench.BenchConfig`` of the flags; raises ValueError on a bad link or mode."""
    from .ddp_bench import BenchConfig
    from ..link.shaping import parse_link

    return BenchConfig(**job_kwargs(args), link=parse_link(args.link), net=args.net, caps=args.caps,
                       cache_root=args.cache_root, sweep=args.sweep, baseline=args.baseline,
                       keep_grads=args.keep_grads)


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from .ddp_bench import run_cap
    from ..link.shaping import SimulatedLink
    from .modes_ddp import DDP_MODES
    from ..harness.plot import plot_rows
    from .sweep import format_summary, run_sweep, sweep_summary

    cfg = _config(args)
    with process_group(cfg.device, "ddp_compare"):
        link = SimulatedLink(cfg.link)
        print0(f"ddp_compare: {dist.get_world_size()} ranks over {dist.get_backend()}, backend {cfg.backend}, "
               f"net {args.net}, link {cfg.link.label}, caps {list(cfg.caps)}, {cfg.warmup} warmup + {cfg.rounds} measured rounds, "
               f"modes {list(cfg.modes)}")
        print0(DDP_MODES.describe(cfg.modes))
        t0 = time.perf_counter()
        rows = run_sweep(cfg, link) if cfg.sweep else [row for cap in cfg.caps for row in run_cap(cfg, cap, link)]
        if dist.get_rank() == 0:
            print(format_table(rows), flush=True)
            summary = format_summary(sweep_summary(rows)) if cfg.sweep else ""
            if summary:
                print("\n" + summary, flush=True)
            print0(f"ddp_compare: done in {time.perf_counter() - t0:.0f} s. compile s = first step minus median step; "
                   "cold = fresh inductor cache dir, warm = dynamo reset + same cache dir, same process.")
            publish(rows, args, module="benchmarks.studies.ddp_compare", command_env=COMMAND_ENV,
                    plot=lambda path: plot_rows(rows, path))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    _config(args)  # fail before launching anything
    return here_or_relaunched("benchmarks.studies.ddp_compare", argv, args.nproc, COMMAND_ENV, lambda: _worker(args),
                              net=args.net)


if __name__ == "__main__":
    raise SystemExit(main())
