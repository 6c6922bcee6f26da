"""One command that checks a GPU machine end to end, and writes what it saw as JSON.

    python -m benchmarks.studies.gpu_check                     # all steps; JSON to benchmarks/results/gpu_check.json
    python -m benchmarks.studies.gpu_check --steps ddp,fsdp    # only the benchmarks
    python -m benchmarks.studies.gpu_check --render benchmarks/results/gpu_check.json docs/gpu.md
    python -m benchmarks.studies.gpu_check --merge a.json b.json --json benchmarks/results/gpu_check.json

Steps, each a subprocess with its own time limit, run in order; a failing or timed-out
step is recorded (with the tail of its output) and the next one still runs, and the
JSON is rewritten after every step, so a check cut short keeps what it finished:

1. ``env``: torch, CUDA, Triton and the GPU (name, memory, capability).
2. ``tests``: ``pytest -m gpu`` (tests/gpu/) with a JUnit report, read back
   into one row per test: outcome, seconds, and the first line of a failure. The
   benchmark tests (tests/gpu/test_gpu_bench.py) are left out here: steps 3 and 4 run the
   same commands at full size.
3. ``ddp``: ``benchmarks.studies.ddp_compare --device cuda`` on one rank (NCCL), no simulated
   link: eager DDP, PyTorch's splitter, compile without splitting and ours, interleaved
   round by round: step time, peak ``torch.cuda.max_memory_allocated``, cold compile
   (fresh Inductor dir) and warm compile (the same dir after a reset: a restart's cost).
4. ``fsdp``: ``benchmarks.studies.fsdp_compare --device cuda`` on one rank, the same model.

One GPU has no link between ranks, so steps 3 and 4 measure compiled step time,
memory and compile time, not overlap of communication (that needs several GPUs).
The exit code is 0 when every step passed. ``--render`` writes the docs page's section
between ``<!-- bench:gpu:start -->`` and ``<!-- bench:gpu:end -->`` from the JSON.
Every step records the check command and start time that produced it, so a check
split over several calls (a machine that limits each command's time) is joined with
``--merge`` without losing where each step came from; the runs must share one
environment (the same torch, CUDA and GPU), or the merge is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Sequence

from ..harness.cli import add_docs_args, render_only
from ..harness.report import DocsBlock, fmt, markdown_table, with_iqr, write_json

__all__ = ["main", "STEPS", "merge", "render", "results_markdown", "read_junit"]

START, END = "<!-- bench:gpu:start -->", "<!-- bench:gpu:end -->"
REPO = Path(__file__).resolve().parents[2]
STEPS = ("env", "tests", "ddp", "fsdp")
# A model with some GPU work per step (~21 M parameters, ~84 MiB of float32 gradients).
MODEL = ["--layers", "4", "--embd", "512", "--heads", "8", "--seq", "256", "--batch", "16", "--vocab", "8192"]


def environment() -> dict:
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                           "cuda_available": torch.cuda.is_available()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpus=torch.cuda.device_count(), gpu_mib=props.total_memory // 2**20,
                   capability=f"sm_{props.major}{props.minor}")
    return env


def read_junit(path: Path) -> list[dict]:
    """One row per test case of a JUnit XML report: name, outcome, seconds, message."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip().splitlines()[0][:300] if (
                    node.get("message") or node.text) else None
                break
        rows.append({"test": f"{Path(case.get('classname', '').replace('.', '/')).name}::{case.get('name')}",
                     "outcome": outcome, "seconds": float(case.get("time", 0.0)), "message": message})
    return rows


def _run(cmd: Sequence[str], timeout: float) -> tuple[str, float, str]:
    """(status, seconds, output tail) of ``cmd``; status ok, failed (exit N) or timed out."""
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(list(cmd), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-4000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-4000:]
        return f"timed out after {timeout:.0f} s", time.perf_counter() - t0, str(out)
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-5000:]) if proc.returncode else proc.stdout[-2000:]
    return ("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"), time.perf_counter() - t0, tail


def _tests(work: Path, timeout: float) -> dict:
    report = work / "gpu_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={report}",
           "--ignore=tests/gpu/test_gpu_bench.py", "tests"]
    status, seconds, tail = _run(cmd, timeout)
    cases = read_junit(report) if report.exists() else []
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"status": status, "seconds": seconds, "command": " ".join(cmd[2:]), "counts": counts, "cases": cases,
            "tail": None if status == "ok" else tail}


