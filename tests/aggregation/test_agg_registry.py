"""AGGREGATORS and make_aggregator (aggregation/registry.py): names, parameters, errors."""

from __future__ import annotations

import pytest
import torch

from phalanx.aggregation.names import AGGREGATOR_NAMES
from phalanx.aggregation.registry import AGGREGATORS, BoundAggregator, Registry, make_aggregator, typical_params
from phalanx.errors import ConfigError

STABLE_NAMES = [
    "mean",
    "centered_clip",
    "median",
    "trimmed_mean",
    "krum",
    "multi_krum",
    "geometric_median",
    "bucketing",
]
VALID = "mean, centered_clip, median, trimmed_mean, krum, multi_krum, geometric_median, bucketing"


def test_stable_names():
    assert list(AGGREGATORS) == STABLE_NAMES


def test_the_torch_free_name_list_is_the_registry():
    assert AGGREGATOR_NAMES == tuple(AGGREGATORS)


@pytest.mark.parametrize("n", [4, 5, 8, 16])
def test_every_rule_runs_with_its_typical_parameters(n):
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
    for name in AGGREGATORS:
        assert make_aggregator(name, **typical_params(name, n))(x).value.shape == (16,)


def test_typical_parameters_of_an_unknown_rule_list_the_valid_names():
    with pytest.raises(ConfigError, match=f"unknown aggregator 'nope'; valid names: {VALID}"):
        typical_params("nope", 4)


def test_make_aggregator_binds_parameters():
    agg = make_aggregator("centered_clip", tau=1.0)
    assert isinstance(agg, BoundAggregator)
    assert (agg.name, dict(agg.params)) == ("centered_clip", {"tau": 1.0})
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    assert agg(x).value.shape == (3,)
    assert make_aggregator("trimmed_mean", b=2)(x).value.shape == (3,)


def test_bucketing_wraps_another_rule_by_name_and_forwards_its_parameters():
    agg = make_aggregator("bucketing", s=2, inner="centered_clip", tau=1.0, seed=3)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    assert agg(x).iterations >= 1


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("centred_clip", {}, f"unknown aggregator 'centred_clip'; valid names: {VALID}"),
        (
            "centered_clip",
            {"tauu": 1.0},
            "aggregator 'centered_clip': unknown parameter 'tauu'; valid parameters: tau, eps, max_iter",
        ),
        ("centered_clip", {}, "aggregator 'centered_clip': missing required parameter 'tau'"),
        (
            "centered_clip",
            {"tau": -1.0},
            "aggregator 'centered_clip': tau must be a positive number (inf gives the mean), got -1.0",
        ),
        ("trimmed_mean", {"b": -1}, "aggregator 'trimmed_mean': b must be an integer >= 0, got -1"),
        ("multi_krum", {"b": 1, "m": 0}, "aggregator 'multi_krum': m must be an integer >= 1, got 0"),
        ("median", {"b": 1}, "aggregator 'median': unknown parameter 'b'; valid parameters: none"),
        ("geometric_median", {"nu": 0}, "aggregator 'geometric_median': nu must be a positive finite number, got 0"),
        (
            "bucketing",
            {"s": 2, "inner": "nope"},
            f"aggregator 'bucketing': inner: unknown aggregator 'nope'; valid names: {VALID.removesuffix(', bucketing')}",
        ),
        (
            "bucketing",
            {"s": 2, "inner": "centered_clip", "tau": 0},
            "aggregator 'bucketing': aggregator 'centered_clip': tau must be a positive number (inf gives the mean), got 0",
        ),
        (
            "bucketing",
            {"s": 2, "inner": "bucketing"},
            "aggregator 'bucketing': inner must be another aggregator than 'bucketing'",
        ),
        ("bucketing", {"s": 0, "inner": "mean"}, "aggregator 'bucketing': s must be an integer >= 1, got 0"),
    ],
)
def test_config_errors_name_the_problem(name, params, message):
    with pytest.raises(ConfigError) as e:
        make_aggregator(name, **params)
    assert str(e.value) == message


def test_duplicate_registration_raises():
    reg: Registry[int] = Registry("widget")
    reg.register("a", 1)
    with pytest.raises(ConfigError) as e:
        reg.register("a", 2)
    assert str(e.value) == "widget 'a' is already registered"
    with pytest.raises(ConfigError) as e:
        AGGREGATORS.register("mean", lambda: None)
    assert str(e.value) == "aggregator 'mean' is already registered"
    assert reg["a"] == 1 and len(reg) == 1


PERM_PARAMS = {
    "centered_clip": {"tau": 1.0},
    "trimmed_mean": {"b": 2},
    "krum": {"b": 2},
    "multi_krum": {"b": 2, "m": 3},
    "bucketing": {"s": 2, "inner": "mean"},  # a random partition: only its mean is order-free exactly
}


@pytest.mark.parametrize("name", STABLE_NAMES)
@pytest.mark.parametrize("weighted", [False, True])
def test_every_aggregator_is_permutation_invariant(name, weighted, device):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(10, 64, generator=g, dtype=torch.float64) + 3.0).to(device)
    x[:2] *= -40.0
    w = (torch.rand(10, generator=g, dtype=torch.float64) + 0.5).to(device) if weighted else None
    perm = torch.randperm(10, generator=g).to(device)
    agg = make_aggregator(name, **PERM_PARAMS.get(name, {}))
    a = agg(x, w).value
    b = make_aggregator(name, **PERM_PARAMS.get(name, {}))(x[perm], None if w is None else w[perm]).value
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
