"""The three padding strategies for variable-length batches, side by side, through
the real launcher (``launch.train``) on skewed sequence lengths.

    python -m benchmarks.studies.padding_compare --quick                  # aot_eager smoke, ~1-2 min on 2 CPU cores
    python -m benchmarks.studies.padding_compare --readme docs/benchmarks/padding.md   # inductor, the docs table

Note [Padding benchmark]

Background
    Padding every batch to the maximum length compiles once and wastes compute
    on padding; padding to the batch's longest wastes little and, naively,
    recompiles all the time. ``data.padding=multiple`` and ``dynamic`` sit in
    between (Note [Padding strategies] in ``launch.data.batching``).

Algorithm
    Each (round, strategy) is one fresh ``python -m launch.train`` process (or
    ``torchrun`` with ``--nproc > 1``) with its own empty inductor cache, so
    every strategy pays its full compile, and dynamo's per-code caches of one
    strategy cannot leak into another's counts. The strategies run in rotating
    order round after round (``max, multiple, dynamic``, then ``multiple,
    dynamic, max``, ...) so slow drift of the machine hits them alike. Every run
    uses the same model, seed, data and skewed lengths and
    ``train.no_recompile_after_warmup=true``: compile time is the warm-up pass
    (every graph), and a recompile after it would fail the run. The launcher's
    ``metrics.json`` gives real tokens/s (non-padding tokens over the steps
    after the first), tokens/s with padding, the padding waste, graph and
    recompile counts; the table shows medians over rounds.

Notes
    - Results: ``benchmarks/results/padding_compare.json`` (``--json``; a
      ``--quick`` run writes ``bench_out/padding_compare_quick.json``);
      ``--readme FILE`` rewrites FILE's ``bench:padding`` section
      (``padding_markdown``); ``--render`` re-renders it from an existing JSON
      without running anything.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from launch.models import GPTConfig

from ..harness.cli import add_docs_args, new_parser, readme_after_run, render_only
from ..harness.report import DocsBlock, fmt, markdown_table, print0, write_json
from ..harness.rounds import interleaved_rounds
from ..harness.torchrun import run_main_job

__all__ = ["main", "parse_args", "run_strategy", "summarize", "padding_markdown", "update_padding_section",
           "STRATEGIES", "START", "END"]

START = "<!-- bench:padding:start -->"
END = "<!-- bench:padding:end -->"

STRATEGIES = ("max", "multiple", "dynamic")
DEFAULT_JSON = "benchmarks/results/padding_compare.json"
QUICK_JSON = "bench_out/padding_compare_quick.json"  # a smoke run never overwrites the real results
# FULL: the launcher's default model (launch.models.GPTConfig's sizes) at a longer sequence.
FULL = dict(backend="inductor", n_layer=GPTConfig.n_layer, n_embd=GPTConfig.n_embd, n_head=GPTConfig.n_head,
            seq_len=128, batch_size=16, pad_multiple=32, steps=30, rounds=2)
QUICK = dict(backend="aot_eager", n_layer=2, n_embd=64, n_head=2, seq_len=64, batch_size=8, pad_multiple=16,
             steps=6, rounds=1)
KEYS = ("real_tokens_per_s", "tokens_per_s", "padding_waste", "warmup_s", "first_step_s", "median_step_ms",
        "graphs", "recompiles", "recompiles_after_warmup", "final_loss")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = new_parser("benchmarks.studies.padding_compare", __doc__, f"smoke settings {QUICK}")
    for key, value in FULL.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None, help=f"default {value}")
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (>1: torchrun --standalone)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset of max,multiple,dynamic")
    p.add_argument("--json", default=None,
                   help=f"write the result here (default {DEFAULT_JSON}; with --quick {QUICK_JSON})")
    add_docs_args(p, BLOCK, switch=True)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before it counts as hung")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.json is None:
        args.json = QUICK_JSON if args.quick else DEFAULT_JSON
    args.strategies = [s for s in args.strategies.split(",") if s]
    bad = [s for s in args.strategies if s not in STRATEGIES]
    if bad:
        p.error(f"--strategies: {bad[0]!r} is not one of {', '.join(STRATEGIES)} (the values of data.padding). "
                "Pass a comma-separated subset, e.g. --strategies max,dynamic, or leave it out for all three.")
    return args


def _overrides(args: argparse.Namespace, padding: str, run_dir: Path) -> list[str]:
    return [
        f"compile={args.backend if args.backend in ('aot_eager', 'inductor') else 'aot_eager'}",
        f"compile.backend={args.backend}",
        f"model.n_layer={args.n_layer}", f"model.n_embd={args.n_embd}", f"model.n_head={args.n_head}",
        f"model.block_size={args.seq_len}", f"train.seq_len={args.seq_len}", f"train.batch_size={args.batch_size}",
        f"train.steps={args.steps}", f"train.log_interval={max(args.steps, 1)}",
        "data.lengths=skewed", f"data.padding={padding}", f"data.pad_multiple={args.pad_multiple}",
        "train.no_recompile_after_warmup=true", f"train.checkpoint_dir={run_dir / 'ckpt'}",
    ]


def run_strategy(args: argparse.Namespace, padding: str, work: Path, tag: str) -> dict[str, Any]:
    """One fresh launcher process (fresh inductor cache) for ``padding``; its metrics.json."""
    run_dir = work / f"{tag}_{padding}"
    print0(f"[padding_compare] {tag} {padding}: {run_dir}")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(run_dir / "inductor_cache"))  # a fresh Inductor cache
    metrics, _ = run_main_job(_overrides(args, padding, run_dir), run_dir, nproc=args.nproc, env=env,
                              timeout=args.timeout, what=f"padding={padding} ({tag})")
    return metrics


def summarize(padding: str, runs: list[dict[str, Any]], pad_multiple: int) -> dict[str, Any]:
    """One table row: medians over rounds (counts from the first round, which all rounds must match)."""
    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    counts = {k: runs[0].get(k) for k in ("graphs", "recompiles", "recompiles_after_warmup")}
    for r in runs[1:]:
        if any(r.get(k) != v for k, v in counts.items()):
            counts["note"] = "counts differ between rounds: " + str([[r.get(k) for k in counts] for r in runs])
    return {
        "padding": padding, "pad_multiple": pad_multiple,
        **{k: med(k) for k in ("real_tokens_per_s", "tokens_per_s", "padding_waste", "median_step_ms",
                               "first_step_s", "final_loss")},
        "compile_s": med("warmup_s"),
        **counts,
        "shapes_seen": len(runs[0].get("shapes_seen") or []),
        "per_round": [{k: r.get(k) for k in KEYS} for r in runs],
    }


def padding_markdown(result: dict) -> str:
    """The ``bench:padding`` section: one table line per padding strategy."""
    headers = ["padding", "real tokens/s", "tokens/s incl. padding", "padding waste", "compile s (warm-up)", "graphs",
               "recompiles", "after warm-up", "shapes seen", "median step ms", "final loss"]
    table = markdown_table(headers, [[
        r["padding"] + (f" ({r['pad_multiple']})" if r["padding"] == "multiple" else ""),
        fmt(r.get("real_tokens_per_s"), ",.0f"), fmt(r.get("tokens_per_s"), ",.0f"),
        fmt(100 * r["padding_waste"] if r.get("padding_waste") is not None else None, ".1f") + "%",
        fmt(r.get("compile_s"), ".1f"), fmt(r.get("graphs"), "d"), fmt(r.get("recompiles"), "d"),
        fmt(r.get("recompiles_after_warmup"), "d"), fmt(r.get("shapes_seen"), "d"),
        fmt(r.get("median_step_ms"), ".1f"), fmt(r.get("final_loss"), ".4f"),
    ] for r in result["rows"]])
    meta = result.get("meta", {})
    text = (
        f"Backend `{meta.get('backend', '?')}` on {meta.get('device', '?')}, {meta.get('nproc', '?')} rank(s), "
        f"`{meta.get('model', '?')}`, global batch {meta.get('batch_size', '?')} x seq_len {meta.get('seq_len', '?')}, "
        f"skewed lengths (log-normal around seq_len/8), {meta.get('steps', '?')} steps per run, "
        f"{meta.get('rounds', '?')} round(s) with the strategies in rotating order, each run a fresh process "
        "and a fresh inductor cache; medians over rounds. Every run warms up first "
        "(`train.no_recompile_after_warmup=true`): compile s = the warm-up pass (all graphs); real tokens/s "
        "counts only non-padding tokens, over the steps after the first. "
        "Generated by `python -m benchmarks.studies.padding_compare` (`--render` re-renders from the JSON)."
    )
    parts = [text]
    if meta.get("command"):
        parts.append(f"Command: `{meta['command']}`")
    parts.append(table)
    return "\n\n".join(parts)


BLOCK = DocsBlock(START, END, padding_markdown, "docs/benchmarks/padding.md")
update_padding_section = BLOCK.write  # update_padding_section(result, page): the page's bench:padding block


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if render_only(args, BLOCK) is not None:
        return 0
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.strategies}
    with tempfile.TemporaryDirectory(prefix="padding_compare_") as tmp:
        for rnd, (order, _, _) in enumerate(interleaved_rounds(args.strategies, 0, args.rounds)):
            for padding in order:
                runs[padding].append(run_strategy(args, padding, Path(tmp), f"round{rnd}"))
    first = next(iter(runs.values()))[0]
    result = {
        "meta": {
            "backend": args.backend, "device": first.get("device"), "nproc": args.nproc,
            "model": f"gpt n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head}",
            "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps, "rounds": args.rounds,
            "command": shlex.join(["python", "-m", "benchmarks.studies.padding_compare", *(argv if argv is not None else sys.argv[1:])]),
        },
        "rows": [summarize(s, runs[s], args.pad_multiple) for s in args.strategies],
    }
    if args.json:
        write_json(result, args.json)
        print0(f"wrote {args.json}")
    print(padding_markdown(result))
    readme_after_run(args, BLOCK, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
