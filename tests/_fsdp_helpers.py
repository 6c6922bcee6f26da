"""Helpers for the fsdp_opt tests: hand-built module trees for the planner, a
rank function that trains an FSDP2 model next to an unsharded reference, and a
small decoder shaped like torchtitan's llama3 (layers in an nn.ModuleDict)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from launch.models import GPT, GPTConfig

STEPS = 3


class Lin(nn.Module):
    """A block of exactly ``n`` float32 parameters (``4 * n`` bytes)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))


class Other(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))


def named(sizes: list[int]) -> list[tuple[str, nn.Module]]:
    """Blocks named like a ModuleList's children, ``layers.0`` ..."""
    return [(f"layers.{i}", Lin(n)) for i, n in enumerate(sizes)]


def batch(rank: int, step: int, vocab: int, block: int, batch_size: int = 2):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, vocab, (batch_size, block), generator=g)
    return x, torch.roll(x, -1, dims=1)


def train_fsdp_vs_reference(rank: int, world_size: int, cfg: GPTConfig, apply_kwargs: dict, seq: int = 16) -> dict:
    """Train ``fsdp_opt.apply``-ed GPT on this rank's batches and an unsharded
    reference on every rank's batches (mean loss, which is what FSDP's averaged
    gradients follow), from the same init. Returns per-step losses, the max
    parameter difference after training, and what was built."""
    import fsdp_opt

    torch.manual_seed(0)
    model = GPT(cfg)
    ref = GPT(cfg)
    ref.load_state_dict(model.state_dict())
    plan = fsdp_opt.apply(model, **apply_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for step in range(STEPS):
        x, y = batch(rank, step, cfg.vocab_size, seq)
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        per_rank = [ref(*batch(r, step, cfg.vocab_size, seq))[1] for r in range(world_size)]
        torch.stack(per_rank).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(per_rank[rank].item())
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    max_diff = max((full[n] - ref_params[n.replace("_checkpoint_wrapped_module.", "")]).abs().max().item() for n in full)
    from torch._dynamo.utils import counters

    return dict(
        losses=losses, ref_losses=ref_losses, max_param_diff=max_diff,
        units=[u.blocks for u in plan.units],
        graph_breaks=sum(counters["graph_break"].values()),
        block_types=[type(b).__name__ for b in model.blocks],
        compiled=[getattr(b, "_compiled_call_impl", None) is not None for b in model.blocks],
        share=plan.share.stats.as_dict() if plan.share is not None else None,
        placements=sorted({str(getattr(p, "placements", None)) for p in model.parameters()}),
    )


# --- a decoder written the way torchtitan writes its llama3 model -----------------
# Layers in an nn.ModuleDict keyed "0", "1", ... (so that pipeline stages can drop
# layers and keep the names of the rest), pre-norm blocks with SwiGLU feed-forward.


@dataclass
class TitanArgs:
    dim: int = 32
    n_layers: int = 3
    n_heads: int = 2
    vocab_size: int = 64
    norm_eps: float = 1e-5


class Attention(nn.Module):
    def __init__(self, args: TitanArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, dim = x.shape
        q, k, v = (w(x).view(bs, seq, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: TitanArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: TitanArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict()
        for layer_id in range(args.n_layers):
            self.layers[str(layer_id)] = TransformerBlock(layer_id, args)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))

