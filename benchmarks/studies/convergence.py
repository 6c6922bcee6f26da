"""Does a compressed gradient reduction train as well as fp32? The main job's loss over
300 steps on 2 ranks, with the gradients all-reduced in fp32, in bf16 and through PowerSGD,
on a real token file: this repository's own text.

    python -m benchmarks.studies.convergence                          # 300 steps per run; the docs table and plot
    python -m benchmarks.studies.convergence --quick                  # 30 steps, a smoke run (bench_out/)
    python -m benchmarks.studies.convergence --render --readme docs/compression.md   # re-render block and plot from the JSON

Note [Convergence benchmark]

Background
    A bf16 all-reduce rounds each rank's gradient to 8 bits of mantissa (Note
    [Reduced-precision all-reduce]); parity tests show the rounding, not what it does to
    training. The question is whether the loss curve stays where fp32's is, and "where"
    needs a yardstick.

Algorithm
    - Data: every ``.py`` and ``.md`` file of the repository's packages, docs and README,
      concatenated in sorted order and made a byte-level token file by
      ``python -m launch.prepare_data`` (vocabulary 256); the last 10% is held out.
    - Runs: the main job under torchrun, 2 ranks, the same model, data order and seed,
      ``ddp.reduce_dtype=fp32`` and ``bf16``; and fp32 again with another ``train.seed``
      (another initialisation and other batches): how far two equally good fp32 runs land
      apart. That distance is the tolerance: bf16 counts as equal where its gap to fp32
      is within the seed-to-seed gap, or within 1% (the bf16 bound), whichever is larger.
    - PowerSGD: ``ddp.compression=powersgd:4:W``, rank 4 from the end of the warm-up W (the
      first 10% of the steps; PyTorch's advice: no earlier than the warm-up). It is held to
      the PowerSGD bound of 3%, or the seed-to-seed gap where that is larger.
    - Measured per run: the final training loss, the mean of the last 50 steps' losses, and
      the held-out loss at the end (``train.eval_every``).

Notes
    - Results: ``benchmarks/results/convergence.json`` and ``convergence.png``; the block in
      ``docs/compression.md`` is rendered from the JSON (``benchmarks.render.pages``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ..harness.cli import add_docs_args, new_parser, readme_after_run, render_only
from ..harness.plot import plot_losses
from ..harness.report import DocsBlock, fmt, markdown_table, print0, write_json
from ..harness.torchrun import run_main_job

__all__ = ["RUNS", "START", "END", "corpus_text", "main", "parse_args", "results_markdown", "summarize"]

START = "<!-- bench:convergence:start -->"
END = "<!-- bench:convergence:end -->"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_JSON = "benchmarks/results/convergence.json"
DEFAULT_PLOT = "benchmarks/results/convergence.png"
QUICK_JSON = "bench_out/convergence_quick.json"
# (label, overrides beside the common ones): the compressed runs and their two fp32 yardsticks; {warmup}
# is the run's warm-up steps.
RUNS = (("fp32", ["ddp.reduce_dtype=fp32"]), ("bf16", ["ddp.reduce_dtype=bf16"]),
        ("fp32, another seed", ["ddp.reduce_dtype=fp32", "train.seed=4242"]),
        ("PowerSGD rank 4", ["ddp.compression=powersgd:4:{warmup}"]))
POWERSGD_BOUND = 0.03  # compression goal: PowerSGD's mean loss over the last 50 steps within 3% of fp32's
FULL = dict(steps=300, batch_size=16, seq_len=64, backend="aot_eager", last=50)
QUICK = dict(steps=30, batch_size=8, seq_len=32, backend="aot_eager", last=10)
# nanoGPT's recipe, scaled to the run: warm-up, cosine decay, gradients clipped at norm 1. With the job's
# constant 3e-3 the loss spiked (to 10.2 at step 14 of a 30-step fp32 smoke run), in fp32 and bf16 alike.
SCHEDULE = ("train.lr=1e-3", "train.lr_schedule=cosine", "train.min_lr=1e-4", "train.max_grad_norm=1.0")
SOURCES = ("README.md", "docs", "compiler", "ddp_opt", "fsdp_opt", "launch", "benchmarks")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = new_parser("benchmarks.studies.convergence", __doc__, f"smoke settings {QUICK}")
    for key, value in FULL.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None, help=f"default {value}")
    p.add_argument("--json", default=None, help=f"the result (default {DEFAULT_JSON}; with --quick {QUICK_JSON})")
    p.add_argument("--plot", default=None, help=f"the loss curves (default {DEFAULT_PLOT}; none with --quick)")
    add_docs_args(p, BLOCK, switch=True, render_help="only re-render --readme and --plot from --json; run nothing")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before it counts as hung")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.json is None:
        args.json = QUICK_JSON if args.quick else DEFAULT_JSON
    if args.plot is None and not args.quick:
        args.plot = DEFAULT_PLOT
    if args.last >= args.steps:
        p.error(f"--last {args.last} must be below --steps {args.steps}: it is how many final steps are averaged.")
    return args


def corpus_text(root: Path = ROOT) -> str:
    """This repository's own text: every .py and .md file under ``SOURCES``, in sorted order."""
    parts = []
    for name in SOURCES:
        path = root / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in (".py", ".md"))
        parts.extend(f.read_text(encoding="utf-8", errors="replace") for f in files)
    return "\n".join(parts)


