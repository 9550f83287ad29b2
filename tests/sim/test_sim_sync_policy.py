"""protocol/sync_policy.py: documented K sequences for given time and loss traces, parser and errors."""

from __future__ import annotations

import math

import pytest

from phalanx.errors import ConfigError
from phalanx.protocol.sync_policy import (
    SYNC_POLICIES,
    VALID_FORMS,
    AdaSync,
    FixedK,
    FullSync,
    HybridThreshold,
    parse_sync_policy,
    register_sync_policy,
)


def test_registry_names_are_stable():
    assert list(SYNC_POLICIES) == ["full", "k", "hybrid", "adasync"]


def test_duplicate_registration_raises():
    with pytest.raises(ConfigError, match="sync policy 'full' is already registered"):
        register_sync_policy(FullSync)


def test_full_and_fixed_k():
    assert [FullSync().k(n, 0.0) for n in (1, 8, 32)] == [1, 8, 32]
    assert [FixedK(4).k(n, 0.0) for n in (1, 4, 16)] == [1, 4, 4]  # capped at N


@pytest.mark.parametrize(
    ("shape", "times", "expected"),
    [
        # s = t/10, K = max(1, ⌈8·s⌉)
        ("linear", [0, 0.5, 1.25, 2.5, 5, 9.9, 10, 50], [1, 1, 1, 2, 4, 8, 8, 8]),
        # s = 1 − e^{−t/10}: 0, .049, .118, .221, .393, .632, .865, 1 − e^{−5}
        ("exp", [0, 0.5, 1.25, 2.5, 5, 10, 20, 50], [1, 1, 1, 2, 4, 6, 7, 8]),
    ],
)
def test_hybrid_sequences(shape, times, expected):
    policy = HybridThreshold(shape, 10.0)
    assert [policy.k(8, t) for t in times] == expected


def test_hybrid_ignores_float_noise_at_integers():
    # 3/10·10 workers is 3 up to rounding: K must be 3, not 4
    assert HybridThreshold("linear", 10.0).k(10, 3.0) == 3


def test_adasync_sequence():
    # K0 = 2, T0 = 10, N = 16. F(w0) = 2.0 from the first call.
    policy = AdaSync(2, 10.0)
    trace = [
        (0.0, 2.0, 2),  # start: K0
        (9.9, 0.5, 2),  # before the first check
        (10.0, 0.5, 4),  # √(2/0.5)·2 = 4
        (15.0, 0.02, 4),  # no check until t = 20
        (20.0, 0.125, 8),  # √16·2
        (55.0, 0.01, 16),  # one check for the periods 30, 40, 50: √200·2 = 28.3 → capped at N
        (59.0, 2.0, 16),  # next check at 60
        (60.0, 2.0, 2),  # the loss came back up: K falls again
    ]
    assert [policy.k(16, t, loss) for t, loss, _ in trace] == [k for _, _, k in trace]


def test_adasync_waits_for_a_loss_and_converged_loss_means_full_sync():
    policy = AdaSync(1, 5.0)
    assert policy.k(8, 0.0, None) == 1  # no F(w0) yet
    assert policy.k(8, 5.0, None) == 1  # a check without a loss keeps K
    assert policy.k(8, 6.0, 1.0) == 1  # F(w0) = 1.0 recorded; next check at 10
    assert policy.k(8, 10.0, 0.25) == 2
    assert policy.k(8, 20.0, 0.0) == 8


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("full", FullSync),
        ("k:3", FixedK),
        ("hybrid:linear:100", HybridThreshold),
        ("hybrid:exp:2.5", HybridThreshold),
        ("adasync:2:10", AdaSync),
    ],
)
def test_parse_round_trips(text, expected):
    policy = parse_sync_policy(text)
    assert isinstance(policy, expected)
    assert policy.spec == text
    assert parse_sync_policy(policy.spec).spec == text


def test_parse_gives_fresh_state():
    a = parse_sync_policy("adasync:1:1")
    a.k(4, 0.0, 1.0)
    b = parse_sync_policy("adasync:1:1")
    assert b.f0 is None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("sync", None),
        ("full:2", "'full' takes no fields"),
        ("k", "'k' takes one field, K"),
        ("k:0", "K must be an integer >= 1, got 0"),
        ("k:two", "K must be an integer, got 'two'"),
        ("hybrid:cubic:10", "hybrid shape must be one of linear, exp, got 'cubic'"),
        ("hybrid:linear:0", "T must be a positive finite number, got 0.0"),
        ("hybrid:linear", "'hybrid' takes two fields, shape and T"),
        ("adasync:0:10", "K0 must be an integer >= 1, got 0"),
        ("adasync:2:inf", "T0 must be a positive finite number, got inf"),
    ],
)
def test_parse_errors_name_the_valid_forms(text, reason):
    with pytest.raises(ConfigError) as info:
        parse_sync_policy(text)
    if reason is None:
        assert str(info.value) == f"unknown sync policy {text!r}; valid forms: {VALID_FORMS}"
    else:
        assert str(info.value) == f"sync policy {text!r} is not valid ({reason}); valid forms: {VALID_FORMS}"


def test_policies_reject_bad_n():
    with pytest.raises(ConfigError, match="n \\(number of workers\\) must be an integer >= 1, got 0"):
        FullSync().k(0, 0.0)
    assert not math.isnan(HybridThreshold("exp", 1.0).share(-5.0))
