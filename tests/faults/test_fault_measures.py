"""The fault table's measures and checks on hand-made polls and rows (no lab, no root)."""

import pytest

from phalanx.tools.lab.swarm import Sample
from tests.faults.fault_table import (
    BY_KEY,
    SCENARIOS,
    Row,
    Scenario,
    checkpoint_spans,
    delta,
    failed_checks,
    format_rows,
    longest_stall,
    rate,
    value_at,
)


def polls(*pairs):
    return [Sample(t, True, step=step, rounds_ok=step) for t, step in pairs]


def test_longest_stall_counts_from_the_window_start_to_the_first_increase_and_from_the_last_to_its_end():
    samples = polls((0, 5), (1, 6), (2, 6), (3, 6), (4, 7), (5, 8))
    assert longest_stall(samples, 0.0, 5.0) == 3.0  # no step between t=1 and t=4
    assert longest_stall(samples, 0.0, 9.0) == 4.0  # nothing after t=5 in a window ending at 9
    assert longest_stall(polls((0, 5), (1, 5)), 0.0, 10.0) == 10.0  # never a step


def test_unanswered_polls_neither_advance_nor_reset_the_step():
    samples = [*polls((0, 1)), Sample(1, False), Sample(2, False), *polls((3, 2))]
    assert longest_stall(samples, 0.0, 3.0) == 3.0
    assert value_at(samples, 2.0, "step") == 1


def test_delta_and_rate_take_the_last_answered_poll_at_each_end():
    samples = polls((0, 10), (1, 12), (2, 20), (4, 30))
    assert delta(samples, 1.5, 4.0, "step") == 18
    assert rate(samples, 0.0, 4.0, "rounds_done") == pytest.approx(5.0)
    assert delta([], 0.0, 1.0, "step") == 0


def test_a_row_that_meets_acceptance_passes_and_one_that_does_not_names_each_check():
    good = Row("a", "cut 30 s", stall_s=4.0, rounds_during=12, ready_while_faulty="0/20", ready_after_s=3.0,
               one_swarm_s=6.0, same_model="5/5", same_at_ends=True)  # fmt: skip
    assert failed_checks(BY_KEY["a"], [good]) == []
    bad = Row("a", "cut 30 s", stall_s=41.0, rounds_during=0, ready_while_faulty="20/20", ready_after_s=0.7,
              one_swarm_s=None, same_model="0/44", same_at_ends=False)  # fmt: skip
    assert failed_checks(BY_KEY["a"], [bad]) == [
        "(a) cut 30 s: healthy peers' longest stall ≤ 10 s",
        "(a) cut 30 s: rounds keep completing during the fault",
        "(a) cut 30 s: /readyz 503 while cut off (after the grace)",
        "(a) cut 30 s: one swarm within 30 s of healing, same model at the first common checkpoint after and at the last",
    ]


def test_same_model_needs_at_least_one_common_checkpoint():
    row = Row("h", "split 30 s", stall_s=1.0, ready_while_faulty="0/5", one_swarm_s=3.0, same_model="0/0", same_at_ends=False)
    assert failed_checks(BY_KEY["h"], [row]) == [
        "(h) split 30 s: one swarm within 30 s of healing, same model at the first common checkpoint after and at the last"
    ]


def test_members_apart_for_a_while_pass_only_when_together_at_both_ends():
    """A partial round under load leaves members apart until the version check resyncs them; a split
    that never re-merged differs at the last common checkpoint too."""
    row = Row("h", "split 30 s", stall_s=1.0, ready_while_faulty="0/5", one_swarm_s=3.0, same_model="40/44", same_at_ends=True)
    assert failed_checks(BY_KEY["h"], [row]) == []
    row.same_at_ends = False
    assert len(failed_checks(BY_KEY["h"], [row])) == 1


def test_spans_join_consecutive_checkpoint_steps():
    assert checkpoint_spans([120, 130, 140, 150, 300]) == "120–150, 300"
    assert checkpoint_spans([7]) == "7"


def test_every_scenario_of_the_issue_is_in_the_table_with_known_checks():
    assert {s.key[0] for s in SCENARIOS} == set("abcdefgh")
    assert len({s.key for s in SCENARIOS}) == len(SCENARIOS)
    for scenario in SCENARIOS:
        assert scenario.checks or scenario.key == "d-lasgd"  # lasgd under a cap is measured, not judged
        assert set(scenario.open_goals) <= set(scenario.checks), scenario.key  # an open goal is a check of the row
        assert set(scenario.held) | set(scenario.open_goals) == set(scenario.checks)


def test_an_open_goal_is_reported_but_not_among_the_held_checks():
    scenario = Scenario("a", "cut", checks=BY_KEY["a"].checks, open_goals=("stall",))
    row = Row("a", "cut 30 s", stall_s=15.0, rounds_during=3, rounds_failed=0, ready_while_faulty="0/20",
              ready_after_s=5.0, one_swarm_s=5.0, same_model="10/10", same_at_ends=True)
    assert failed_checks(scenario, [row], scenario.held) == []
    assert failed_checks(scenario, [row], scenario.open_goals) == ["(a) cut 30 s: healthy peers' longest stall ≤ 10 s"]


def test_format_rows_shows_filled_columns_and_notes():
    text = format_rows([Row("g", "kill -9 x20", kills=20, corrupt=0, missing=1, notes=["kill 3: resumed from nothing"])])
    assert text.splitlines()[0].endswith("| accuracy | kills | corrupt | missing |")
    assert "| 20 |" in text and "- (g) kill 3: resumed from nothing" in text
    assert "orphans" not in text


def test_a_fault_with_its_own_checks_is_judged_by_those_only():
    """The short row holds several rows' faults on one swarm: a SIGSTOP row is not judged by the
    readiness while cut off that only its cut and split rows have."""
    short = BY_KEY["short"]
    stop = next(f for f in short.faults if f.kind == "stop")
    row = Row("short", stop.label, stall_s=2.0, rounds_during=3, ready_after_s=4.0, one_swarm_s=5.0, same_at_ends=True)
    assert failed_checks(short, [row]) == []
    cut = next(f for f in short.faults if f.kind == "cut")
    assert failed_checks(short, [Row("short", cut.label, stall_s=2.0, rounds_during=3, ready_after_s=4.0, one_swarm_s=5.0,
                                     same_at_ends=True, ready_while_faulty="2/8")]) == [
        f"(short) {cut.label}: /readyz 503 while cut off (after the grace)"
    ]  # fmt: skip
    assert {c for f in short.faults for c in f.checks} <= set(short.checks)  # each is printed by scripts/faults.py
