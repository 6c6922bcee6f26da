"""Compile time across restarts: cold and warm first steps of the main job, per mode.

Every run is a new ``torchrun ... -m launch.train`` process (a restart is a new
process), first with empty cache directories (cold), then again with the same
directories (warm). Each run's ``metrics.json`` gives ``first_step_s`` (forward,
backward and optimizer step of step 1, compile included) and the median step.

Modes (``--modes``):
    nosplit        compile_ddp(split=False): one graph, PyTorch's caches.
    ours           split at DDP's buckets, no cache_dir; Inductor's and
                   AOTAutograd's local caches (TORCHINDUCTOR_CACHE_DIR) warm.
    ours_cache     ours with compile.cache_dir and TORCHINDUCTOR_CACHE_DIR unset
                   (Inductor's local cache then lives under cache_dir too).
    ours_fresh     ours with compile.cache_dir; the warm run gets a *fresh*
                   TORCHINDUCTOR_CACHE_DIR, so only the cache_dir file serves it
                   (a restart on another machine; on CPU, Inductor's C++ kernels
                   are rebuilt from the cached source).
    whole8         the 8-block model compiled whole (split=False).
    regional8      the 8-block model, compile.regional=true (block compiled once).

    python -m benchmarks.compile_time                      # inductor, 2 ranks (the real run)
    python -m benchmarks.compile_time --quick              # aot_eager smoke run
    python -m benchmarks.compile_time --render benchmarks/results/compile_time.json README.md

The README section between ``<!-- bench:compile:start -->`` and
``<!-- bench:compile:end -->`` is regenerated from the JSON (``--readme``/``--render``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from .readme_results import replace_section

__all__ = ["MODES", "START", "END", "run_mode", "summarize", "results_markdown", "main"]

START = "<!-- bench:compile:start -->"
END = "<!-- bench:compile:end -->"

# mode -> (Hydra overrides, uses compile.cache_dir, TORCHINDUCTOR_CACHE_DIR policy:
# "shared" one dir for cold and warm, "unset" not set at all, "fresh" a new dir for warm)
MODES: dict[str, tuple[tuple[str, ...], bool, str]] = {
    "nosplit": (("compile.split=false",), False, "shared"),
    "ours": ((), False, "shared"),
    "ours_cache": ((), True, "unset"),
    "ours_fresh": ((), True, "fresh"),
    "whole8": (("model.n_layer=8", "compile.split=false"), False, "shared"),
    "regional8": (("model.n_layer=8", "compile.regional=true"), False, "shared"),
}


def _run(workdir: Path, overrides: Sequence[str], nproc: int, inductor_dir: Path | None, run_dir: Path,
         timeout: float) -> dict:
    """One job in a new process; its metrics.json plus the wall time of the whole process."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.setdefault("OMP_NUM_THREADS", "1")
    if inductor_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "launch.train", *overrides, f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    m = json.loads((run_dir / "metrics.json").read_text())
    return {"first_step_s": m["first_step_s"], "step_ms_median": m["median_step_ms"],
            "final_loss": m.get("final_loss"), "process_wall_s": wall}


def run_mode(mode: str, out: Path, *, backend: str, nproc: int, steps: int, extra: Sequence[str] = (),
             timeout: float = 1800) -> list[dict]:
    """Cold then warm run of ``mode`` under ``out/mode``, which is emptied first."""
    overrides, with_cache, inductor_policy = MODES[mode]
    base = out / mode
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    args = [f"compile={backend}", f"train.steps={steps}", *overrides, *extra]
    if with_cache:
        args.append(f"compile.cache_dir={base / 'cache'}")
    rows = []
    for phase in ("cold", "warm"):
        inductor = None if inductor_policy == "unset" else base / (
            "inductor_warm" if phase == "warm" and inductor_policy == "fresh" else "inductor")
        row = _run(Path.cwd(), args, nproc, inductor, base / f"run_{phase}", timeout)
        rows.append({"mode": mode, "phase": phase, **row})
        print(f"{mode:>10} {phase}: first step {row['first_step_s']:.1f} s, median step "
              f"{row['step_ms_median']:.1f} ms, process {row['process_wall_s']:.1f} s", flush=True)
    return rows


