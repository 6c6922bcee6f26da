"""MkDocs hook (``mkdocs.yml``: ``hooks``): the benchmarks' plots, served from where
the benchmark scripts write them.

The plots live next to their JSON in ``benchmarks/results/``, outside ``docs/``; this
hook adds them to the site as ``benchmarks/results/<name>.png``, so a page in
``docs/benchmarks/`` links ``results/<name>.png`` and no copy is kept in ``docs/``.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def on_files(files: Files, config) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/results/{png.name}", abs_src_path=str(png)))
    return files
