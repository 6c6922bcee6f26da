"""The HF Trainer + compile_ddp in a complete training script.
Run: torchrun --standalone --nproc-per-node 2 examples/hf_trainer_ddp.py [backend]"""
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ddp_opt.frameworks.hf import compile_trainer


class Tokens(torch.utils.data.Dataset):  # stands in for a tokenized dataset
    def __init__(self, n: int = 128, seq: int = 32):
        self.ids = torch.randint(256, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=256,
                                   bos_token_id=0, eos_token_id=0))
args = TrainingArguments("hf_out", use_cpu=True, ddp_backend="gloo",  # on GPUs: no use_cpu, ddp_backend="nccl"
                         ddp_bucket_cap_mb=0.15, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_steps=8, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
callback = compile_trainer(trainer, backend=sys.argv[1] if len(sys.argv) > 1 else "inductor")  # the added line
trainer.train()
trainer.save_model("hf_out")  # the model's own keys: GPT2LMHeadModel.from_pretrained("hf_out") loads them
if trainer.is_world_process_zero():
    print("buckets", len(callback.compiled.buckets), "alignment", f"{callback.compiled.realignment.fraction:.2f}")
