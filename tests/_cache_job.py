"""One tiny training job for the compile-cache restart tests, in its own process:
``python tests/_cache_job.py CACHE_DIR [cpu|cuda]`` prints one JSON line (losses, cache
counters, first-step seconds). On ``cuda`` the model runs on GPU 0 in a one-rank NCCL
group, so the partitions are Triton kernels."""

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def run_job(cache_dir: Path, inductor_dir: Path, device: str = "cpu", *, then_seq: int | None = None) -> dict:
    """This job in a new process with its own Inductor cache directory; its JSON line.
    ``then_seq``: one more step at that sequence length (a new graph), then a save."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "OMP_NUM_THREADS": "1",
           "CACHE_JOB_THEN_SEQ": str(then_seq or "")}
    out = subprocess.run([sys.executable, __file__, str(cache_dir), device], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(cache_dir: str, device: str = "cpu") -> None:
    from _dist import single_rank_group
    from ddp_opt import compile_ddp
    from launch.models import GPT, GPTConfig
    from torch._dynamo.utils import counters

    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    with single_rank_group("nccl" if dev.type == "cuda" else "gloo"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)).to(dev)
        ref = DDP(copy.deepcopy(model), bucket_cap_mb=0.06)
        ddp = DDP(model, bucket_cap_mb=0.06)
        compiled = compile_ddp(ddp, backend="inductor", cache_dir=cache_dir)
        path = compiled.compile_cache.path
        before = path.stat().st_mtime_ns if path.exists() else None
        losses, eager_losses = [], []
        for step in range(3):
            x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step)).to(dev)
            t0 = time.perf_counter()
            loss = compiled(x, x)[1]
            loss.backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if step == 0:
                first_step_s = time.perf_counter() - t0
            ref_loss = ref(x, x)[1]
            ref_loss.backward()
            for m in (ddp, ref):
                for p in m.parameters():
                    p.data.add_(p.grad, alpha=-0.1)
                m.zero_grad()
            losses.append(loss.item())
            eager_losses.append(ref_loss.item())
        saved = path.exists() and path.stat().st_mtime_ns != before
        if os.environ.get("CACHE_JOB_THEN_SEQ"):  # a new shape after the first save: a new graph
            seq = int(os.environ["CACHE_JOB_THEN_SEQ"])
            x = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(9)).to(dev)
            compiled(x, x)[1].backward()
            saved_again = compiled.save_compile_cache() is not None
        inductor = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        print(json.dumps({
            "load": compiled.compile_cache.last_load.status,
            "saved": saved, "saved_again": os.environ.get("CACHE_JOB_THEN_SEQ") and saved_again,
            "installed": len(compiled.compile_cache.installed),
            "so_files": len(list(inductor.rglob("*.so"))),
            "entry_bytes": path.stat().st_size if path.exists() else 0,
            "partitions": len(compiled.buckets),
            "statuses": [r.status for r in compiled.splitter.records],
            "aot": dict(counters["aot_autograd"]),
            "first_step_s": first_step_s, "losses": losses, "eager_losses": eager_losses,
        }))


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    # Run by path, this file has tests/ first on sys.path, where tests/launch/, tests/compiler/, ...
    # (folders without __init__.py) would import as empty namespace packages: with the checkout's
    # root on the path too, the packages themselves win.
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
    main(*sys.argv[1:3])
