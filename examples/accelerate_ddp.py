"""Accelerate + compile_ddp in a complete training script.
Run: torchrun --standalone --nproc-per-node 2 examples/accelerate_ddp.py [backend]"""
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_opt.frameworks.accelerate import compile_prepared

accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2,  # on GPUs: no cpu=True
                          kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=0.25)])
torch.manual_seed(0)  # the same initial weights on every rank
model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(3)], nn.Linear(256, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
x = torch.randn(512, 256, generator=torch.Generator().manual_seed(0))
data = DataLoader(TensorDataset(x, x[:, :1]), batch_size=16)  # prepare gives each rank its own batches
model, optimizer, data = accelerator.prepare(model, optimizer, data)  # the model is now DDP
model = compile_prepared(model, backend=sys.argv[1] if len(sys.argv) > 1 else "inductor")  # the one added line
for step, (inputs, targets) in enumerate(data, 1):
    with accelerator.accumulate(model):  # no_sync on the first micro-batch: one all-reduce per optimizer step
        with accelerator.autocast():
            loss = nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.print(f"step {step} loss {loss.item():.6f} buckets {len(model.buckets)}")
accelerator.save_state("accelerate_ckpt")  # the model's own keys, as without compile
accelerator.print("alignment", f"{model.realignment.fraction:.2f}" if model.realignment else None,
                  "keys", sorted(accelerator.unwrap_model(model).state_dict())[:2])
accelerator.end_training()
