"""What the checkpoint manifest's checksum costs, per algorithm, on a checkpoint of more than 1 GiB.

Builds a real DCP checkpoint (``dcp.save`` of float32 tensors, one process, no process group)
in a temporary folder, times the save itself, then for each checksum of
``launch.checkpoint.integrity.ALGORITHMS`` times writing the manifest (what rank 0 adds to every
save) and verifying it (what rank 0 does before a resume), the algorithms interleaved round by
round; the folder is removed at the end. The files were just written, so they are read from the
page cache: the figures are the checksum's own cost, not the disk's (a resume from a cold cache
adds the disk's read time, the same for every algorithm).

    python -m benchmarks.studies.checkpoint_checksum                    # 1.25 GiB, 3 rounds
    python -m benchmarks.studies.checkpoint_checksum --render benchmarks/results/checkpoint_checksum.json docs/reliability.md

The docs page's section between ``<!-- bench:checksum:start -->`` and ``<!-- bench:checksum:end -->``
is regenerated from the JSON (``--readme``/``--render``).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from ..harness.cli import add_docs_args, render_only
from ..harness.report import DocsBlock, markdown_table, write_result
from ..harness.stats import median

START, END = "<!-- bench:checksum:start -->", "<!-- bench:checksum:end -->"
JSON = "benchmarks/results/checkpoint_checksum.json"


def _build(folder: str, gib: float) -> tuple[float, int, int]:
    """A DCP checkpoint of ``gib`` GiB of float32 tensors (64 MiB each) in ``folder``; its save seconds,
    bytes and files."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    n = max(1, round(gib * 16))
    gen = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(16 << 20, generator=gen) for i in range(n)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": one process writes the whole checkpoint
        t0 = time.perf_counter()
        dcp.save({"model": state}, checkpoint_id=folder)
        seconds = time.perf_counter() - t0
    files = [p for p in Path(folder).rglob("*") if p.is_file()]
    return seconds, sum(p.stat().st_size for p in files), len(files)


def measure(gib: float, rounds: int, where: str | None) -> dict:
    import torch

    from launch.checkpoint.integrity import ALGORITHMS, CHECKSUM, verify_manifest, write_manifest

    root = tempfile.mkdtemp(prefix="checksum-bench-", dir=where)
    try:
        folder = os.path.join(root, "step_000001")
        save_s, size, nfiles = _build(folder, gib)
        times: dict[str, dict[str, list[float]]] = {a: {"write": [], "verify": []} for a in ALGORITHMS}
        for r in range(rounds):
            order = list(ALGORITHMS)[r % len(ALGORITHMS):] + list(ALGORITHMS)[:r % len(ALGORITHMS)]
            for algorithm in order:
                t0 = time.perf_counter()
                write_manifest(folder, algorithm)
                t1 = time.perf_counter()
                problem = verify_manifest(folder)
                t2 = time.perf_counter()
                assert problem is None, problem
                times[algorithm]["write"].append(t1 - t0)
                times[algorithm]["verify"].append(t2 - t1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for algorithm, t in times.items():
        write, verify = median(t["write"]), median(t["verify"])
        rows.append({"algorithm": algorithm, "write_manifest_s": write, "verify_s": verify,
                     "verify_gib_per_s": size / 2**30 / verify, "write_over_save": write / save_s,
                     "write_runs_s": t["write"], "verify_runs_s": t["verify"]})
    return {
        "command": "python -m benchmarks.studies.checkpoint_checksum",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()}-core CPU dev machine ({platform.machine()})",
        "torch": torch.__version__,
        "checkpoint_bytes": size,
        "files": nfiles,
        "rounds": rounds,
        "dcp_save_s": save_s,
        "chosen": CHECKSUM,
        "rows": rows,
        "summary": {r["algorithm"]: f"{r['verify_gib_per_s']:.2f} GiB/s" for r in rows},
    }


def section_body(data: dict) -> str:
    """The docs block (a line on the run, then the table) from the result ``data``."""
    head = (f"{data['date']}, {data['machine']}, torch {data['torch']}: a DCP checkpoint of "
            f"{data['checkpoint_bytes'] / 2**30:.2f} GiB, saved in {data['dcp_save_s']:.2f} s; medians of "
            f"{data['rounds']} interleaved rounds, files in the page cache (`{data['command']}`).")
    table = markdown_table(
        ["checksum", "manifest on save (s)", "verify on resume (s)", "verify (GiB/s)", "manifest / save"],
        [[r["algorithm"] + (" (used)" if r["algorithm"] == data["chosen"] else ""), f"{r['write_manifest_s']:.2f}",
          f"{r['verify_s']:.2f}", f"{r['verify_gib_per_s']:.2f}", f"{r['write_over_save']:.2f}"]
         for r in data["rows"]])
    return f"\n{head}\n\n{table}\n"


BLOCK = DocsBlock(START, END, section_body, "docs/reliability.md")
render = BLOCK.write_from_json  # render(json_path, page): the page's block from the result JSON


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.25, help="checkpoint size in GiB (at least 1 for the docs)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the temporary checkpoint goes (default: the temp folder)")
    p.add_argument("--json", default=JSON)
    add_docs_args(p, BLOCK)
    a = p.parse_args(argv)
    if render_only(a, BLOCK) is not None:
        return 0
    return write_result(measure(a.gib, a.rounds, a.dir), a.json, a.readme, render)


if __name__ == "__main__":
    raise SystemExit(main())
