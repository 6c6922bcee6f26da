"""Shared compile against every rank compiling: cold first steps of the main job.

Every run is a new ``torchrun ... -m launch.train`` job with an empty
TORCHINDUCTOR_CACHE_DIR of its own (cold: nothing compiled before), once with
``compile.share=true`` and once with ``compile.share=false``, in rotating order,
``--runs`` times for each rank count and Inductor-directory setting: one directory
for all ranks (one machine's default) or one per rank (``benchmarks.studies.rank_inductor``:
as ranks on separate machines have) (Note [Shared compile]). From each run's
``metrics.json``:

    first_step_s          rank 0's first step, compile included (the barrier makes
                          every rank leave the compile together)
    cpu_s_total           CPU seconds of every rank's process tree (child processes:
                          Inductor's compile workers, C++ builds), from process start
                          to the end of its first step, summed over ranks
    cpu_since_compile_s   the same from the moment the model is wrapped for compile
                          (compile_ddp or fsdp_opt.apply returned) to the end of the
                          first step: the tracing, compiling, loading and waiting of it

A third mode, ``one_rank`` (where torch has it, 2.14+), is PyTorch's own answer:
``compile.share=false`` with ``TORCH_COMPILE_ON_ONE_RANK=1``
(``torch.compiler.config.compile_on_one_rank``), which computes ranks and devices at run
time instead of baking them into the graphs, so that one compile can serve every rank.

Ratios are each mode over unshared per round (measured in the same round), the
median with its IQR. ``OMP_NUM_THREADS=1`` per rank, as torchrun sets it.

    python -m benchmarks.studies.compile_share                                 # the real run
    python -m benchmarks.studies.compile_share --quick                         # aot_eager smoke run
    python -m benchmarks.studies.compile_share --render benchmarks/results/compile_share.json docs/compile-time.md
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Sequence

from .._torch_internals import has_compile_on_one_rank
from ..harness.cli import add_docs_args, render_only
from ..harness.report import DocsBlock, fmt, markdown_table, with_iqr, write_result
from ..harness.rounds import interleaved_rounds
from ..harness.stats import median, ratio_summary
from ..harness.torchrun import job_env, run_main_job

__all__ = ["START", "END", "run_cold", "summarize", "results_markdown", "render", "main"]

START = "<!-- bench:share:start -->"
END = "<!-- bench:share:end -->"
MODES = ("shared", "unshared", "one_rank")
# What each mode sets: compile.share, and the environment of every rank.
MODE_SETTINGS = {"shared": (True, {}), "unshared": (False, {}),
                 "one_rank": (False, {"TORCH_COMPILE_ON_ONE_RANK": "1"})}
METRICS = ("first_step_s", "cpu_s_total", "cpu_since_compile_s")
QUICK_OVERRIDES = ["model.n_embd=32", "model.n_head=2", "train.batch_size=4", "train.seq_len=16"]


def run_cold(mode: str, nproc: int, run_dir: Path, *, backend: str, steps: int, extra: Sequence[str],
             inductor: str = "shared", timeout: float = 1800) -> dict:
    """One cold job: a new process group, empty Inductor cache directories (``inductor``:
    ``shared`` one for every rank, ``per_rank`` one each, as on separate machines)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    share, mode_env = MODE_SETTINGS[mode]
    overrides = [f"compile={backend}", f"train.steps={steps}", f"compile.share={str(share).lower()}", *extra]
    if inductor == "per_rank":
        env = job_env(DISTCOMPILE_INDUCTOR_BASE=str(run_dir / "inductor"), **mode_env)
        entry: tuple[str, ...] = ("benchmarks.studies.rank_inductor", "launch.train")
    else:
        env, entry = job_env(run_dir / "inductor", **mode_env), ("launch.train",)
    m, wall = run_main_job(overrides, run_dir / "run", nproc=nproc, env=env, timeout=timeout, entry=entry)
    stats = m["compile_stats"]
    row = {"mode": mode, "nproc": nproc, "inductor": inductor, "first_step_s": m["first_step_s"], "cpu_s_total": stats["cpu_s_total"],
           "cpu_since_compile_s": stats["cpu_since_compile_s_total"], "process_wall_s": wall,
           "partitions": len(m["partitions"]), "final_loss": m["final_loss"],
           "compiled": [r.get("compiled") for r in stats["ranks"]], "loaded": [r.get("loaded") for r in stats["ranks"]]}
    print(f"{nproc} ranks, {inductor} Inductor dir, {mode:>8}: first step {row['first_step_s']:.1f} s, CPU {row['cpu_s_total']:.1f} s "
          f"({row['cpu_since_compile_s']:.1f} s since compile_ddp), compiled {row['compiled']}, "
          f"loaded {row['loaded']}", flush=True)
    return row


