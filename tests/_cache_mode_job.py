"""One launcher-built training step with ``compile.cache_dir``, for the restart tests of
parallel=none, fsdp and ddp: ``python tests/_cache_mode_job.py CACHE_DIR MODE`` (under
``torchrun --nproc-per-node N`` for fsdp and ddp) builds the model with ``launch.runtime.parallel``, runs one
step, calls the launcher's ``_after_first_step`` (which saves the cache on rank 0) and writes
one JSON file per rank into OUT_DIR (``... CACHE_DIR MODE OUT_DIR``): the load status, whether
the entry was written, cache counters. Files, not stdout: two ranks' lines can interleave."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch


def run_mode_job(cache_dir: Path, inductor_dir: Path, mode: str, nproc: int = 2) -> dict:
    """This job in new processes (``nproc`` ranks under torchrun for fsdp and ddp) with their
    own Inductor cache directory: rank 0's JSON line, with the cache counters summed over the
    ranks (with shared compile each compile happens on one rank, whichever reached it first)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "OMP_NUM_THREADS": "1"}
    out_dir = inductor_dir.with_name(inductor_dir.name + "_results")
    out_dir.mkdir(parents=True)
    args = [__file__, str(cache_dir), mode, str(out_dir)]
    ranks = nproc if mode in ("fsdp", "ddp") else 1
    if mode in ("fsdp", "ddp"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args]
    else:
        cmd = [sys.executable, *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))]
    assert len(lines) == ranks, (lines, out.stdout[-3000:])
    out = next(line for line in lines if line["rank"] == 0)
    for kind in ("aot", "inductor"):
        names = {k for line in lines for k in line[kind]}
        out[kind] = {k: sum(line[kind].get(k, 0) for line in lines) for k in names}
    return out


def main(cache_dir: str, mode: str, out_dir: str) -> None:
    from torch._dynamo.utils import counters

    from _jobs import TINY_OVERRIDES as TINY, composed
    from launch.runtime.dist import DistEnv
    from launch.runtime.parallel import apply_parallel, build_model
    from launch.train import _after_first_step

    cfg = composed("compile=inductor", f"compile.cache_dir={cache_dir}", f"parallel={mode}", *TINY)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "WORLD_SIZE" in os.environ:  # under torchrun, one rank too
        torch.distributed.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, backend="gloo", device=torch.device("cpu"))
    torch.manual_seed(0)
    wrapped = apply_parallel(build_model(cfg.model), cfg, env)
    cache = wrapped.compile_cache if wrapped.compiled_ddp is None else wrapped.compiled_ddp.compile_cache
    before = cache.path.stat().st_mtime_ns if cache.path.exists() else None
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    loss = wrapped.forward(x, x)[1]
    loss.backward()
    _after_first_step(SimpleNamespace(wrapped=wrapped, compiled=True, env=env, cfg=cfg,
                                      tally=SimpleNamespace(warmup_s=None)), 0.0)
    inductor = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    if world > 1:
        torch.distributed.barrier()  # rank 0 saved
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "load": cache.last_load.status,
        "saved": cache.path.exists() and cache.path.stat().st_mtime_ns != before,
        "installed": len(cache.installed), "so_files": len(list(inductor.rglob("*.so"))),
        "aot": dict(counters["aot_autograd"]), "inductor": dict(counters["inductor"]), "loss": loss.item(),
    }))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # As the launcher ends (docs/reliability.md: "Why the job ends with os._exit"): the result is written, and
    # the interpreter's exit would run C++ destructors of compiled and distributed state; one aborted a rank
    # in CI on torch 2.15 ("terminate called without an active exception").
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    # Run by path, this file has tests/ first on sys.path, where tests/launch/, tests/compiler/, ...
    # (folders without __init__.py) would import as empty namespace packages: with the checkout's
    # root on the path too, the packages themselves win.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(*sys.argv[1:4])
