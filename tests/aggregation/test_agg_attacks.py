"""Attacks (aggregation/attacks.py): shapes, formulas, seeding, registry."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx.aggregation.attacks import ATTACKS, alie, alie_z, apply_attack, make_attack
from phalanx.errors import AggregationInputError, ConfigError

STABLE = ["sign_flip", "random_direction", "constant_direction", "ipm", "alie", "gaussian", "nan", "inf"]


def _honest():
    return torch.randn(7, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 1.0


def test_stable_names():
    assert list(ATTACKS) == STABLE


@pytest.mark.parametrize("name", STABLE)
def test_shape_device_dtype(name, device):
    honest = _honest().to(device)
    gen = torch.Generator().manual_seed(1)
    out = ATTACKS[name](honest, 3, generator=gen)
    assert out.shape == (3, 50) and out.device == honest.device and out.dtype == honest.dtype
    assert ATTACKS[name](honest, 0, generator=gen).shape == (0, 50)


def test_formulas():
    honest = _honest()
    gen = torch.Generator().manual_seed(1)
    mu = honest.mean(dim=0)
    torch.testing.assert_close(ATTACKS["sign_flip"](honest, 2, generator=gen, scale=-1000.0)[1], -1000 * mu)
    torch.testing.assert_close(ATTACKS["ipm"](honest, 2, generator=gen, eps=0.5)[0], -0.5 * mu)
    torch.testing.assert_close(alie(honest, 2, generator=gen, z=1.5)[0], mu - 1.5 * honest.std(dim=0))
    for name in ("random_direction", "constant_direction"):
        rows = ATTACKS[name](honest, 3, generator=gen)
        torch.testing.assert_close(rows.norm(dim=1), torch.full((3,), 1000 * float(mu.norm()), dtype=torch.float64))
    assert ATTACKS["constant_direction"](honest, 3, generator=gen).unique(dim=0).shape[0] == 1
    assert ATTACKS["random_direction"](honest, 3, generator=gen).unique(dim=0).shape[0] == 3
    assert torch.isnan(ATTACKS["nan"](honest, 1, generator=gen)).all()
    assert torch.isinf(ATTACKS["inf"](honest, 1, generator=gen)).all()


def test_alie_z_follows_a_little_is_enough():
    # n = 50, b = 12 (the paper's CIFAR setting): s = 26 − 12 = 14, z = Φ⁻¹(36/50) ≈ 0.58
    assert alie_z(50, 12) == pytest.approx(0.5828, abs=1e-4)
    # n = 19, b = 6: s = 10 − 6 = 4, z = Φ⁻¹(15/19)
    assert alie_z(19, 6) == pytest.approx(0.8046, abs=1e-4)
    with pytest.raises(AggregationInputError) as e:
        alie_z(10, 6)
    assert str(e.value) == "alie_z needs 0 <= b <= n/2 and n > 1, got n=10 and b=6"


def test_seeded_attacks_are_deterministic():
    honest = _honest()
    a = ATTACKS["gaussian"](honest, 2, generator=torch.Generator().manual_seed(5))
    b = ATTACKS["gaussian"](honest, 2, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_make_attack_and_apply_attack():
    honest = _honest()
    x = apply_attack("sign_flip", honest, 2, generator=torch.Generator(), scale=-1.0)
    assert x.shape == (9, 50) and torch.equal(x[:7], honest)
    with pytest.raises(ConfigError) as e:
        make_attack("sign_flip", eps=1.0)
    assert str(e.value) == "attack 'sign_flip': unknown parameter 'eps'; valid parameters: scale"
    with pytest.raises(ConfigError) as e:
        make_attack("signflip")
    assert str(e.value) == f"unknown attack 'signflip'; valid names: {', '.join(STABLE)}"
    with pytest.raises(AggregationInputError) as e:
        ATTACKS["alie"](honest, 1, generator=torch.Generator(), z=math.nan)
    assert str(e.value) == "z must be a finite number, got nan"
