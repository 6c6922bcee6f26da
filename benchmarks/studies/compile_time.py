"""Compile time across restarts: cold and warm first steps of the main job, per mode.

Every run is a new ``torchrun ... -m launch.train`` process (a restart is a new
process), first with empty cache directories (cold), then again with the same
directories (warm), ``--warm-runs`` times per mode with the modes in rotating
order; the warm first step reported is the median. Each run's ``metrics.json`` gives ``first_step_s`` (forward,
backward and optimizer step of step 1, compile included) and the median step.

Modes (``--modes``):
    nosplit        compile_ddp(strategy='whole'): one graph, PyTorch's caches.
    ours           split at DDP's buckets, no cache_dir; Inductor's and
                   AOTAutograd's local caches (TORCHINDUCTOR_CACHE_DIR) warm.
    ours_cache     ours with compile.cache_dir and TORCHINDUCTOR_CACHE_DIR unset
                   (Inductor's local cache then lives under cache_dir too).
    ours_fresh     ours with compile.cache_dir; the warm run gets a *fresh*
                   TORCHINDUCTOR_CACHE_DIR, so only the cache_dir file serves it
                   (a restart on another machine; on CPU, Inductor's C++ kernels
                   are rebuilt from the cached source).
    whole8         the 8-block model compiled whole (ddp.strategy=whole).
    regional8      the 8-block model, ddp.strategy=regional (block compiled once).

Step time is not taken from these runs: each is a separate process, and on a
shared machine the same job's median step varies by tens of percent from one
process to the next. When whole8 and regional8 both run, the 8-block model's
step times come from one more job, ``benchmarks.studies.ddp_compare --modes
nosplit,ours,regional --baseline nosplit --link none`` on the same model and
batch, where the three compile the same weights in one process group and step
in turns (Note [Interleaved DDP benchmark]): the regional/whole ratio is the
median of per-round ratios, with its IQR. That job also times each mode's cold
compile in one process. A second such job runs on a wider model
(``--wide-embd``, default 256), where each compiled block does more work per
call and regional compile's fixed cost per block call weighs less
(Note [Regional compile]).

    python -m benchmarks.studies.compile_time                      # inductor, 2 ranks (the real run)
    python -m benchmarks.studies.compile_time --quick              # aot_eager smoke run
    python -m benchmarks.studies.compile_time --render benchmarks/results/compile_time.json docs/compile-time.md
    python -m benchmarks.studies.compile_time --modes ours_fresh --update --readme docs/compile-time.md
                                                           # re-measure one mode, keep the others' rows

The docs page's section between ``<!-- bench:compile:start -->`` and
``<!-- bench:compile:end -->`` is regenerated from the JSON (``--readme``/``--render``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from launch.models import GPTConfig

from ..harness.cli import add_docs_args, render_only
from ..harness.report import DocsBlock, fmt, markdown_table, with_iqr, write_result
from ..harness.rounds import interleaved_rounds
from ..harness.stats import median, ratio_summary
from ..harness.torchrun import job_env, run_checked, run_main_job

__all__ = ["MODES", "RestartMode", "START", "END", "run_mode", "run_restarts", "interleaved_steps", "summarize",
           "results_markdown", "render", "main"]

START = "<!-- bench:compile:start -->"
END = "<!-- bench:compile:end -->"


@dataclass(frozen=True)
class RestartMode:
    """One compile configuration of the main job, and where its caches live across restarts."""

    overrides: tuple[str, ...] = ()  # Hydra overrides
    cache_dir: bool = False  # compile.cache_dir in the mode's directory
    # TORCHINDUCTOR_CACHE_DIR: "shared" one dir for cold and warm, "unset" not set at all,
    # "fresh" a new empty dir for every warm run (another machine)
    inductor: str = "shared"

    def args(self, mode_dir: Path, backend: str, steps: int, extra: Sequence[str]) -> list[str]:
        """The launcher's Hydra overrides of a run."""
        args = [f"compile={backend}", f"train.steps={steps}", *self.overrides, *extra]
        if self.cache_dir:
            args.append(f"compile.cache_dir={mode_dir / 'cache'}")
        return args

    def inductor_dir(self, mode_dir: Path, phase: str, run: int) -> Path | None:
        """The run's TORCHINDUCTOR_CACHE_DIR (None: unset)."""
        if self.inductor == "unset":
            return None
        if self.inductor == "shared" or phase == "cold":
            return mode_dir / "inductor"
        fresh = mode_dir / f"inductor_warm{run}"  # every warm run on another "machine": an empty dir of its own
        shutil.rmtree(fresh, ignore_errors=True)
        return fresh


