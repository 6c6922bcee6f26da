"""Helpers for the GPU tests (``pytest -m gpu``): the marker that skips them without
CUDA, a small GPT on the GPU, and a training loop that runs a compiled DDP model
step by step next to an eager DDP copy and records how far they drift apart.

Every GPU test module sets ``pytestmark = GPU`` so the CPU suite collects and skips
them with the reason, and ``pytest -m gpu`` on a GPU machine runs exactly them.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable, Iterator

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from launch.models import GPT, GPTConfig

NO_CUDA = ("needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
           "run `pytest -m gpu` on a GPU machine (docs/gpu.md: the GPU check)")
# A hung collective fails its test instead of stalling the whole GPU check. Slow too: a GPU test
# compiles with Inductor in its own process, which the fast tier's guard refuses (Note [Test tiers]).
GPU = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
       pytest.mark.timeout(300)]

# Small enough to compile in seconds, big enough for several 64 KiB buckets.
CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
BUCKET_MB = 0.0625  # 64 KiB: one DDP bucket per few parameters, so several partitions


def cuda0() -> torch.device:
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


@contextlib.contextmanager
def one_rank_nccl() -> Iterator[None]:
    """A one-rank NCCL group on GPU 0 (in-memory store)."""
    from _dist import single_rank_group

    cuda0()
    with single_rank_group("nccl"):
        yield


def batch(step: int, rank: int, device: torch.device, cfg: GPTConfig = CFG) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step`` (made on the CPU, so the same on every machine)."""
    g = torch.Generator().manual_seed(10_007 * rank + step)
    idx = torch.randint(cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
    return idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)


def ddp_pair(device: torch.device, cfg: GPTConfig = CFG, bucket_cap_mb: float = BUCKET_MB) -> tuple[DDP, DDP]:
    """Two DDP models with the same weights on ``device``: one to compile, one eager."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    ref = copy.deepcopy(model)
    ids = [device.index] if device.type == "cuda" else None
    return (DDP(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb),
            DDP(ref, device_ids=ids, bucket_cap_mb=bucket_cap_mb))


@dataclass
class Drift:
    """Per step: both losses, the largest gradient and parameter differences, the
    largest relative gradient error (``|g - g_ref| / |g_ref|`` in L2, per parameter),
    and the grad scalers' scales (fp16)."""

    losses: list[float] = field(default_factory=list)
    ref_losses: list[float] = field(default_factory=list)
    grad_diff: list[float] = field(default_factory=list)
    grad_rel: list[float] = field(default_factory=list)
    param_diff: list[float] = field(default_factory=list)
    scales: list[tuple[float, float]] = field(default_factory=list)

    def worst(self) -> dict:
        return {"loss": max(abs(a - b) for a, b in zip(self.losses, self.ref_losses)),
                "grad": max(self.grad_diff), "grad_rel": max(self.grad_rel), "param": max(self.param_diff)}


def _pairs(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    assert len(a) == len(b) and all((x is None) == (y is None) for x, y in zip(a, b)), "different gradients set"
    return [(x.detach().float(), y.detach().float()) for x, y in zip(a, b) if x is not None]


def _max_diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    return max(((x - y).abs().max().item() for x, y in _pairs(a, b)), default=0.0)


def _max_rel(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    return max(((x - y).norm().item() / max(y.norm().item(), 1e-12) for x, y in _pairs(a, b)
                if y.norm().item() > 1e-6), default=0.0)


def train_side_by_side(
    compiled: Callable, ddp: DDP, ref: DDP, *, steps: int = 4, rank: int = 0,
    dtype: torch.dtype | None = None, scaler: float | None = None, lr: float = 1e-3,
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> Drift:
    """Train ``compiled`` (wrapping ``ddp``) and eager ``ref`` on the same batches.

    ``dtype``: autocast to it around forward, both models; ``scaler``: an fp16
    ``GradScaler`` per model, with this initial scale; ``make_optimizer``:
    AdamW(foreach) by default.
    Gradients are compared after backward (unscaled when a scaler is used),
    parameters after the step.
    """
    device = next(ddp.parameters()).device
    make_optimizer = make_optimizer or (lambda ps: torch.optim.AdamW(ps, lr=lr, foreach=True))
    opt, ref_opt = make_optimizer(list(ddp.parameters())), make_optimizer(list(ref.parameters()))
    scalers = [torch.amp.GradScaler("cuda", init_scale=scaler) for _ in range(2)] if scaler else [None, None]
    drift = Drift()
    for i in range(steps):
        x, y = batch(i, rank, device)
        losses = []
        for fn, o, s in ((compiled, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            with torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext():
                loss = fn(x, y)[1]
            (s.scale(loss) if s is not None else loss).backward()
            if s is not None:
                s.unscale_(o)
            losses.append(loss.detach().float().item())
        grads = [p.grad for p in ddp.parameters()], [p.grad for p in ref.parameters()]
        drift.grad_diff.append(_max_diff(*grads))
        drift.grad_rel.append(_max_rel(*grads))
        if scaler:
            drift.scales.append((scalers[0].get_scale(), scalers[1].get_scale()))
        for o, s in ((opt, scalers[0]), (ref_opt, scalers[1])):
            if s is not None:
                s.step(o)
                s.update()
            else:
                o.step()
            o.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        drift.losses.append(losses[0])
        drift.ref_losses.append(losses[1])
        drift.param_diff.append(_max_diff(list(ddp.parameters()), list(ref.parameters())))
    return drift
