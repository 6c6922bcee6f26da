"""compile_ddp in a complete training script. Run: torchrun --standalone --nproc-per-node 2 examples/minimal_ddp.py"""
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_opt import compile_ddp

dist.init_process_group("gloo")  # "nccl" on GPUs, with the model and each batch on cuda:LOCAL_RANK
torch.manual_seed(0)  # the same initial weights on every rank
model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)], nn.Linear(256, 1))
ddp = DDP(model, bucket_cap_mb=0.25)  # 0.25 MiB buckets: the compiled graph is split where they are
compiled = compile_ddp(ddp, backend=sys.argv[1] if len(sys.argv) > 1 else "inductor")  # or "aot_eager"
optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)  # the model's own parameters
data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batches
for step in range(1, 31):
    x = torch.randn(32, 256, generator=data)
    loss = (compiled(x) - x[:, :1]).pow(2).mean()  # compiled(x) returns what model(x) returns
    optimizer.zero_grad()
    compiled.backward(loss)  # each bucket's gradients are all-reduced as soon as its partition's backward is done
    optimizer.step()
    if dist.get_rank() == 0:
        print(f"step {step} loss {loss.item():.6f} buckets {len(compiled.buckets)}")
dist.destroy_process_group()