MODES: dict[str, RestartMode] = {
    "nosplit": RestartMode(("ddp.strategy=whole",)),
    "ours": RestartMode(),
    "ours_cache": RestartMode(cache_dir=True, inductor="unset"),
    "ours_fresh": RestartMode(cache_dir=True, inductor="fresh"),
    "whole8": RestartMode(("model.n_layer=8", "ddp.strategy=whole")),
    "regional8": RestartMode(("model.n_layer=8", "ddp.strategy=regional")),
}


def _run(overrides: Sequence[str], nproc: int, inductor_dir: Path | None, run_dir: Path, timeout: float) -> dict:
    """One job in a new process; its metrics.json plus the wall time of the whole process."""
    m, wall = run_main_job(overrides, run_dir, nproc=nproc, env=job_env(inductor_dir), timeout=timeout)
    return {"first_step_s": m["first_step_s"], "step_ms_median": m["median_step_ms"],
            "final_loss": m.get("final_loss"), "process_wall_s": wall}


def run_mode(mode: str, out: Path, *, backend: str, nproc: int, steps: int, extra: Sequence[str] = (),
             phase: str = "cold", run: int = 0, timeout: float = 1800) -> dict:
    """One run of ``mode``: ``cold`` empties ``out/mode`` first; ``warm`` (run ``run``)
    restarts on the directories the cold run filled."""
    spec, base = MODES[mode], out / mode
    if phase == "cold":
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
    row = _run(spec.args(base, backend, steps, extra), nproc, spec.inductor_dir(base, phase, run),
               base / f"run_{phase}{run if phase == 'warm' else ''}", timeout)
    row = {"mode": mode, "phase": phase, "run": run, **row}
    print(f"{mode:>10} {phase}{'' if phase == 'cold' else f' {run + 1}'}: first step {row['first_step_s']:.1f} s, "
          f"median step {row['step_ms_median']:.1f} ms, process {row['process_wall_s']:.1f} s", flush=True)
    return row


def run_restarts(modes: Sequence[str], out: Path, *, warm_runs: int, **kw) -> list[dict]:
    """Every mode cold, then ``warm_runs`` rounds of warm restarts, the modes in
    rotating order (``benchmarks.harness.rounds``), so a slow stretch of the machine does
    not land on one mode's only warm run."""
    rows = [run_mode(mode, out, phase="cold", **kw) for mode in modes]
    for run, (order, _, _) in enumerate(interleaved_rounds(list(modes), 0, warm_runs)):
        rows += [run_mode(mode, out, phase="warm", run=run, **kw) for mode in order]
    return rows


# --quick narrows the launcher's model for every run (a smoke run, not a measurement).
QUICK_OVERRIDES = ["model.n_embd=32", "model.n_head=2", "train.batch_size=2", "train.seq_len=16"]


def step_model(embd: int = GPTConfig.n_embd, heads: int = GPTConfig.n_head,
               seq: int = GPTConfig.block_size) -> list[str]:
    """The launcher's model (``launch.models.GPTConfig``'s sizes with n_layer=8) as
    ddp_compare flags, at width ``embd``."""
    return ["--layers", "8", "--embd", str(embd), "--heads", str(heads), "--vocab", str(GPTConfig.vocab_size),
            "--seq", str(seq)]


STEP_MODEL = step_model()
QUICK_STEP_MODEL = step_model(32, 2, 16)


