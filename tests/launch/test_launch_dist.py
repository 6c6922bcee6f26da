"""launch.runtime.dist: tearing the process group down does not hang when a DDP model outlives it."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 240


@pytest.mark.slow
def test_dropping_a_ddp_model_right_after_teardown_does_not_hang():
    # Note [Process-group teardown]: the loop hung within 50 tries before the fix; 100 tries take ~5 s.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    try:
        done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "_teardown_loop.py"), "100"], env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError("100 rounds of setup, a DDP backward, teardown and dropping the model did not finish "
                             f"in {TIMEOUT_S} s: the teardown deadlock of Note [Process-group teardown] is back") from None
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]