def summarize(rows: Sequence[dict]) -> dict:
    """The issue's done-when ratios from the rows (None where a mode was not run)."""
    get = {(r["mode"], r["phase"]): r for r in rows}

    def ratio(a, b, key="first_step_s"):
        if a in get and b in get and get[b][key]:
            return get[a][key] / get[b][key]
        return None

    return {
        "ours_warm_over_cold": ratio(("ours", "warm"), ("ours", "cold")),
        "ours_warm_over_nosplit_warm": ratio(("ours", "warm"), ("nosplit", "warm")),
        "ours_cache_warm_over_cold": ratio(("ours_cache", "warm"), ("ours_cache", "cold")),
        "ours_cache_warm_over_nosplit_warm": ratio(("ours_cache", "warm"), ("nosplit", "warm")),
        "ours_fresh_warm_over_cold": ratio(("ours_fresh", "warm"), ("ours_fresh", "cold")),
        "whole8_cold_over_regional8_cold": ratio(("whole8", "cold"), ("regional8", "cold")),
        "regional8_step_over_whole8_step": ratio(("regional8", "warm"), ("whole8", "warm"), "step_ms_median"),
    }


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def results_markdown(result: dict) -> str:
    """The README section: one row per mode and phase, then the done-when ratios."""
    lines = ["| mode | phase | first step s | median step ms | process wall s |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['mode']} | {r['phase']} | {_fmt(r['first_step_s'], '.1f')} | "
                     f"{_fmt(r['step_ms_median'], '.1f')} | {_fmt(r['process_wall_s'], '.1f')} |")
    s = result["summary"]
    notes = [
        f"Backend `{result['backend']}`, {result['nproc']} rank(s), {result['steps']} steps per run; every run "
        "is a new process. Cold: empty TORCHINDUCTOR_CACHE_DIR (and cache_dir); warm: the same directories. "
        "`ours_cache` leaves TORCHINDUCTOR_CACHE_DIR unset, so Inductor's cache lives under `compile.cache_dir`; "
        "`ours_fresh`'s warm run gets an empty TORCHINDUCTOR_CACHE_DIR and only the `compile.cache_dir` file "
        "(another machine). Runs are sequential, not interleaved: step times across modes are noisy.",
        f"Command: `{result['command']}`",
        "\n".join(lines),
        "| ratio | value | target |\n|---|---|---|\n"
        f"| ours warm / ours cold (first step) | {_fmt(s['ours_warm_over_cold'], '.2f')} | <= 0.25 |\n"
        f"| ours warm / nosplit warm | {_fmt(s['ours_warm_over_nosplit_warm'], '.2f')} | <= 1 |\n"
        f"| ours_cache warm / cold | {_fmt(s['ours_cache_warm_over_cold'], '.2f')} | <= 0.25 |\n"
        f"| ours_cache warm / nosplit warm | {_fmt(s['ours_cache_warm_over_nosplit_warm'], '.2f')} | <= 1 |\n"
        f"| ours_fresh warm / cold | {_fmt(s['ours_fresh_warm_over_cold'], '.2f')} | - |\n"
        f"| whole8 cold / regional8 cold | {_fmt(s['whole8_cold_over_regional8_cold'], '.2f')} | >= 2 |\n"
        f"| regional8 / whole8 median step | {_fmt(s['regional8_step_over_whole8_step'], '.3f')} | < 1.05 |",
        "Generated by `python -m benchmarks.compile_time --render` from the benchmark's JSON.",
    ]
    return "\n\n".join(notes)


def render(json_path: str | Path, readme: str | Path) -> None:
    result = json.loads(Path(json_path).read_text())
    path = Path(readme)
    path.write_text(replace_section(path.read_text(), results_markdown(result), START, END))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="bench_out/compile_time", help="work directory (emptied per mode)")
    p.add_argument("--json", default="benchmarks/results/compile_time.json")
    p.add_argument("--readme", default=None, help="regenerate this README's compile section")
    p.add_argument("--render", nargs=2, metavar=("JSON", "README"), help="only regenerate the README section")
    p.add_argument("--quick", action="store_true", help="smoke run: aot_eager, 1 rank, 3 steps, a narrow model")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = p.parse_args(argv)
    if a.render:
        render(*a.render)
        return 0
    extra = list(a.overrides)
    if a.quick:
        a.backend, a.nproc, a.steps = "aot_eager", 1, 3
        extra += ["model.n_embd=32", "model.n_head=2", "train.batch_size=2", "train.seq_len=16"]
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    rows = []
    for mode in modes:
        rows += run_mode(mode, Path(a.out), backend=a.backend, nproc=a.nproc, steps=a.steps, extra=extra)
    result = {
        "command": shlex.join(["python", "-m", "benchmarks.compile_time", *(argv if argv is not None else sys.argv[1:])]),
        "backend": a.backend, "nproc": a.nproc, "steps": a.steps, "rows": rows, "summary": summarize(rows),
        "torch": __import__("torch").__version__,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    if a.readme:
        render(a.json, a.readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