def interleaved_steps(out: Path, *, backend: str, nproc: int, global_batch: int, rounds: int,
                      model: Sequence[str] = STEP_MODEL, name: str = "interleaved_steps",
                      timeout: float = 3600) -> list[dict]:
    """whole8 (nosplit, ours) and regional8 step times, measured in turns in one ddp_compare job."""
    json_path = out / f"{name}.json"
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.studies.ddp_compare", "--modes", "nosplit,ours,regional", "--baseline", "nosplit",
           "--link", "none", "--caps", "25", "--backend", backend, "--nproc", str(nproc),
           "--batch", str(max(global_batch // nproc, 1)), *model, "--steps", str(rounds), "--warmup", "3",
           "--json", str(json_path), "--plot", str(out / f"{name}.png")]
    print(f"interleaved step times: {shlex.join(cmd)}", flush=True)
    # ddp_compare gives every mode a fresh TORCHINDUCTOR_CACHE_DIR of its own
    proc = run_checked(cmd, env=job_env(), timeout=timeout, cwd=Path.cwd())
    print(proc.stdout, flush=True)
    return json.loads(json_path.read_text())


def _first_steps(rows: Sequence[dict]) -> dict[tuple[str, str], float]:
    """(mode, phase) -> first-step seconds: the cold run's, the median of the warm runs'."""
    runs: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        runs.setdefault((r["mode"], r["phase"]), []).append(r["first_step_s"])
    return {k: median(v) for k, v in runs.items()}


def summarize(rows: Sequence[dict], steps: Sequence[dict] = (), wide: Sequence[dict] = ()) -> dict:
    """The compile-time goal ratios from the restart rows and the interleaved step rows
    (``wide``: the same job on a wider model, keys ending ``_wide``; None where a
    mode or job was not run)."""
    first = _first_steps(rows)

    def ratio(a, b):
        if a in first and b in first and first[b]:
            return first[a] / first[b]
        return None

    return {
        "ours_warm_over_cold": ratio(("ours", "warm"), ("ours", "cold")),
        "ours_warm_over_nosplit_warm": ratio(("ours", "warm"), ("nosplit", "warm")),
        "ours_cache_warm_over_cold": ratio(("ours_cache", "warm"), ("ours_cache", "cold")),
        "ours_cache_warm_over_nosplit_warm": ratio(("ours_cache", "warm"), ("nosplit", "warm")),
        "ours_fresh_warm_over_cold": ratio(("ours_fresh", "warm"), ("ours_fresh", "cold")),
        "whole8_cold_over_regional8_cold": ratio(("whole8", "cold"), ("regional8", "cold")),
        **_step_ratios(steps),
        **_step_ratios(wide, "_wide"),
    }


def _step_ratios(steps: Sequence[dict], suffix: str = "") -> dict:
    """Regional against whole from one interleaved job: medians of per-round
    ratios with their IQRs, and the cold compiles in that one process."""
    by_mode = {r["mode"]: r for r in steps}
    regional, ours = by_mode.get("regional"), by_mode.get("ours")
    vs_ours = (None, None, None)
    if regional and ours:
        vs_ours = ratio_summary(regional["step_ms_rounds"], ours["step_ms_rounds"])
    return {
        f"regional8_step_over_whole8_step{suffix}": regional["ratio_vs_builtin"] if regional else None,
        f"regional8_step_over_whole8_step{suffix}_iqr": [regional["ratio_q1"], regional["ratio_q3"]] if regional else None,
        f"regional8_step_over_ours8_step{suffix}": vs_ours[0],
        f"regional8_step_over_ours8_step{suffix}_iqr": list(vs_ours[1:]) if regional and ours else None,
        f"whole8_cold_over_regional8_cold_one_process{suffix}": (
            by_mode["nosplit"]["compile_cold_s"] / regional["compile_cold_s"]
            if regional and "nosplit" in by_mode and regional["compile_cold_s"] else None),
    }


def _steps_markdown(steps: Sequence[dict]) -> str:
    return markdown_table(
        ["8 blocks, one job", "cold compile s", "median step ms", "step / nosplit [IQR]"],
        [[r["mode"], fmt(r["compile_cold_s"], ".1f"), fmt(r["step_ms_median"], ".1f"),
          f"{fmt(r['ratio_vs_builtin'], '.3f')} [{fmt(r['ratio_q1'], '.3f')}, {fmt(r['ratio_q3'], '.3f')}]"]
         for r in steps])


def _step_ratio_rows(s: dict) -> list[list[str]]:
    """Regional against both whole-model modes: the launcher-width job always, the
    wider one when it ran."""
    rows = []
    for suffix, job in (("", "interleaved"), ("_wide", "wider model")):
        for label, base in (("whole8 (nosplit)", "whole8"), ("ours8", "ours8")):
            key = f"regional8_step_over_{base}_step{suffix}"
            if suffix and s.get(key) is None:
                continue
            q1, q3 = s.get(key + "_iqr") or (None, None)
            rows.append([f"regional8 / {label} step, {job} [IQR]", with_iqr(s.get(key), q1, q3), "< 1.05"])
    return rows


def results_markdown(result: dict) -> str:
    """The docs page's section: one row per mode and phase, the interleaved 8-block step
    times, then the done-when ratios."""
    table = []
    for mode in dict.fromkeys(r["mode"] for r in result["rows"]):
        cold = [r for r in result["rows"] if r["mode"] == mode and r["phase"] == "cold"]
        warm = [r for r in result["rows"] if r["mode"] == mode and r["phase"] == "warm"]
        firsts = [r["first_step_s"] for r in warm]
        walls = [r["process_wall_s"] for r in warm]
        table.append([mode, fmt(cold[0]["first_step_s"] if cold else None, ".1f"),
                      f"{median(firsts):.1f} [{min(firsts):.1f}, {max(firsts):.1f}]" if firsts else "-", len(warm),
                      f"{fmt(cold[0]['process_wall_s'] if cold else None, '.1f')} / "
                      f"{fmt(median(walls) if walls else None, '.1f')}"])
    s = result["summary"]
    steps = result.get("steps_interleaved") or []
    notes = [
        f"Backend `{result['backend']}`, {result['nproc']} rank(s), {result['steps']} steps per run; every run "
        "is a new process. Cold: empty TORCHINDUCTOR_CACHE_DIR (and cache_dir), once per mode; warm: the same "
        f"directories, {result.get('warm_runs', 1)} restart(s) per mode, the modes in rotating order. "
        "`ours_cache` leaves TORCHINDUCTOR_CACHE_DIR unset, so Inductor's cache lives under `compile.cache_dir`; "
        "`ours_fresh`'s warm run gets an empty TORCHINDUCTOR_CACHE_DIR and only the `compile.cache_dir` file "
        "(another machine), a new empty one for each warm run. First steps are compared (medians of the warm "
        "runs); step times of separate processes are not.",
        f"Command: `{result['command']}`" + "".join(
            f"; rows of {', '.join(f'`{m}`' for m in u['modes'])} re-measured later by `{u['command']}` "
            f"({u['warm_runs']} warm run(s))" for u in result.get("updates", [])),
        markdown_table(["mode", "cold first step s", "warm first step s, median [min, max]", "warm runs",
                        "process wall s, cold / warm"], table),
    ]
    if steps:
        notes += [
            "Step time of the 8-block model, whole (`nosplit`: one graph; `ours`: split at DDP's buckets) against "
            f"`regional`, measured in turns in one {steps[0].get('world_size', '?')}-rank job, no simulated link "
            f"(`{steps[0].get('command', 'benchmarks.studies.ddp_compare')}`; {steps[0]['rounds']} measured rounds; "
            "cold compile here is each mode's first step with a fresh Inductor cache, in one process):",
            _steps_markdown(steps),
        ]
    wide = result.get("steps_interleaved_wide") or []
    if wide:
        notes += [f"The same job on a wider model (`{wide[0].get('model', '?')}`), where each compiled block does "
                  "more work per call:", _steps_markdown(wide)]
    notes += [
        markdown_table(["ratio", "value", "target"], [
            ["ours warm / ours cold (first step)", fmt(s["ours_warm_over_cold"], ".2f"), "<= 0.25"],
            ["ours warm / nosplit warm", fmt(s["ours_warm_over_nosplit_warm"], ".2f"), "<= 1"],
            ["ours_cache warm / cold", fmt(s["ours_cache_warm_over_cold"], ".2f"), "<= 0.25"],
            ["ours_cache warm / nosplit warm", fmt(s["ours_cache_warm_over_nosplit_warm"], ".2f"), "<= 1"],
            ["ours_fresh warm / cold", fmt(s["ours_fresh_warm_over_cold"], ".2f"), "<= 0.25"],
            ["whole8 cold / regional8 cold (restarts)", fmt(s["whole8_cold_over_regional8_cold"], ".2f"), ">= 2"],
            ["whole8 cold / regional8 cold (one job)", fmt(s.get("whole8_cold_over_regional8_cold_one_process"), ".2f"),
             ">= 2"],
            *_step_ratio_rows(s),
        ]),
        "Generated by `python -m benchmarks.studies.compile_time --render` from the benchmark's JSON.",
    ]
    return "\n\n".join(notes)


BLOCK = DocsBlock(START, END, results_markdown, "docs/compile-time.md")
render = BLOCK.write_from_json  # render(json_path, page): the page's compile block from the result JSON


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="bench_out/compile_time", help="work directory (emptied per mode)")
    p.add_argument("--json", default="benchmarks/results/compile_time.json")
    add_docs_args(p, BLOCK)
    p.add_argument("--quick", action="store_true", help="smoke run: aot_eager, 1 rank, 3 steps, a narrow model")
    p.add_argument("--warm-runs", type=int, default=None,
                   help="warm restarts per mode, rotating order, median reported (default 3; --quick: 1)")
    p.add_argument("--step-rounds", type=int, default=30,
                   help="measured rounds of the interleaved 8-block step-time job (0: skip it)")
    p.add_argument("--wide-embd", type=int, default=256,
                   help="width of a second interleaved step-time job on a wider 8-block model, where each block "
                        "does more work per compiled call (0: skip it; --quick skips it)")
    p.add_argument("--update", action="store_true",
                   help="re-run only --modes and keep the other modes' rows (and the interleaved jobs, unless "
                        "re-run) from the existing --json; the table says which run each row comes from")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = p.parse_args(argv)
    if render_only(a, BLOCK) is not None:
        return 0
    extra = list(a.overrides)
    if a.quick:
        a.backend, a.nproc, a.steps = "aot_eager", 1, 3
        extra += QUICK_OVERRIDES
    if a.warm_runs is None:
        a.warm_runs = 1 if a.quick else 3
    if a.warm_runs < 1 or a.step_rounds < 0 or a.wide_embd < 0 or a.wide_embd % 4:
        p.error(f"--warm-runs must be >= 1, --step-rounds >= 0 and --wide-embd a multiple of the model's 4 heads "
                f"(or 0), got {a.warm_runs}, {a.step_rounds} and {a.wide_embd}: the warm first step needs one "
                "restart at least, and the wider model splits its width over the heads. Leave the flags out for "
                "3, 30 and 256, or pass 0 to --step-rounds / --wide-embd to skip those jobs.")
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}: compile_time runs only its own modes. Choose a comma-separated "
                f"subset of {', '.join(MODES)}, or leave --modes out for all of them.")
    if a.update and not Path(a.json).exists():
        p.error(f"--update keeps the other modes' rows of {a.json}, which does not exist: run every mode "
                "once without --update first, or point --json at an earlier result.")
    rows = run_restarts(modes, Path(a.out), warm_runs=a.warm_runs, backend=a.backend, nproc=a.nproc, steps=a.steps,
                        extra=extra)
    steps: list[dict] = []
    wide: list[dict] = []
    if {"whole8", "regional8"} <= set(modes) and a.step_rounds > 0:
        job = dict(backend=a.backend, nproc=a.nproc, global_batch=2 if a.quick else 8, rounds=a.step_rounds)
        steps = interleaved_steps(Path(a.out), model=QUICK_STEP_MODEL if a.quick else STEP_MODEL, **job)
        if a.wide_embd and not a.quick:
            wide = interleaved_steps(Path(a.out), model=step_model(a.wide_embd), name="interleaved_steps_wide", **job)
    command = shlex.join(["python", "-m", "benchmarks.studies.compile_time", *(argv if argv is not None else sys.argv[1:])])
    result = {
        "command": command,
        "backend": a.backend, "nproc": a.nproc, "steps": a.steps, "warm_runs": a.warm_runs, "rows": rows,
        "steps_interleaved": steps,
        "steps_interleaved_wide": wide,
        "torch": __import__("torch").__version__,
    }
    if a.update:
        result = merge_update(json.loads(Path(a.json).read_text()), result, modes)
    result["summary"] = summarize(result["rows"], result["steps_interleaved"], result["steps_interleaved_wide"])
    return write_result(result, a.json, a.readme, render)


def merge_update(old: dict, new: dict, modes: Sequence[str]) -> dict:
    """``old`` with ``modes`` re-measured by ``new`` (``--update``): the other modes' rows and the
    interleaved jobs ``new`` did not run are kept, and ``updates`` records which run made which rows."""
    for key in ("backend", "nproc", "steps"):
        if old.get(key) != new[key]:
            raise SystemExit(f"--update: the existing result was measured with {key}={old.get(key)!r} and this run "
                             f"with {new[key]!r}; rows of both would not compare. Re-run every mode without "
                             "--update, or pass the same settings.")
    merged = dict(old, rows=[r for r in old["rows"] if r["mode"] not in modes] + new["rows"])
    for key in ("steps_interleaved", "steps_interleaved_wide"):
        merged[key] = new[key] or old.get(key) or []
    merged["updates"] = [u for u in old.get("updates", []) if set(u["modes"]) - set(modes)] + [
        {"command": new["command"], "modes": list(modes), "warm_runs": new["warm_runs"]}]
    return merged


if __name__ == "__main__":
    raise SystemExit(main())