def _bench(module: str, extra: Sequence[str], work: Path, timeout: float) -> dict:
    out = work / f"{module.rsplit('.', 1)[-1]}.json"
    cmd = [sys.executable, "-m", module, "--device", "cuda", "--nproc", "1", *MODEL, *extra, "--json", str(out)]
    status, seconds, tail = _run(cmd, timeout)
    rows = json.loads(out.read_text()) if out.exists() and status == "ok" else []
    return {"status": status, "seconds": seconds, "command": "python -m " + " ".join(cmd[2:-2]), "rows": rows,
            "tail": None if status == "ok" else tail}


def run_steps(steps: Sequence[str], work: Path, json_path: Path, timeouts: dict[str, float],
              update: bool = False) -> dict:
    """Run ``steps``; with ``update``, start from the JSON already at ``json_path`` and replace
    only those steps (each step's rows name their own command)."""
    result: dict[str, Any] = json.loads(json_path.read_text()) if update and json_path.exists() else {}
    check = {"command": "python -m benchmarks.studies.gpu_check " + " ".join(sys.argv[1:]),
             "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    actions: dict[str, Callable[[], Any]] = {
        "env": environment,
        "tests": lambda: _tests(work, timeouts["tests"]),
        "ddp": lambda: _bench("benchmarks.studies.ddp_compare", ["--link", "none", "--caps", "25", "--steps", "10",
                                                         "--warmup", "3"], work, timeouts["bench"]),
        "fsdp": lambda: _bench("benchmarks.studies.fsdp_compare", ["--steps", "10", "--warmup", "3"], work, timeouts["bench"]),
    }
    for name in steps:
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        result[name] = actions[name]()
        if name != "env":
            result[name]["check"] = check
        status = result[name].get("status", "ok") if isinstance(result[name], dict) else "ok"
        print(f"gpu_check: {name}: {status}", file=sys.stderr, flush=True)
        write_json(result, json_path)
    return result


def merge(paths: Sequence[str | Path]) -> dict:
    """The steps of several check JSONs in one (a later file's step replaces an earlier's),
    each keeping the check command and start time that produced it."""
    merged: dict[str, Any] = {}
    for path in paths:
        part = json.loads(Path(path).read_text())
        env = part.get("env")
        if env and merged.get("env") and env != merged["env"]:
            raise ValueError(f"{path} was run in another environment ({env}) than the files before it "
                             f"({merged['env']}); a merged check must describe one machine and one torch. Merge only "
                             "the runs of one environment.")
        merged["env"] = env or merged.get("env")
        for name in STEPS[1:]:
            if name in part:
                step = dict(part[name])
                step.setdefault("check", {"command": part.get("command"), "started": part.get("started")})
                merged[name] = step
    return merged


def _ok(result: dict) -> bool:
    return all(v.get("status", "ok") == "ok" for k, v in result.items() if isinstance(v, dict) and k != "env")


# -- the docs page's section ----------------------------------------------------------------------------

def _ddp_rows(rows: list[dict]) -> list[list]:
    return [[r["mode"], with_iqr(r["step_ms_median"], r.get("step_ms_q1"), r.get("step_ms_q3"), ".2f"),
             with_iqr(r.get("ratio_vs_builtin"), r.get("ratio_q1"), r.get("ratio_q3")), fmt(r.get("peak_mib"), ".0f"),
             fmt(r.get("compile_cold_s"), ".1f"), fmt(r.get("compile_warm_s"), ".1f"), fmt(r.get("partitions"), "d"),
             fmt(r.get("loss_max_abs_diff"), ".1e")] for r in rows]


def _fsdp_rows(rows: list[dict]) -> list[list]:
    return [[r["mode"], with_iqr(r["step_ms_median"], r.get("step_ms_q1"), r.get("step_ms_q3"), ".2f"),
             with_iqr(r.get("ratio_vs_per_block"), r.get("ratio_q1"), r.get("ratio_q3")),
             fmt(r.get("peak_mib"), ".0f"), fmt(r.get("compile_s"), ".1f"), fmt(r.get("loss_max_abs_diff"), ".1e")]
            for r in rows]


