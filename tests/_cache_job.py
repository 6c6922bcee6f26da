"""One tiny training job for the compile-cache restart test, in its own process:
``python tests/_cache_job.py CACHE_DIR`` prints one JSON line (losses, cache counters)."""

import copy
import json
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def main(cache_dir: str) -> None:
    from _dist import single_rank_group
    from ddp_opt import compile_ddp
    from models import GPT, GPTConfig
    from torch._dynamo.utils import counters

    with single_rank_group():
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16))
        ref = DDP(copy.deepcopy(model), bucket_cap_mb=0.06)
        ddp = DDP(model, bucket_cap_mb=0.06)
        compiled = compile_ddp(ddp, backend="inductor", cache_dir=cache_dir)
        path = compiled.compile_cache.path
        before = path.stat().st_mtime_ns if path.exists() else None
        losses, eager_losses = [], []
        for step in range(3):
            x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
            t0 = time.perf_counter()
            loss = compiled(x, x)[1]
            loss.backward()
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
        print(json.dumps({
            "load": compiled.compile_cache.last_load.status,
            "saved": path.exists() and path.stat().st_mtime_ns != before,
            "partitions": len(compiled.buckets),
            "aot": dict(counters["aot_autograd"]),
            "first_step_s": first_step_s, "losses": losses, "eager_losses": eager_losses,
        }))


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    main(sys.argv[1])