def _warmup(args: argparse.Namespace) -> int:
    return max(args.steps // 10, 1)


def _overrides(args: argparse.Namespace, tokens: Path, run_dir: Path, extra: Sequence[str]) -> list[str]:
    return [
        f"compile={args.backend}", "data=tokens", f"data.path={tokens}", "model.vocab_size=256",
        f"model.block_size={args.seq_len}", f"train.seq_len={args.seq_len}", f"train.batch_size={args.batch_size}",
        f"train.steps={args.steps}", f"train.warmup_steps={_warmup(args)}",
        f"train.log_interval={max(args.steps // 10, 1)}",
        f"train.eval_every={args.steps}", f"train.checkpoint_dir={run_dir / 'ckpt'}", *SCHEDULE,
        *(e.format(warmup=_warmup(args)) for e in extra),
    ]


def summarize(label: str, metrics: dict[str, Any], last: int) -> dict[str, Any]:
    """One run's row: its curve and the numbers the table shows."""
    losses = [float(loss) for _, loss in metrics["losses"]]
    evals = metrics.get("eval_losses") or []
    return {"run": label, "final_loss": losses[-1], "mean_last": sum(losses[-last:]) / last,
            "eval_loss": float(evals[-1][1]) if evals else None, "losses": losses}


def results_markdown(result: dict) -> str:
    """The ``bench:convergence`` block: one row per run, the gaps to fp32 and the tolerance."""
    meta, rows = result["meta"], result["rows"]
    base = rows[0]
    last = meta["last"]

    def gap(r: dict, key: str) -> str:
        return "" if r is base or base[key] is None or r[key] is None else f"{100 * (r[key] / base[key] - 1):+.2f}%"

    table = markdown_table(
        ["run", "final loss", f"mean of last {last}", "vs fp32", "held-out loss", "vs fp32"],
        [[r["run"], fmt(r["final_loss"], ".4f"), fmt(r["mean_last"], ".4f"), gap(r, "mean_last"),
          fmt(r["eval_loss"], ".4f"), gap(r, "eval_loss")] for r in rows])
    verdict = result["verdict"]
    text = (
        f"`{meta['model']}`, 2 gloo ranks, backend `{meta['backend']}`, {meta['steps']} steps, global batch "
        f"{meta['batch_size']} x {meta['seq_len']} byte tokens of this repository's own text "
        f"({meta['tokens']:,} tokens, the last 10% held out), torch {meta['torch']}. Tolerance: the larger of the "
        f"seed-to-seed gap of two fp32 runs ({100 * verdict['seed_gap']:.2f}% on the mean of the last {last}) and "
        f"1%; bf16's gap is {100 * verdict['bf16_gap']:.2f}%: "
        + ("**equal within it**." if verdict["equal"] else "**outside it**.")
        + _powersgd_sentence(verdict)
        + " Generated by `python -m benchmarks.studies.convergence` (`--render` re-renders from the JSON).")
    parts = [text, f"Command: `{meta['command']}`", table]
    if meta.get("plot"):  # docs/compression.md; the site serves benchmarks/results/ (tools/mkdocs_hooks.py)
        parts.append(f"![loss curves of fp32, bf16 and PowerSGD](benchmarks/results/{meta['plot']})")
    return "\n\n".join(parts)


def _powersgd_sentence(verdict: dict) -> str:
    if verdict.get("powersgd_gap") is None:
        return ""
    bound = verdict["powersgd_tolerance"]
    return (f" PowerSGD (rank 4, from the end of the warm-up) is held to the larger of the seed-to-seed gap and "
            f"{100 * POWERSGD_BOUND:.0f}% ({100 * bound:.2f}%); its gap is {100 * verdict['powersgd_gap']:.2f}%: "
            + ("**within it**." if verdict["powersgd_equal"] else "**outside it**."))


def _verdict(rows: list[dict]) -> dict[str, Any]:
    mean = {r["run"]: r["mean_last"] for r in rows}
    fp32 = mean["fp32"]
    seed_gap, bf16_gap = abs(mean["fp32, another seed"] / fp32 - 1), abs(mean["bf16"] / fp32 - 1)
    out = {"seed_gap": seed_gap, "bf16_gap": bf16_gap, "tolerance": max(seed_gap, 0.01),
           "equal": bf16_gap <= max(seed_gap, 0.01)}
    if "PowerSGD rank 4" in mean:
        gap, bound = mean["PowerSGD rank 4"] / fp32 - 1, max(seed_gap, POWERSGD_BOUND)
        out.update(powersgd_gap=gap, powersgd_tolerance=bound, powersgd_equal=abs(gap) <= bound)
    return out


BLOCK = DocsBlock(START, END, results_markdown, "docs/compression.md")


def _plot(result: dict, path: str) -> None:
    plot_losses([(r["run"], r["losses"]) for r in result["rows"]], path,
                f"{result['meta']['model'].split(' ')[0]}, 2 ranks: gradients reduced in fp32, bf16, PowerSGD")
    print0(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if (result := render_only(args, BLOCK)) is not None:
        if args.plot:
            _plot(result, args.plot)
        return 0
    import torch

    rows = []
    with tempfile.TemporaryDirectory(prefix="convergence_") as tmp:
        work = Path(tmp)
        (work / "input.txt").write_text(corpus_text(), encoding="utf-8")
        tokens = work / "tokens.bin"
        subprocess.run([sys.executable, "-m", "launch.prepare_data", str(work / "input.txt"), str(tokens)],
                       check=True, cwd=ROOT)
        count = json.loads(Path(f"{tokens}.json").read_text())["tokens"]
        for label, extra in RUNS:
            run_dir = work / label.replace(" ", "_").replace(",", "")
            print0(f"[convergence] {label}: {run_dir}")
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(run_dir / "inductor_cache"))
            metrics, _ = run_main_job(_overrides(args, tokens, run_dir, extra), run_dir, nproc=2, env=env,
                                      timeout=args.timeout, what=f"convergence {label}")
            rows.append(summarize(label, metrics, args.last))
    result = {
        "meta": {"model": "gpt_tiny (4 layers, 128 wide)", "backend": args.backend, "steps": args.steps,
                 "batch_size": args.batch_size, "seq_len": args.seq_len, "last": args.last, "tokens": count,
                 "torch": torch.__version__, "plot": Path(args.plot).name if args.plot else None,
                 "command": shlex.join(["python", "-m", "benchmarks.studies.convergence",
                                        *(argv if argv is not None else sys.argv[1:])])},
        "rows": rows,
        "verdict": _verdict(rows),
    }
    write_json(result, args.json)
    print0(f"wrote {args.json}")
    if args.plot:
        _plot(result, args.plot)
    print(results_markdown(result))
    readme_after_run(args, BLOCK, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
