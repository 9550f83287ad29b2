"""`phalanx bench diloco`'s arithmetic: what a run spent in rounds, a case's row, what --verify costs."""

import pytest

from phalanx.tools.bench.swarm import phase_times_s, rounds_cost_s, summarize_case, verification_cost


def _outer(step: int, round_s: float, t: float = 0.0) -> dict:
    return {"event": "outer", "outer_step": step, "round_s": round_s, "t": t}


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


def test_phase_times_are_the_gaps_between_outer_steps_less_their_rounds():
    events = [
        {"event": "training", "t": 100.0},
        _outer(1, 0.30, 103.1), _outer(1, 0.10, 103.0),  # the first to apply it did at 103.0; the round took 0.1 s
        {"event": "eval", "step": 50, "loss": 3.0, "t": 103.2},
        _outer(2, 0.20, 105.4), _outer(2, 0.05, 105.5),
    ]  # fmt: skip
    assert phase_times_s(events, 100.0) == pytest.approx([2.9, 2.35])
    assert phase_times_s([{"event": "training", "t": 1.0}], 1.0) is None  # sync: no outer steps


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


def test_a_case_has_phase_times_only_if_every_run_had_as_many_phases():
    row = summarize_case("x", [_run(10.0, phases_s=p) for p in ([3.0, 2.0], [3.4, 2.2], [3.2, 2.6])])
    assert row["phases_s"] == pytest.approx([3.2, 2.2])
    assert summarize_case("x", [_run(10.0, phases_s=[3.0, 2.0]), _run(10.0, phases_s=[3.0])])["phases_s"] is None
    assert summarize_case("x", [_run(10.0, phases_s=[3.0]), _run(10.0)])["phases_s"] is None


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


def _cases(pairs):
    return (
        summarize_case("int8", [_run(u, 0.1) for u, _ in pairs]),
        summarize_case("verify", [_run(v, 0.3) for _, v in pairs]),
    )


def test_the_ratios_interval_needs_five_pairs_and_is_exact_for_exact_data():
    assert verification_cost(*_cases([(10.0, 10.5)] * 4))["interval"] is None
    low, high = verification_cost(*_cases([(t, 1.05 * t) for t in (9.0, 10.0, 11.0, 12.0, 14.0)]))["interval"]
    assert low == pytest.approx(1.05) and high == pytest.approx(1.05)


def test_the_ratios_interval_holds_the_ratio_and_widens_with_noise():
    calm = [(10.0 + i % 3, (10.0 + i % 3) * (1.04 + 0.01 * (i % 2))) for i in range(12)]
    noisy = [(10.0 + i % 3, (10.0 + i % 3) * (0.9 + 0.05 * (i % 5))) for i in range(12)]
    for pairs in (calm, noisy):
        cost = verification_cost(*_cases(pairs))
        assert cost["interval"][0] <= cost["ratio"] <= cost["interval"][1]
    calm_cost, noisy_cost = verification_cost(*_cases(calm)), verification_cost(*_cases(noisy))
    assert noisy_cost["interval"][1] - noisy_cost["interval"][0] > calm_cost["interval"][1] - calm_cost["interval"][0]


def test_the_verdict_says_when_the_goal_is_met_only_at_the_median():
    from rich.console import Console

    from phalanx.tools.bench.swarm import print_diloco_goals

    def verdict(pairs):
        console = Console(record=True, width=300)
        print_diloco_goals(None, *_cases(pairs), 100.0, console=console)
        return console.export_text()

    steady = verdict([(t, 1.03 * t) for t in (9.0, 10.0, 11.0, 12.0, 14.0)])
    assert "1.03×: met\n" in steady and "90% interval of that ratio: 1.03–1.03×" in steady
    assert "+1.8% of the unverified wall time" in steady  # (0.3 - 0.1) s of the median int8 run, 11 s
    assert "phase by phase" not in steady  # the runs had no phase times

    int8, verified = ({**case, "phases_s": p} for case, p in zip(_cases([(10.0, 10.3)]), ([3.0, 2.5], [3.25, 2.5])))
    console = Console(record=True, width=300)
    print_diloco_goals(None, int8, verified, 100.0, console=console)
    assert "phase by phase: 3.25 / 2.50 s against 3.00 / 2.50 s" in console.export_text()
    doubtful = verdict([(10.0, 10.2), (10.0, 10.3), (10.0, 10.6), (10.0, 13.0), (10.0, 13.5), (10.0, 9.5)])
    assert "met at the median, not beyond doubt" in doubtful
    assert "NOT met" in verdict([(10.0, 12.0)] * 5)


def test_the_time_goal_against_sync_is_strict_and_says_when_it_holds_only_at_the_median():
    from rich.console import Console

    from phalanx.tools.bench.swarm import print_diloco_goals

    def verdict(pairs, sync_bytes=200_000):
        sync, int8 = _cases(pairs)
        sync = {**sync, "bytes_sent": sync_bytes}  # int8's runs sent 1000 bytes each
        console = Console(record=True, width=300)
        print_diloco_goals(sync, int8, None, 100.0, console=console)
        return console.export_text()

    clear = verdict([(t, 0.8 * t) for t in (9.0, 10.0, 11.0, 12.0, 14.0)])
    assert "200× fewer, 0.80× the time: met\n" in clear and "90% interval of that ratio: 0.80–0.80×" in clear
    tie = verdict([(10.0, 9.0), (10.0, 9.5), (10.0, 11.0), (10.0, 9.8), (10.0, 10.6), (10.0, 9.7)])
    assert "the time: met at the median, not beyond doubt" in tie
    assert "1.00× the time: NOT met" in verdict([(10.0, 10.0)] * 5)  # as fast is not faster
    assert "99× fewer, 0.80× the time: NOT met" in verdict([(10.0, 8.0)] * 5, sync_bytes=99_000)
