"""PowerSGD's rule for which gradients it compresses, its products with its rank-r factors,
its orthogonalisation and one matrix's power iteration, shared by the hook under DDP's
reducer (``bucket_powersgd``), the traced form (``ddp_opt.strategies.traced.powersgd``), the cost model's
timing of the hook and the benchmarks' limit.

Note [Products with a rank-r factor]
    ``P = M Q`` and ``Q = M^T P`` take a gradient matrix M (n x m) and a factor of r
    columns (r of 1 to 8). Taken as written, each is a product whose output has r columns,
    which runs a slow kernel on the CPU; taken transposed, ``M Q = (Q^T M^T)^T`` and
    ``M^T P = (P^T M)^T``, the same sums run a fast one. Measured on this project's machine
    (one thread, float32): ``M^T P`` of a 256 x 1024 gradient took 1.2 ms, ``(P^T M)^T``
    0.13 ms; ``M Q`` of a 1024 x 256 one 0.44 and 0.13 ms. The results differ from the plain
    products by float rounding only.
"""

from __future__ import annotations

import torch

__all__ = ["MIN_COMPRESSION_RATE", "compressed_shape", "orthogonalize", "power_iteration", "project",
           "project_back"]

MIN_COMPRESSION_RATE = 2  # PyTorch's PowerSGDState default: compress when (n + m) r * 2 < n m


def compressed_shape(param: torch.Tensor, rank: int) -> tuple[int, int, int] | None:
    """PyTorch's hook's rule: ``(rows, columns, rank used)`` of the matrix that ``param``'s gradient
    is sent as P and Q of, or None where it is sent whole (fewer than 2 dimensions, or P and Q not
    ``MIN_COMPRESSION_RATE`` times smaller than the matrix)."""
    n = param.shape[0] if param.dim() else 1
    m = param.numel() // max(n, 1)
    r = min(n, m, rank)
    return (n, m, r) if param.dim() >= 2 and (n + m) * r * MIN_COMPRESSION_RATE < n * m else None


def project(matrix: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``matrix @ q`` (``q`` of few columns) computed as ``(q^T matrix^T)^T`` (Note [Products with a rank-r
    factor])."""
    return (q.t() @ matrix.t()).t()


def project_back(matrix: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``matrix.t() @ p`` (``p`` of few columns) computed as ``(p^T matrix)^T`` (Note [Products with a rank-r
    factor])."""
    return (p.t() @ matrix).t()


def orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix``'s columns made orthonormal, as PyTorch's hook does (``_orthogonalize``):
    Gram-Schmidt for at most 2 columns and for half dtypes, QR otherwise."""
    if matrix.shape[1] > 2 and matrix.dtype not in (torch.float16, torch.bfloat16):
        return torch.linalg.qr(matrix).Q
    cols = []
    for i in range(matrix.shape[1]):
        col = matrix[:, i:i + 1]
        for done in cols:
            col = col - (done * col).sum(dim=0, keepdim=True) * done
        cols.append(col / col.norm(dim=0, keepdim=True))
    return torch.cat(cols, dim=1)


def power_iteration(grad: torch.Tensor, error: torch.Tensor, q: torch.Tensor) -> None:
    """One step of PowerSGD's arithmetic on one gradient matrix, without its all-reduces, ``error``
    and ``q`` updated in place: ``M = grad + E``, ``P = M orth(Q)``, ``orth(P)``, ``Q = M^T P``,
    ``E = M - P Q^T``. What the cost model times as the hook's compute and the benchmarks' limit
    as the compression's."""
    matrix = grad + error
    p = orthogonalize(project(matrix, orthogonalize(q)))
    q.copy_(project_back(matrix, p))
    error.copy_(matrix - p @ q.t())
