"""Run as a script by test_launch_dist: start a one-rank group with launch's helpers, run a
DDP backward and an all-reduce, tear down and drop the model, ``sys.argv[1]`` times. With
``dist.destroy_process_group`` alone this hung within 50 tries (Note [Process-group teardown])."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# Run by path, this file has tests/ first on sys.path, where tests/launch/, tests/compiler/, ...
# (folders without __init__.py) would import as empty namespace packages: with the checkout's
# root on the path too, the packages themselves win.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from launch.config.schema import ParallelConfig  # noqa: E402
from launch.runtime.dist import setup_distributed, teardown_distributed  # noqa: E402

for i in range(int(sys.argv[1])):
    setup_distributed(ParallelConfig(dist_backend="gloo"), timeout_s=60)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]), bucket_cap_mb=0.1)
    model(torch.randn(4, 256)).sum().backward()
    flag = torch.ones(1)
    dist.all_reduce(flag)  # the last collective, as a non-finite check makes before a run raises
    del flag
    teardown_distributed(ok=False)  # an error's path: no barrier
    del model  # the reducer's reference to the group goes last, right after the collective
print("done", flush=True)
