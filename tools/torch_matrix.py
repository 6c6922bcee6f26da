"""One row of the torch compatibility table: run the contract tests and a chosen subset
against the torch installed in *this* interpreter, record what ran and which features can
run, and regenerate the docs' table (docs/getting-started.md) from every row recorded so far.

    python tools/torch_matrix.py                          # contracts + the default subset
    python tools/torch_matrix.py --subset tests/ddp_opt/test_ddp_alignment.py
    python tools/torch_matrix.py --render-only            # the docs table from the JSON

Rows live in ``benchmarks/results/torch_matrix.json``, one per torch release (a new run of
the same release replaces its row). The page's text between ``<!-- torch-matrix:start -->``
and ``<!-- torch-matrix:end -->`` is rewritten from them; nothing in it is typed by hand.
Features are read by the same feature detection the libraries gate on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness.report import markdown_table, update_section, write_json  # noqa: E402

START, END = "<!-- torch-matrix:start -->", "<!-- torch-matrix:end -->"
JSON = ROOT / "benchmarks" / "results" / "torch_matrix.json"
CONTRACTS = ["tests/contracts/test_torch_contracts.py", "tests/contracts/test_torch_contracts_ddp.py",
             "tests/contracts/test_torch_contracts_import.py"]
# The paths that broke on a release before: realignment, plan agreement, real clients' flows.
SUBSET = ["tests/ddp_opt/test_ddp_alignment.py", "tests/ddp_opt/test_ddp_agreement.py",
          "tests/ddp_opt/test_ddp_compile_first.py", "tests/ddp_opt/test_real_clients.py",
          "tests/fsdp_opt/test_fsdp_plan.py"]


def run_pytest(paths: Sequence[str]) -> dict:
    """Counts of one pytest run (its JUnit XML), and the names of the tests that failed."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                               *paths], cwd=ROOT, capture_output=True, text=True)
        if not xml.exists():
            raise SystemExit(f"pytest did not run ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        cases = ET.parse(xml).getroot().iter("testcase")
        failed, skipped, total = [], 0, 0
        for case in cases:
            total += 1
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
            elif case.find("skipped") is not None:
                skipped += 1
    return {"passed": total - len(failed) - skipped, "failed": len(failed), "skipped": skipped,
            "failures": failed}


def features() -> dict:
    """Which features can run on this torch, by the libraries' own feature detection."""
    import torch

    from ddp_opt._torch_internals import missing_for_realignment
    from ddp_opt.strategies.traced._torch_internals import traced_strategy_missing

    missing = missing_for_realignment()
    traced = traced_strategy_missing()
    share = all(hasattr(torch.compiler, n) for n in ("save_cache_artifacts", "load_cache_artifacts"))
    return {
        "realignment": "on" if not missing else "off: lacks " + ", ".join(missing),
        "traced strategy": "on" if traced is None else f"off: {traced}",
        "shared compile": "on" if share else "off: lacks torch.compiler.save/load_cache_artifacts",
        "compile_on_one_rank (peer)": "present" if hasattr(getattr(torch.compiler, "config", None),
                                                          "compile_on_one_rank") else "absent",
    }


def row(subset: Sequence[str]) -> dict:
    import torch

    return {
        "torch": torch.__version__, "python": platform.python_version(),
        "cuda_build": torch.version.cuda, "date": datetime.date.today().isoformat(),
        "contracts": run_pytest(CONTRACTS), "subset": {"paths": list(subset), **run_pytest(subset)},
        "features": features(),
    }


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:3])


def render(rows: Sequence[dict]) -> str:
    """The docs table: one line per release, newest last."""
    ordered = sorted(rows, key=lambda r: _release(r["torch"]))
    names = list(ordered[0]["features"]) if ordered else []

    def count(result: dict) -> str:
        return f"{result['passed']}/{result['passed'] + result['failed']}" + \
            (f" ({result['skipped']} skipped)" if result["skipped"] else "")

    lines = [[r["torch"], r["date"], count(r["contracts"]), count(r["subset"]),
              *(r["features"].get(n, "?") for n in names)] for r in ordered]
    table = markdown_table(["torch", "run on", "contract tests", "subset tests", *names], lines)
    subsets = sorted({" ".join(r["subset"]["paths"]) for r in ordered})
    failures = [f"- torch {r['torch']}: {', '.join(r['contracts']['failures'] + r['subset']['failures'])}"
                for r in ordered if r["contracts"]["failures"] or r["subset"]["failures"]]
    return "\n".join([
        "Written by `python tools/torch_matrix.py` on each release (CPU, 2 gloo ranks); the subset was "
        + "; ".join(f"`{s}`" for s in subsets) + ".", "", table, *([""] + ["Failures:"] + failures if failures else []),
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subset", nargs="*", default=SUBSET, help="test paths run beside the contract tests")
    parser.add_argument("--json", default=str(JSON), help="where the rows are kept")
    parser.add_argument("--readme", default=str(ROOT / "docs" / "getting-started.md"), help="the page whose table is rewritten")
    parser.add_argument("--render-only", action="store_true", help="only rewrite the table from the JSON")
    args = parser.parse_args(argv)
    path = Path(args.json)
    rows = json.loads(path.read_text()) if path.exists() else []
    if not args.render_only:
        new = row(args.subset)
        rows = [r for r in rows if _release(r["torch"])[:2] != _release(new["torch"])[:2]] + [new]
        write_json(rows, path)
        print(json.dumps({k: new[k] for k in ("torch", "features")}, indent=1))
        print("contracts", {k: v for k, v in new["contracts"].items()}, "subset",
              {k: v for k, v in new["subset"].items() if k != "paths"})
    update_section(args.readme, render(rows), START, END)
    failed = rows and (rows[-1]["contracts"]["failed"] or rows[-1]["subset"]["failed"])
    return 1 if failed and not args.render_only else 0


if __name__ == "__main__":
    sys.exit(main())