def _provenance(step: dict) -> str:
    check = step.get("check") or {}
    return f"`{check.get('command') or 'python -m benchmarks.studies.gpu_check'}`, {check.get('started') or 'time not recorded'}"


def results_markdown(result: dict) -> str:
    env = result.get("env", {})
    parts = [f"Machine: {env.get('gpu', 'no GPU')} ({env.get('capability', '?')}, {env.get('gpu_mib', '?')} MiB), "
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}, Triton {env.get('triton')}, Python {env.get('python')}."]
    tests = result.get("tests")
    if tests:
        c = tests["counts"]
        parts.append(f"**`pytest -m gpu`** ({_provenance(tests)}): {tests['status']} in {tests['seconds']:.0f} s, "
                     f"{c['passed']} passed, {c['failed'] + c['error']} failed, {c['skipped']} skipped.")
        parts.append(markdown_table(["test", "outcome", "s", "message"],
                                    [[t["test"], t["outcome"], fmt(t["seconds"], ".1f"), t["message"] or ""]
                                     for t in tests["cases"]]))
    for key, title, headers, cells in (
        ("ddp", "DDP, one rank over NCCL", ["mode", "step ms [IQR]", "vs builtin [IQR]", "peak MiB", "cold compile s",
                                            "warm compile s", "partitions", "loss diff"], _ddp_rows),
        ("fsdp", "FSDP2, one rank over NCCL", ["mode", "step ms [IQR]", "vs per_block [IQR]", "peak MiB", "compile s",
                                               "loss diff"], _fsdp_rows),
    ):
        step = result.get(key)
        if not step:
            continue
        parts.append(f"**{title}** ({_provenance(step)}): {step['status']} in {step['seconds']:.0f} s, "
                     f"`{step['command']}`")
        if step["rows"]:
            parts.append(markdown_table(headers, cells(step["rows"])))
    parts.append("Generated by `python -m benchmarks.studies.gpu_check --render` from the check's JSON.")
    return "\n\n".join(parts)


BLOCK = DocsBlock(START, END, results_markdown, "docs/gpu.md")
render = BLOCK.write_from_json  # render(json_path, page): the page's GPU block from the check's JSON


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from {', '.join(STEPS)}")
    p.add_argument("--json", default="benchmarks/results/gpu_check.json")
    p.add_argument("--work", default="bench_out/gpu_check", help="scratch directory (JUnit report, per-step JSON)")
    p.add_argument("--tests-timeout", type=float, default=420.0, help="seconds for pytest -m gpu")
    p.add_argument("--bench-timeout", type=float, default=300.0, help="seconds for each benchmark")
    p.add_argument("--update", action="store_true",
                   help="keep the steps of the existing --json that this run does not repeat")
    add_docs_args(p, BLOCK)
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="only join these check JSONs (later steps win) into --json; runs nothing")
    a = p.parse_args(argv)
    if render_only(a, BLOCK) is not None:
        return 0
    if a.merge:
        try:
            write_json(merge(a.merge), Path(a.json))
        except ValueError as e:
            p.error(str(e))
        if a.readme:
            render(a.json, a.readme)
        return 0
    steps = [s for s in a.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        p.error(f"unknown step(s) {unknown}: the check has the steps {', '.join(STEPS)}. Pass a comma-separated "
                "subset, or leave --steps out for all of them.")
    import torch

    if {"tests", "ddp", "fsdp"} & set(steps) and not torch.cuda.is_available():
        p.error("no CUDA GPU is visible (torch.cuda.is_available() is False), so there is nothing to check: this "
                "command checks a GPU machine. Run it on one (with a CUDA build of torch), or run --steps env here.")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    result = run_steps(steps, work, Path(a.json), {"tests": a.tests_timeout, "bench": a.bench_timeout}, a.update)
    if a.readme:
        render(a.json, a.readme)
    print(json.dumps({k: v.get("status", "ok") if isinstance(v, dict) and k != "env" else v
                      for k, v in result.items() if k != "command"}, indent=1))
    return 0 if _ok(result) else 1


if __name__ == "__main__":
    raise SystemExit(main())
