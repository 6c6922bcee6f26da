"""compile_ddp(strategy="traced") on a CUDA GPU (``pytest -m gpu``; skipped without CUDA):
Inductor's Triton code for the traced backward, step by step against eager DDP with gradient
accumulation, on two ranks sharing GPU 0 over gloo and on one rank over NCCL. The code of
every synchronised backward must keep its all-reduces in flight while gradients are still
being computed (Note [Traced strategy]); the CPU test checks the same on C++ kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from _gpu import GPU, cuda0, one_rank_nccl
from launch.models import GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ddp_opt"))  # its CPU twin, in another package folder
from test_ddp_traced import (  # noqa: E402
    _check_fused_by_caps, _check_overlap_scheduled, _check_parity, _collective_orders, _traced_rank)

pytestmark = [*GPU, pytest.mark.usefixtures("clean_dynamo")]

CFG = GPTConfig(n_layer=2, n_embd=64, n_head=2, vocab_size=128, block_size=16)
CAP_MB = 0.02  # ~20 KiB: several buckets in this model's 0.5 MiB of gradients


def _traced_on_gpu(rank: int, world_size: int) -> tuple[dict, list[str]]:
    from torch._inductor.utils import run_and_get_code  # every graph Inductor compiles while fn runs

    result, codes = run_and_get_code(_traced_rank, rank, world_size, "inductor", CFG, CAP_MB, None,
                                     device=cuda0())
    return result, _collective_orders(codes)


def test_two_ranks_sharing_one_gpu_traced_match_eager_ddp_and_overlap(run_ranks):
    both = run_ranks(_traced_on_gpu, world_size=2, timeout=600)
    _check_parity([result for result, _ in both])
    for result, orders in both:
        _check_fused_by_caps(result, CAP_MB)
        _check_overlap_scheduled(orders)


def test_one_rank_over_nccl_traced_matches_eager_ddp_and_overlaps():
    with one_rank_nccl():
        result, orders = _traced_on_gpu(0, 1)
    _check_parity([result])
    _check_fused_by_caps(result, CAP_MB)
    _check_overlap_scheduled(orders)
