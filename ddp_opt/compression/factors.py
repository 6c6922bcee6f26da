"""PowerSGD's products with its rank-r factors and its orthogonalisation, shared by the
hook under DDP's reducer (``bucket_powersgd``) and the traced form (``traced_powersgd``).

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

__all__ = ["orthogonalize", "project", "project_back"]


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
