"""Input validation and the non-finite-row rule (aggregation/base.py), through every aggregator."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx.aggregation.base import check_int, check_positive, prepare
from phalanx.aggregation.registry import AGGREGATORS, make_aggregator
from phalanx.errors import AggregationInputError, ConfigError

PARAMS = {
    "centered_clip": {"tau": 1.0},
    "trimmed_mean": {"b": 1},
    "krum": {"b": 1},
    "multi_krum": {"b": 1, "m": 2},
    "bucketing": {"s": 2, "inner": "mean"},
}


def agg(name: str):
    return make_aggregator(name, **PARAMS.get(name, {}))


@pytest.mark.parametrize(
    ("x", "message"),
    [
        ([[1.0, 2.0]], "x must be a torch.Tensor, got list"),
        (torch.zeros(3), "x must be a 2-D (n, d) tensor, got shape (3,)"),
        (torch.zeros(2, 3, 4), "x must be a 2-D (n, d) tensor, got shape (2, 3, 4)"),
        (torch.zeros(0, 5), "x is empty (shape (0, 5)); need at least one row and one column"),
        (torch.zeros(4, 0), "x is empty (shape (4, 0)); need at least one row and one column"),
        (torch.zeros(2, 2, dtype=torch.int64), "x must be float32 or float64, got torch.int64; convert with .float()"),
    ],
)
def test_bad_x_raises_with_exact_message(x, message):
    with pytest.raises(AggregationInputError) as e:
        prepare(x)
    assert str(e.value) == message


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([1.0, 1.0, 1.0], "weights must be a torch.Tensor or None, got list"),
        (torch.ones(2), "weights must have shape (n,) = (3,), got (2,)"),
        (torch.ones(3, 1), "weights must have shape (n,) = (3,), got (3, 1)"),
        (torch.tensor([1.0, -0.5, 1.0]), "weights must be >= 0, got a minimum of -0.5"),
        (torch.zeros(3), "weights are all zero; give at least one row a positive weight"),
        (torch.tensor([1.0, math.nan, 1.0]), "weights must be finite, got NaN or Inf"),
    ],
)
def test_bad_weights_raise_with_exact_message(weights, message):
    with pytest.raises(AggregationInputError) as e:
        prepare(torch.zeros(3, 4), weights)
    assert str(e.value) == message


def test_uniform_weights_become_none_and_nothing_is_copied():
    x = torch.randn(4, 5)
    rows = prepare(x, torch.full((4,), 0.25))
    assert rows.weights is None and rows.x is x and rows.excluded == ()


@pytest.mark.parametrize("name", list(AGGREGATORS))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e30])
def test_non_finite_rows_are_excluded_and_reported(name, bad, device, make_honest):
    x = make_honest(8, 16, seed=1, dtype=torch.float32).to(device)  # 1e30 overflows float32's squared norm
    clean = torch.cat([x[:2], x[3:5], x[6:]])
    x[2, 3] = bad
    x[5, 0] = bad
    result = agg(name)(x)
    assert result.excluded == (2, 5)
    assert torch.isfinite(result.value).all()
    assert result.value.device == x.device and result.value.dtype == x.dtype
    if name != "bucketing":  # bucketing draws a different permutation for 6 rows than for 8
        params = dict(PARAMS.get(name, {}))
        if "b" in params:  # each excluded row is a Byzantine row found: b drops by 2 (to 0)
            params["b"] = max(0, params["b"] - 2)
        expected = make_aggregator(name, **params)(clean).value
        torch.testing.assert_close(result.value, expected)


@pytest.mark.parametrize("name", list(AGGREGATORS))
def test_all_rows_non_finite_raises(name, device):
    x = torch.full((6, 3), math.nan, device=device)
    x[1] = math.inf
    with pytest.raises(AggregationInputError) as e:
        agg(name)(x)
    assert str(e.value) == (
        "all 6 rows of x are non-finite (NaN/Inf or norm above 4.61e+18); nothing is left to aggregate"
    )


def test_rows_left_with_zero_weight_raise():
    x = torch.ones(3, 2)
    x[0, 0] = math.nan
    with pytest.raises(AggregationInputError) as e:
        prepare(x, torch.tensor([1.0, 0.0, 0.0]))
    assert str(e.value) == (
        "the rows left after excluding non-finite rows [0] all have weight 0; nothing is left to aggregate"
    )


def test_zero_weight_rows_are_dropped_on_request():
    x = torch.arange(12.0).view(4, 3)
    rows = prepare(x, torch.tensor([1.0, 0.0, 2.0, 0.0]), drop_zero_weight=True)
    assert torch.equal(rows.x, x[[0, 2]])
    assert torch.equal(rows.weights, torch.tensor([1.0, 2.0]))
    assert rows.excluded == ()


def test_integral_floats_pass_as_ints():
    # config parsers (e.g. --aggregator-params b=2) hand over floats
    assert check_int("b", 2.0, minimum=0) == 2 and isinstance(check_int("b", 2.0, minimum=0), int)
    assert make_aggregator("trimmed_mean", b=2.0)(torch.randn(5, 3)).value.shape == (3,)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: check_positive("tau", -1.0, allow_inf=True, hint="inf gives the mean"),
            "tau must be a positive number (inf gives the mean), got -1.0",
        ),
        (lambda: check_positive("nu", math.inf), "nu must be a positive finite number, got inf"),
        (lambda: check_positive("nu", "a"), "nu must be a number, got 'a'"),
        (lambda: check_int("b", -1, minimum=0), "b must be an integer >= 0, got -1"),
        (lambda: check_int("b", True, minimum=0), "b must be an integer >= 0, got True"),
        (lambda: check_int("b", 1.5, minimum=0), "b must be an integer >= 0, got 1.5"),
    ],
)
def test_parameter_checks(call, message):
    with pytest.raises(AggregationInputError) as e:
        call()
    assert str(e.value) == message
    assert isinstance(e.value, ConfigError)
