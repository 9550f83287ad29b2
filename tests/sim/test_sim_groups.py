"""Grouped rounds (protocol/groups.py, sim/groups.py): the partition, the contraction law, the capture law, and G = N as SSGD."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx.protocol.groups import capture_probability, contraction, draw_groups, expected_captures
from phalanx.sim.config import Budget, ByzantineConfig, SimConfig
from phalanx.sim.groups import spread
from phalanx.sim.runner import run_sim


@pytest.mark.parametrize(("n", "size"), [(512, 16), (10, 3), (7, 7), (33, 8)])
def test_groups_partition_the_peers_into_near_equal_groups_of_at_most_g(n, size):
    groups = draw_groups(n, size, seed=3, round_=5)
    assert sorted(w for g in groups for w in g) == list(range(n))
    sizes = [len(g) for g in groups]
    assert max(sizes) <= size and max(sizes) - min(sizes) <= 1 and len(groups) == math.ceil(n / size)
    assert draw_groups(n, size, seed=3, round_=5) == groups  # a function of (seed, round) only


def test_groups_are_redrawn_every_round():
    assert draw_groups(64, 8, seed=0, round_=0) != draw_groups(64, 8, seed=0, round_=1)
    assert draw_groups(64, 8, seed=0, round_=0) != draw_groups(64, 8, seed=1, round_=0)


def test_averaging_in_random_groups_contracts_the_spread_as_stated():
    """E[Σ‖e'‖²] / Σ‖e‖² = (N − G) / (G (N − 1)) for every spread e, averaged over the partitions."""
    n, size, rounds = 48, 6, 400
    e = torch.randn(n, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    e -= e.mean(dim=0)
    ratios = []
    for r in range(rounds):
        after = e.clone()
        for g in draw_groups(n, size, seed=0, round_=r):
            after[g] = e[g].mean(dim=0)
        ratios.append(float(after.square().sum() / e.square().sum()))
    assert sum(ratios) / rounds == pytest.approx(contraction(n, size), rel=0.05)
    assert contraction(n, n) == 0.0


def test_capture_probability_is_the_hypergeometric_tail():
    # 10 peers, 5 Byzantine, groups of 3: a majority is 2 or 3 of them: (C(5,2)·C(5,1) + C(5,3)) / C(10,3)
    assert capture_probability(10, 5, 3) == pytest.approx((10 * 5 + 10) / 120)
    assert capture_probability(512, 0, 16) == 0.0
    assert capture_probability(512, 102, 512) == 0.0  # one group of all: 102 of 512 is no majority
    assert expected_captures(512, 102, 16, 150) == pytest.approx(150 * 32 * capture_probability(512, 102, 16))


def test_one_group_of_all_with_the_mean_is_synchronous_sgd():
    budget = Budget(kind="updates", amount=12)
    grouped = run_sim(SimConfig(method="grouped", workers=6, budget=budget, eval_points=2))
    ssgd = run_sim(SimConfig(method="ssgd", workers=6, budget=budget, eval_points=2, momentum=0.9))
    torch.testing.assert_close(grouped.params, ssgd.params, rtol=1e-4, atol=1e-5)
    assert grouped.final_spread < 1e-6 and grouped.captured_groups == 0  # identical up to rounding


def test_random_groups_keep_honest_peers_close():
    config = SimConfig(
        method="grouped", workers=24, group_size=4, budget=Budget(kind="updates", amount=30), eval_points=3
    )
    result = run_sim(config)
    assert 0.0 < result.final_spread < 0.05 and result.captured_groups == 0
    assert abs(result.worst_peer_accuracy - result.final_accuracy) < 0.05
    assert run_sim(config).params.equal(result.params)  # seeded: the same run twice


def test_groups_with_a_byzantine_majority_are_counted():
    n, size, b, rounds = 24, 4, 8, 10
    config = SimConfig(
        method="grouped", workers=n, group_size=size, budget=Budget(kind="updates", amount=rounds), eval_points=2,
        aggregator="centered_clip:tau=1", byzantine=ByzantineConfig(count=b, attack="alie"),
    )  # fmt: skip
    bad = set(range(n - b, n))  # the last b peers attack
    captured = sum(
        2 * len(bad.intersection(g)) > len(g) for r in range(rounds) for g in draw_groups(n, size, seed=0, round_=r)
    )
    assert captured > 0
    assert run_sim(config).captured_groups == captured


def test_spread_is_relative_to_the_mean():
    models = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    assert spread(models) == pytest.approx(0.5)
