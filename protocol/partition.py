"""Cut a flat vector into one contiguous part per group member (member i reduces part i)."""

from __future__ import annotations


def partition_bounds(numel: int, n_parts: int) -> list[tuple[int, int]]:
    """[start, end) of each part; sizes differ by at most one element, larger parts first."""
    if n_parts <= 0:
        raise ValueError(f"n_parts must be positive, got {n_parts}")
    if numel < 0:
        raise ValueError(f"numel must be non-negative, got {numel}")
    base, extra = divmod(numel, n_parts)
    bounds, start = [], 0
    for i in range(n_parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
