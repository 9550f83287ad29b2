"""ClippedGossip (aggregation/gossip.py): loop reference, clipping bound, adaptive τ."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx.aggregation.gossip import adaptive_gossip_tau, clipped_gossip_update
from phalanx.errors import AggregationInputError


def loop_update(x_i, nbrs, w, tau):
    out = x_i.clone()
    for j in range(nbrs.shape[0]):
        z = nbrs[j] - x_i
        out += w[j] * z * min(1.0, tau / float(z.norm()))
    return out


@pytest.mark.parametrize("tau", [0.1, 1.0, math.inf])
def test_matches_loop(tau, device):
    g = torch.Generator().manual_seed(0)
    x_i, nbrs = torch.randn(20, generator=g, dtype=torch.float64), torch.randn(4, 20, generator=g, dtype=torch.float64)
    w = torch.tensor([0.1, 0.2, 0.3, 0.25], dtype=torch.float64)
    got = clipped_gossip_update(x_i.to(device), nbrs.to(device), w.to(device), tau).value
    torch.testing.assert_close(got.cpu(), loop_update(x_i, nbrs, w, tau))


def test_a_byzantine_neighbour_moves_x_by_at_most_w_tau():
    x_i = torch.zeros(10, dtype=torch.float64)
    nbrs = torch.zeros(3, 10, dtype=torch.float64)
    nbrs[2] = 1e9
    got = clipped_gossip_update(x_i, nbrs, torch.tensor([0.3, 0.3, 0.3], dtype=torch.float64), 2.0).value
    assert float(got.norm()) == pytest.approx(0.3 * 2.0)


def test_non_finite_neighbour_is_excluded_and_its_weight_stays_home():
    x_i = torch.zeros(4)
    nbrs = torch.stack([torch.ones(4), torch.full((4,), math.nan)])
    result = clipped_gossip_update(x_i, nbrs, torch.tensor([0.5, 0.5]), math.inf)
    assert result.excluded == (1,)
    assert result.value.tolist() == [0.5] * 4


def test_adaptive_tau_rule():
    x_i = torch.zeros(3, dtype=torch.float64)
    nbrs = torch.tensor([[1.0, 0, 0], [0, 2.0, 0], [0, 0, 100.0]], dtype=torch.float64)
    w = torch.tensor([0.25, 0.25, 0.25], dtype=torch.float64)
    # delta = 1/3 of the neighbour weight: keep the closest 2/3 (rows 0 and 1)
    tau = adaptive_gossip_tau(x_i, nbrs, w, delta=1 / 3)
    assert tau == pytest.approx(math.sqrt((0.25 * 1 + 0.25 * 4) / (1 / 3 * 0.75)))
    assert adaptive_gossip_tau(x_i, nbrs, w, delta=0.0) == math.inf
    moved = clipped_gossip_update(x_i, nbrs, w, tau).value
    assert float((moved - torch.tensor([0.25, 0.5, 0.0], dtype=torch.float64)).norm()) <= 0.25 * tau + 1e-12


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            (torch.zeros(3), torch.zeros(2, 3), torch.tensor([0.7, 0.7]), 1.0),
            "neighbour weights sum to 1.4; a mixing row's neighbour weights must sum to at most 1 (the rest is the self weight W_ii)",
        ),
        (
            (torch.zeros(4), torch.zeros(2, 3), torch.tensor([0.5, 0.5]), 1.0),
            "x_i must be a (d,) = (3,) tensor, got (4,)",
        ),
        (
            (torch.full((3,), math.nan), torch.zeros(2, 3), torch.tensor([0.5, 0.5]), 1.0),
            "x_i (this node's own vector) is not finite; fix the local state first",
        ),
        (
            (torch.zeros(3), torch.zeros(2, 3), torch.tensor([0.5, 0.5]), -1.0),
            "tau must be a positive number (inf gives plain gossip averaging), got -1.0",
        ),
    ],
)
def test_bad_inputs(args, message):
    with pytest.raises(AggregationInputError) as e:
        clipped_gossip_update(*args)
    assert str(e.value) == message