def summarize(rows: Sequence[dict]) -> dict:
    """Per Inductor-directory setting and rank count (key ``shared/4``): each metric's
    median per mode, the shared/unshared per-round ratios (``ratio``, ``iqr``) and, where
    run, each other mode's (``one_rank_ratio``, ``one_rank_iqr``)."""
    out = {}
    for setting in dict.fromkeys((r.get("inductor", "shared"), r["nproc"]) for r in rows):
        by_mode = {mode: [r for r in rows if (r.get("inductor", "shared"), r["nproc"]) == setting
                          and r["mode"] == mode] for mode in MODES}
        entry = {}
        for metric in METRICS:
            unshared = [r[metric] for r in by_mode["unshared"]]
            e = entry[metric] = {"unshared": median(unshared)}
            for mode in (m for m in MODES if m != "unshared" and by_mode[m]):
                values = [r[metric] for r in by_mode[mode]]
                value, q1, q3 = ratio_summary(values, unshared)
                prefix = "" if mode == "shared" else f"{mode}_"
                e.update({mode: median(values), f"{prefix}ratio": value, f"{prefix}iqr": [q1, q3]})
        out[f"{setting[0]}/{setting[1]}"] = entry
    return out


DIRS = {"shared": "one for all ranks", "per_rank": "one per rank"}
TARGETS = {"first_step_s": "<= 0.5", "cpu_s_total": "-", "cpu_since_compile_s": "<= 0.35"}
LABELS = {"first_step_s": "first step s (rank 0)", "cpu_s_total": "CPU s, all ranks, process start to first step end",
          "cpu_since_compile_s": "CPU s, all ranks, compile_ddp to first step end"}


def results_markdown(result: dict) -> str:
    rows = []
    one_rank = any(r["mode"] == "one_rank" for r in result["rows"])
    for setting, entry in result["summary"].items():
        inductor, nproc = setting.split("/")
        for metric in METRICS:
            e = entry[metric]
            row = [nproc, DIRS[inductor], LABELS[metric], fmt(e["shared"], ".1f"), fmt(e["unshared"], ".1f")]
            if one_rank:
                row.append(fmt(e["one_rank"], ".1f"))
            row.append(with_iqr(e["ratio"], *e["iqr"], spec=".2f"))
            if one_rank:
                row.append(with_iqr(e["one_rank_ratio"], *e["one_rank_iqr"], spec=".2f"))
            rows.append([*row, TARGETS[metric]])
    parts = sorted({r["partitions"] for r in result["rows"]})
    head = ["ranks", "Inductor cache", "measure", "compile.share=true", "false"]
    head += ["false + compile_on_one_rank", "true / false", "one_rank / false"] if one_rank else ["true / false"]
    return "\n\n".join([
        f"Backend `{result['backend']}`, {result['steps']} steps per run, {result['runs']} run(s) per mode and setting, "
        f"modes in rotating order; every run is a new torchrun job with empty Inductor caches: one directory for "
        f"all ranks (one machine's default), or one per rank (as on separate machines) "
        f"({', '.join(map(str, parts))} partition(s) per rank). Ratios are each mode / compile.share=false per run "
        f"of one round, median [IQR]. Machine: {result['cpus']} CPU core(s); torch "
        f"{result.get('torch', 'not recorded (2.13 or older)')}."
        + (" `compile_on_one_rank` = PyTorch's `torch.compiler.config.compile_on_one_rank` "
           "(TORCH_COMPILE_ON_ONE_RANK=1) with compile.share=false." if one_rank else ""),
        f"Command: `{result['command']}`",
        markdown_table([*head, "target"], rows),
        "Generated by `python -m benchmarks.studies.compile_share --render` from the benchmark's JSON.",
    ])


