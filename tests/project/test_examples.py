"""The README's Python example, examples/minimal_ddp.py, run as its users run it: under
torchrun with 2 ranks. Compiled (aot_eager) it trains as the same script with the graph
run uncompiled (the eager backend), loss for loss, with the graph split at DDP's 4 buckets."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "minimal_ddp.py"

pytestmark = pytest.mark.slow


def _losses(backend: str, cwd: Path) -> list[float]:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT), backend], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [int(re.match(r"step (\d+) ", line)[1]) for line in lines] == list(range(1, 31)), proc.stdout
    assert all(line.endswith(" buckets 4") for line in lines), proc.stdout
    return [float(line.split()[3]) for line in lines]


def test_the_minimal_example_is_short_and_trains_like_the_uncompiled_graph(tmp_path):
    assert len(SCRIPT.read_text().splitlines()) <= 30
    compiled, plain = _losses("aot_eager", tmp_path), _losses("eager", tmp_path)
    assert compiled == pytest.approx(plain, rel=1e-5, abs=1e-7)
    assert sum(compiled[-5:]) < 0.7 * sum(compiled[:5])  # it learns: the target is the input's first feature


def test_the_readme_shows_the_example_as_it_is():
    readme = (SCRIPT.parents[1] / "README.md").read_text()
    assert f"```python\n{SCRIPT.read_text()}```" in readme
