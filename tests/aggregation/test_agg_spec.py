"""The one name:key=value syntax (aggregation.spec)."""

import math

import pytest

from phalanx.aggregation.spec import parse_aggregator_params, parse_spec
from phalanx.errors import ConfigError


@pytest.mark.parametrize(
    "text, expected",
    [
        ("mean", ("mean", {})),
        ("centered_clip:tau=1", ("centered_clip", {"tau": 1})),
        (" bucketing: s=2, inner=mean ", ("bucketing", {"s": 2, "inner": "mean"})),
        ("sign_flip:scale=-1e3", ("sign_flip", {"scale": -1000.0})),
    ],
)
def test_parse_spec(text, expected):
    assert parse_spec(text, "--aggregator") == expected


def test_inf_is_a_number():
    assert math.isinf(parse_spec("x:tau=inf", "what")[1]["tau"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "--x must be a name like 'mean' or 'centered_clip:tau=1', got ''"),
        ("mean:tau", "--x='mean:tau': parameters go as key=value after ':', e.g. centered_clip:tau=1"),
        ("mean:=1", "--x='mean:=1': parameters go as key=value after ':'"),
    ],
)
def test_parse_spec_errors(text, message):
    with pytest.raises(ConfigError) as info:
        parse_spec(text, "--x")
    assert message in str(info.value)


def test_aggregator_numbers_are_floats_and_sorted():
    assert parse_aggregator_params("tau=1,eps=1e-6") == (("eps", 1e-6), ("tau", 1.0))
    assert parse_aggregator_params("s=2,inner=mean", "bucketing") == (("inner", "mean"), ("s", 2.0))


@pytest.mark.parametrize(
    "text, aggregator, message",
    [
        ("tau", "centered_clip", "--aggregator-params takes name=number pairs like tau=1, not 'tau'"),
        ("tau=mean", "centered_clip", "--aggregator-params takes name=number pairs like tau=1, not 'tau=mean'"),
        ("s=two", "bucketing", "not 's=two' (--aggregator bucketing takes a name for inner)"),
    ],
)
def test_aggregator_text_only_where_a_rule_is_named(text, aggregator, message):
    with pytest.raises(ConfigError) as info:
        parse_aggregator_params(text, aggregator)
    assert message in str(info.value)
