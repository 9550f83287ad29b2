"""`phalanx bench diloco`'s arithmetic: what a run spent in rounds, a case's row, what --verify costs."""

import pytest

from phalanx.peer.bench.swarm import rounds_cost_s, summarize_case, verification_cost


def _outer(step: int, round_s: float) -> dict:
    return {"event": "outer", "outer_step": step, "round_s": round_s, "t": 0.0}


def test_rounds_cost_takes_each_outer_steps_last_arrival_and_sums_them():
    events = [
        _outer(1, 0.30), _outer(1, 0.05), _outer(1, 0.12),  # the member that came last waited 0.05 s
        _outer(2, 0.07), _outer(2, 0.50),
        {"event": "eval", "step": 100, "loss": 2.6, "t": 0.0},
        {"event": "step", "step": 100, "t": 0.0},
    ]  # fmt: skip
    assert rounds_cost_s(events) == pytest.approx(0.12)


def test_rounds_cost_of_a_run_without_outer_steps_is_unknown_not_zero():
    assert rounds_cost_s([{"event": "eval", "step": 10, "loss": 2.0, "t": 0.0}]) is None


def _run(time_s, rounds_s=0.2, **fields) -> dict:
    return {"time_s": time_s, "rounds_s": rounds_s, "steps": 200, "bytes_sent": 1000, "rounds": 4, "failures": 0, **fields}


def test_a_case_has_a_time_only_if_every_run_reached_the_target():
    row = summarize_case("x", [_run(10.0), _run(12.0), _run(11.0)])
    assert (row["time_s"], row["spread"], row["times"]) == (11.0, (10.0, 12.0), [10.0, 12.0, 11.0])
    missed = summarize_case("x", [_run(10.0), _run(None)])
    assert missed["time_s"] is None and missed["spread"] is None


def test_a_case_has_a_rounds_time_only_if_every_run_has_one():
    assert summarize_case("x", [_run(10.0, 0.1), _run(10.0, 0.3)])["rounds_s"] == pytest.approx(0.2)
    assert summarize_case("x", [_run(10.0, 0.1), _run(10.0, None)])["rounds_s"] is None


def test_verification_cost_pairs_runs_by_order_and_charges_only_the_extra_round_time():
    unverified = summarize_case("int8", [_run(10.0, 0.2), _run(20.0, 0.2), _run(12.0, 0.2)])
    verified = summarize_case("verify", [_run(11.0, 0.6), _run(18.0, 0.6), _run(15.0, 0.6)])
    cost = verification_cost(unverified, verified)
    assert cost["ratio"] == pytest.approx(15.0 / 12.0)
    assert cost["pairs"] == pytest.approx((0.9, 1.1, 1.25))  # 18/20, 11/10, 15/12
    assert cost["rounds_share"] == pytest.approx(0.4 / 12.0)


def test_verification_cost_without_round_times_says_nothing_of_them():
    unverified = summarize_case("int8", [_run(10.0, None)])
    verified = summarize_case("verify", [_run(11.0, 0.5)])
    assert verification_cost(unverified, verified)["rounds_share"] is None
