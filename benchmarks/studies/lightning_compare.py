"""Lightning's own compile idiom against ``CompiledDDPStrategy``, side by side on a shaped
link between two nodes (see Note [Lightning on a shaped link]).

    python -m benchmarks.studies.lightning_compare --link-mbit 200 --rounds 6 --out RESULTS/lightning_shaped_200mbit.json
    python -m benchmarks.studies.lightning_compare --render --out RESULTS/lightning_shaped_200mbit.json

(``RESULTS`` = ``benchmarks/results``.)
The first runs a 2-node torchrun job (one rank per node, each node in its own network
namespace, ``benchmarks.link.netns``; needs root and iproute2) and writes the JSON rows; the
second writes the docs block of ``docs/frameworks/lightning.md`` from them.

Note [Lightning on a shaped link]
---------------------------------
Background
    A Lightning user compiles with ``trainer.fit(torch.compile(model))`` under
    ``strategy="ddp"`` (Lightning's documented recipe); ours is one changed line,
    ``strategy=CompiledDDPStrategy(...)``. Both are measured the way users run them:
    through ``Trainer.fit``, over a real link every mode pays alike. Absolute times from
    separate runs mean nothing on the shared development machines (Note [Interleaved
    benchmark core] in ``benchmarks.harness.core``), so the modes share one job and take turns.

Algorithm
    1. Every mode gets its own LightningModule around the repository's GPT, built from
       the same seed (the same weights), and sees the same batches step by step.
    2. Rounds (``benchmarks.harness.rounds``): one warm-up round, then ``--rounds`` measured ones;
       each round runs one ``Trainer.fit`` per mode, the order rotating. Lightning does not
       spawn: the ranks are torchrun's, and the process group exists before the Trainer.
    3. Each fit starts as a restarted job would: ``torch.compiler.reset()`` before a
       compiled mode (the on-disk Inductor cache, private to the job, is warm after the
       warm-up round), then ``--fit-warmup`` unmeasured steps (compile, DDP's bucket
       rebuild, our realignment), then ``--steps`` measured steps.
    4. A Callback times each step on rank 0 with no barrier: ``on_train_batch_start`` to
       ``on_train_batch_end`` (forward, backward with DDP's all-reduces, optimizer step),
       split at ``on_before_backward`` and ``on_after_backward``.
    5. A fit's value is the median of its measured steps; a mode's ratio is the median
       over rounds of (its value / ``lightning_compile``'s value in the same round), with
       the IQR. ``step_ms_median`` pools every measured step of the mode.
    6. The compute of a step: a copy of the eager GPT, with no DDP and no communication,
       takes its turn in every round (``--steps`` plain steps after ``--fit-warmup``). The
       comm: after the rounds, one all-reduce of all the gradient bytes over the link, a
       barrier before each repeat (``benchmarks.harness.limit.measure_comm``). No bucketing carries
       the gradients faster than that one message, and overlap hides at most the backward.

Notes
    - ``lightning_compile``: ``torch.compile(module)`` before each fit and
      ``to_uncompiled`` after it, so every fit compiles as one user job does; PyTorch's
      splitter (DDPOptimizer) splits it at DDP's cap, 25 MiB, the default users run.
    - ``ours`` keeps DDP's default cap; ``ours_auto`` is ``bucket_cap_mb="auto"``, its
      link measured by ``compile_ddp`` over the same link.
    - This module imports neither torch nor Lightning, so ``--render`` and
      ``benchmarks.render.pages`` read the JSON only; the ranks run ``benchmarks.studies.lightning_fits``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from ..harness.cli import rendered_parser
from ..harness.report import DocsBlock
from .lightning_modes import BASELINE, COMMAND_ENV, MODES, LightningMode, format_table, mode_rows

log = logging.getLogger(__name__)

__all__ = ["LightningMode", "MODES", "BASELINE", "START", "END", "PAGE", "parse_args", "mode_rows", "format_table",
           "results_markdown", "render", "main"]

START = "<!-- bench:lightning:start -->"
END = "<!-- bench:lightning:end -->"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "frameworks" / "lightning.md"


def _modes(text: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in names if m not in MODES]
    if bad or BASELINE not in names:
        raise argparse.ArgumentTypeError(
            f"--modes {text!r}: {'unknown modes ' + str(bad) if bad else BASELINE + ' is missing'}, and every ratio "
            f"divides by {BASELINE} in the same round. Choose from {', '.join(MODES)}, {BASELINE} included, or leave "
            "--modes out to run all four.")
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = rendered_parser("benchmarks.studies.lightning_compare", __doc__, PAGE, START)
    p.add_argument("--link-mbit", type=float, default=200.0,
                   help="the shaped link between the two nodes, Mbit/s (default 200); 0 = this machine's loopback, "
                        "one node of two ranks (a quick check of the harness, not a result)")
    p.add_argument("--rounds", type=int, default=6, help="measured rounds, one fit per mode each (default 6)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per fit (default 20)")
    p.add_argument("--fit-warmup", type=int, default=3, help="unmeasured steps at the start of every fit (default 3)")
    p.add_argument("--modes", type=_modes, default=tuple(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--backend", default="inductor", help="dynamo backend of the compiled modes (default inductor)")
    p.add_argument("--layers", type=int, default=4, help="GPT blocks (default 4, as the DDP shaped sweeps)")
    p.add_argument("--embd", type=int, default=256, help="GPT width (default 256: ~12.6 MiB of gradients)")
    args = p.parse_args(argv)
    if not args.render and (args.rounds < 1 or args.steps < 1 or args.fit_warmup < 2):
        p.error(f"--rounds {args.rounds}, --steps {args.steps}, --fit-warmup {args.fit_warmup}: a result needs a "
                "measured round and step, and a fit's first two steps compile and rebuild DDP's buckets. Pass "
                "--rounds 1 or more, --steps 1 or more and --fit-warmup 2 or more.")
    return args


# --- the docs block (the rows and their table: lightning_modes) ---------------------------------------


def _load_text(r: dict) -> str:
    lo, hi = min(r["loadavg"]), max(r["loadavg"])
    busy = hi > r["cpus"]
    return (f"The machine was shared: its 1-minute load average read {lo:.1f} to {hi:.1f} on {r['cpus']} cores "
            "during the run (other jobs ran beside it), which the interleaving spreads over every mode alike; "
            "compare the ratios, not the absolute times." if busy else
            f"1-minute load average {lo:.1f} to {hi:.1f} on {r['cpus']} cores during the run.")


def results_markdown(rows: Sequence[dict]) -> str:
    """The docs block: how it was measured, the table, what the link and the compute cost, the command."""
    r0 = rows[0]
    comm = r0["comm_ms"]
    ours = [r for r in rows if r["mode"] in MODES and MODES[r["mode"]].ours]
    text = (
        f"Lightning {r0['lightning']}, torch {r0['torch']}, {r0['date']}, {r0['machine']}: two nodes of one rank "
        f"each, joined by a link shaped to {r0['link_mbit']:g} Mbit/s (network namespaces and `tc tbf`, "
        f"`benchmarks/link/netns.py`), gloo. {r0['model']}, {r0['grad_mib']:.1f} MiB of float32 gradients, "
        f"`{r0['backend']}`, SGD. Each mode trains through `Trainer(accelerator=\"cpu\", devices=1, num_nodes=2, "
        f"max_steps=...)`; a round runs one fit per mode, the order rotating, and {r0['rounds']} measured rounds "
        f"follow one warm-up round. Every fit starts as a restarted job (`torch.compiler.reset()`, Inductor's "
        f"on-disk cache warm), runs {r0['fit_warmup']} unmeasured steps, then {r0['steps']} steps timed by a "
        "Callback from `on_train_batch_start` to `on_train_batch_end` on rank 0. Ratio = median over rounds of "
        f"the mode's median step / `{BASELINE}`'s in the same round, IQR in brackets (below 1 is faster). "
        "fwd / bwd / opt split the step at `on_before_backward` and `on_after_backward` (bwd includes the wait "
        "for DDP's all-reduces). partitions: the pieces the compiled graph was split into (ours: one per bucket "
        "of `trainer.strategy.compiled.buckets`; `lightning_compile`: as PyTorch's splitter logged its split); "
        "alignment: `trainer.strategy.compiled.realignment.fraction`; loss diff = max over ranks and steps of "
        "|loss - `eager`'s|. "
        + _load_text(r0))
    parts = " + ".join(f"{k} {r0[f'compute_{k}_ms']:.0f}" for k in ("fwd", "bwd", "opt"))
    after = (
        f"The eager model's step with no DDP and no communication, timed in the same rounds, took "
        f"{r0['compute_ms']:.0f} ms ({parts}); one all-reduce of all {r0['grad_mib']:.1f} MiB over the link, timed "
        f"after the rounds, took {comm:.0f} ms. No bucketing carries the gradients faster than that one all-reduce, "
        "and overlap can hide at most the backward's compute behind it.")
    if ours:
        after += " Buckets of ours: " + "; ".join(
            f"`{r['mode']}` {'/'.join(f'{m:.2f}' for m in r.get('bucket_mib') or [])} MiB" for r in ours) + "."
    table = format_table(rows)
    return "\n\n".join([text, table, after, f"Command: `{r0['command']}`",
                        "Generated by `python -m benchmarks.studies.lightning_compare --render --out "
                        "benchmarks/results/lightning_shaped_200mbit.json`."])


BLOCK = DocsBlock(START, END, results_markdown, "docs/frameworks/lightning.md")


def render(out: str | Path, page: str | Path = PAGE) -> str:
    """Rewrite ``page``'s Lightning block from the rows at ``out``; return the block."""
    return BLOCK.write_from_json(out, page)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.render:
        render(args.out, args.page)
        print(f"updated {args.page}")
        return 0
    from ..harness.torchrun import here_or_relaunched, inside_torchrun

    if not inside_torchrun():
        import importlib.util

        if importlib.util.find_spec("lightning") is None:
            raise SystemExit("benchmarks.studies.lightning_compare: the lightning package is not installed, and every mode "
                             "trains through Lightning's Trainer. Install it (pip install lightning), or run "
                             "benchmarks.studies.ddp_compare for the same comparison without Lightning.")
    net = f"shaped:{args.link_mbit:g}mbit" if args.link_mbit > 0 else "local"
    return here_or_relaunched("benchmarks.studies.lightning_compare", argv, 2, COMMAND_ENV, lambda: _run(args), net=net)


def _run(args: argparse.Namespace) -> int:
    from .lightning_fits import run_job  # torch and Lightning: only inside the ranks

    return run_job(args)


if __name__ == "__main__":
    raise SystemExit(main())
