"""compile_ddp in a Lightning Trainer.
Run: torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py [backend]"""
import sys

import lightning.pytorch as pl
import torch
from torch import nn

from ddp_opt.frameworks.lightning import CompiledDDPStrategy


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(96, 96), nn.Tanh()) for _ in range(5)], nn.Linear(96, 1))

    def forward(self, x):  # what the strategy compiles: call self(x) in the steps
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class PrintLoss(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            print(f"step {trainer.global_step} loss {outputs['loss'].item():.6f}", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)  # the same data and initial weights on every rank
    x = torch.randn(512, 96)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=16)
    # The one changed line: strategy="ddp" becomes CompiledDDPStrategy(...). bucket_cap_mb is DDP's cap, and
    # the compiled graph is split where DDP's buckets are (caps below 1 MiB included).
    strategy = CompiledDDPStrategy(backend=sys.argv[1] if len(sys.argv) > 1 else "inductor", bucket_cap_mb=0.05)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=24, callbacks=[PrintLoss()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Regression(), data)
    if trainer.is_global_zero:
        print(f"buckets {len(strategy.compiled.buckets)} alignment {strategy.compiled.realignment.fraction:.2f}")
