"""Row-span arithmetic: distances between rows and points in their span from one pass over x.

CenteredClip, Weiszfeld and Krum only ever need distances between the rows x_i and points
v = a + Σ_j β_j (x_j − a) in their affine span. With the centered Gram matrix
G_ij = ⟨x_i − a, x_j − a⟩ (one read of x) every such distance is
‖x_i − v‖² = G_ii − 2(Gβ)_i + βᵀGβ, so iterations run on n×n numbers in float64 and x is
read once more at the end to form v. Centering at a robust anchor avoids the cancellation
of ‖x_i‖² − 2⟨x_i, v⟩ + ‖v‖² in float32. Cost: n²·d flops once (below a few reads of x for
the n ≤ 64 of an averaging group).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def column_chunk(n: int, d: int) -> int:
    """Columns per chunk: at most 131072 and about 4M elements per (n, chunk) temporary.

    Measured on CPU: larger chunks amortize per-call overhead until the temporary leaves
    the cache (and, when freshly allocated each time, costs page faults).
    """
    return min(d, max(4096, min(131072, (1 << 22) // max(n, 1))))


def _gram_dtype(x: Tensor) -> torch.dtype:
    # On CUDA, TF32/bf16 matmuls ("high"/"medium" precision) would ruin the distances.
    if x.is_cuda and x.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return torch.float64
    return x.dtype


def centered_gram(x: Tensor, anchor: Tensor) -> np.ndarray:
    """G_ij = ⟨x_i − a, x_j − a⟩ as an (n, n) float64 numpy array; one read of x, no (n, d) temporary."""
    n, d = x.shape
    chunk = column_chunk(n, d)
    dtype = _gram_dtype(x)
    gram = torch.zeros(n, n, dtype=torch.float64, device=x.device)
    buf = torch.empty(n, chunk, dtype=x.dtype, device=x.device)  # reused: no allocation per chunk
    for start in range(0, d, chunk):
        stop = min(d, start + chunk)
        y = torch.sub(x[:, start:stop], anchor[start:stop], out=buf[:, : stop - start]).to(dtype)
        gram += (y @ y.T).to(torch.float64)  # partial sums accumulate in float64
    return gram.cpu().numpy()  # sync point on CUDA (n×n numbers)


def combine(x: Tensor, anchor: Tensor, beta: np.ndarray) -> Tensor:
    """v = a + Σ_j β_j (x_j − a) = (1 − Σβ)·a + βᵀx: one read of x, result in x's dtype.

    The uncentered form is safe here: its rounding is that of v itself in x's dtype.
    """
    coef = torch.from_numpy(np.ascontiguousarray(beta)).to(device=x.device, dtype=x.dtype)
    v = coef @ x  # (d,)
    rest = 1.0 - float(beta.sum())
    if rest != 0.0:
        v.add_(anchor, alpha=rest)
    return v


def row_sq_dists(x: Tensor, v: Tensor) -> Tensor:
    """‖x_i − v‖² for every row, computed directly (no cancellation) with float64 sums: (n,) float64.

    The exact reference that checks (verification, tests, gossip) use; reads x once.
    """
    n, d = x.shape
    chunk = column_chunk(n, d)
    out = torch.zeros(n, dtype=torch.float64, device=x.device)
    for start in range(0, d, chunk):
        y = x[:, start : start + chunk] - v[start : start + chunk]  # (n, chunk) temporary
        out += y.square().sum(dim=1, dtype=torch.float64)
    return out


def weighted_row_sum(x: Tensor, v: Tensor, coef: Tensor) -> Tensor:
    """Σ_i coef_i (x_i − v) with float64 accumulation: (d,) float64. Reads x once."""
    n, d = x.shape
    chunk = column_chunk(n, d)
    c64 = coef.to(device=x.device, dtype=torch.float64)
    out = torch.empty(d, dtype=torch.float64, device=x.device)
    for start in range(0, d, chunk):
        y = (x[:, start : start + chunk] - v[start : start + chunk]).to(torch.float64)
        out[start : start + chunk] = c64 @ y
    return out


def median_norm_row(norms: Tensor) -> int:
    """Index of the row whose norm is the (lower) median: a cheap, usually honest anchor.

    The anchor only affects rounding, never the result of the math.
    """
    return int(torch.argsort(norms)[(norms.shape[0] - 1) // 2])


def distances_to_point(gram: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """‖x_i − v‖ for v = a + Σ β_j (x_j − a), from the centered Gram: (n,) float64."""
    q = gram @ beta
    sq = np.diag(gram) - 2.0 * q + beta @ q
    return np.sqrt(np.maximum(sq, 0.0))  # rounding can push a tiny square below 0


def pairwise_sq_dists(gram: np.ndarray) -> np.ndarray:
    """‖x_i − x_j‖² for all pairs from the centered Gram: (n, n) float64, zero diagonal."""
    diag = np.diag(gram)
    sq = diag[:, None] + diag[None, :] - 2.0 * gram
    np.fill_diagonal(sq, 0.0)
    return np.maximum(sq, 0.0)


def span_norm(gram: np.ndarray, beta: np.ndarray) -> float:
    """‖Σ_j β_j (x_j − a)‖ from the centered Gram (the length of a step written in span coordinates)."""
    return float(np.sqrt(max(float(beta @ gram @ beta), 0.0)))