BLOCK = DocsBlock(START, END, results_markdown, "docs/compile-time.md")
render = BLOCK.write_from_json  # render(json_path, page): the page's shared-compile block from the result JSON


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", default="2,4", help="comma-separated rank counts")
    p.add_argument("--runs", type=int, default=3, help="cold runs per mode and rank count")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--inductor", default="shared,per_rank",
                   help="Inductor cache directories: shared (one for every rank, the default of one machine), "
                        "per_rank (one each, as on separate machines); comma-separated")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated, from {', '.join(MODES)}; default: all that this torch has "
                        "(one_rank needs torch.compiler.config.compile_on_one_rank, torch 2.14+)")
    p.add_argument("--out", default="bench_out/compile_share", help="work directory (emptied per run)")
    p.add_argument("--json", default="benchmarks/results/compile_share.json")
    add_docs_args(p, BLOCK)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: aot_eager, 2 ranks, 1 run, one shared Inductor dir, a narrow model")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = p.parse_args(argv)
    if render_only(a, BLOCK) is not None:
        return 0
    extra = list(a.overrides)
    if a.quick:
        a.backend, a.nprocs, a.runs, a.inductor = "aot_eager", "2", 1, "shared"
        extra += QUICK_OVERRIDES
    try:
        nprocs = [int(n) for n in a.nprocs.split(",") if n]
    except ValueError:
        nprocs = []
    if not nprocs or min(nprocs) < 2 or a.runs < 1:
        p.error(f"--nprocs must list rank counts of 2 or more and --runs be >= 1, got {a.nprocs!r} and {a.runs}: "
                "sharing needs a second rank, and a ratio needs one run of each mode. Leave them out for 2,4 and 3.")
    settings = [s for s in a.inductor.split(",") if s]
    if not settings or set(settings) - set(DIRS):
        p.error(f"--inductor {a.inductor!r}: expected a comma-separated subset of {', '.join(DIRS)}.")
    modes = [m for m in (a.modes or ",".join(available_modes())).split(",") if m]
    if set(modes) - set(MODES) or not {"shared", "unshared"} <= set(modes):
        p.error(f"--modes {a.modes!r}: expected a comma-separated subset of {', '.join(MODES)} with shared and "
                "unshared in it (the ratios are against unshared).")
    if "one_rank" in modes and "one_rank" not in available_modes():
        p.error(f"--modes one_rank: this torch ({__import__('torch').__version__}) has no "
                "torch.compiler.config.compile_on_one_rank (torch 2.14+). Leave one_rank out.")
    rows = []
    for inductor in settings:
        for nproc in nprocs:
            for order, _, label in interleaved_rounds(modes, 0, a.runs):
                print(f"{nproc} ranks, {inductor} Inductor dir, {label}", flush=True)
                rows += [run_cold(mode, nproc, Path(a.out) / f"{nproc}_{mode}", backend=a.backend, steps=a.steps,
                                  extra=extra, inductor=inductor) for mode in order]
    result = {
        "command": shlex.join(["python", "-m", "benchmarks.studies.compile_share", *(argv if argv is not None else sys.argv[1:])]),
        "backend": a.backend, "steps": a.steps, "runs": a.runs, "cpus": os.cpu_count(), "rows": rows,
        "summary": summarize(rows), "torch": __import__("torch").__version__,
    }
    return write_result(result, a.json, a.readme, render)


def available_modes() -> list[str]:
    """The modes this torch can run: one_rank where it has compile_on_one_rank."""
    return [m for m in MODES if m != "one_rank" or has_compile_on_one_rank()]


if __name__ == "__main__":
    raise SystemExit(main())
