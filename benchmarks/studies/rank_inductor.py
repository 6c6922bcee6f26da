"""torchrun entry that gives each local rank an Inductor cache directory of its own,
``$DISTCOMPILE_INDUCTOR_BASE/rank<LOCAL_RANK>``, as ranks on different machines have,
then runs a module as ``python -m`` would:

    torchrun --nproc-per-node 4 -m benchmarks.studies.rank_inductor launch.train compile=inductor
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2 or "DISTCOMPILE_INDUCTOR_BASE" not in os.environ:
        raise SystemExit("usage: DISTCOMPILE_INDUCTOR_BASE=DIR torchrun ... -m benchmarks.studies.rank_inductor MODULE [ARGS]: "
                         "the base directory holds one Inductor cache directory per local rank.")
    base = os.environ["DISTCOMPILE_INDUCTOR_BASE"]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"rank{os.environ.get('LOCAL_RANK', '0')}")
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
