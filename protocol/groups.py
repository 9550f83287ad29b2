"""Groups of bounded size: how a round splits N members into random groups of at most G, how fast
averaging in such groups brings the members onto one model, and how likely a group is to hold a
Byzantine majority (docs/algorithms.md §11). The live matchmaker and the simulator draw alike."""

from __future__ import annotations

import math

import torch

_GROUPS_STREAM = 0x6A0F
AGREE_SHRINK = 1e-6  # rounds_to_agree's target: the spread's mean square shrunk this much (its norm 1,000×)
MAX_AGREE_ROUNDS = 20


def draw_groups(n: int, size: int, seed: int, round_: int) -> list[list[int]]:
    """Round ``round_``'s partition of members 0..n−1: ⌈n/size⌉ groups whose sizes differ by at most one."""
    count = math.ceil(n / size)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + round_) * 31 + _GROUPS_STREAM)
    order = torch.randperm(n, generator=generator).tolist()
    return [sorted(order[k::count]) for k in range(count)]


def contraction(n: int, size: int) -> float:
    """E[Σ‖θ_i − θ̄‖²] after a round of plain averaging in random groups of ``size``, over the same before.

    A random subset of G of N points has E‖mean − θ̄‖² = σ²·(N − G)/(G·(N − 1)), σ² the mean
    square distance to θ̄; every member takes its group's mean.
    """
    if size >= n:
        return 0.0
    return (n - size) / (size * (n - 1))


def rounds_to_agree(n: int, size: int, shrink: float = AGREE_SHRINK) -> int:
    """Rounds of averaging alone that shrink the members' spread (its mean square) by ``shrink`` in
    expectation: 1 when one group holds everyone, at most MAX_AGREE_ROUNDS."""
    rho = contraction(n, size)
    if rho == 0.0:
        return 1
    return min(MAX_AGREE_ROUNDS, math.ceil(math.log(shrink) / math.log(rho)))


def capture_probability(n: int, b: int, size: int) -> float:
    """P(a group of ``size`` drawn from n members, b of them Byzantine, has a Byzantine majority): hypergeometric."""
    size = min(size, n)
    hits = range(size // 2 + 1, min(b, size) + 1)
    return sum(math.comb(b, k) * math.comb(n - b, size - k) for k in hits) / math.comb(n, size)


def expected_captures(n: int, b: int, size: int, rounds: int) -> float:
    """Expected groups with a Byzantine majority over ``rounds`` rounds (each group is a uniform random subset)."""
    sizes = [len(g) for g in draw_groups(n, size, 0, 0)]
    return rounds * sum(capture_probability(n, b, s) for s in sizes)
