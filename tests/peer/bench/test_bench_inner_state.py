"""`phalanx bench inner-state`: the one-process simulation of diloco's outer steps behind it."""

from __future__ import annotations

import io

from rich.console import Console

from phalanx.tools.bench.inner_state import Variant, run_inner_state_bench, simulate, steps_to
from phalanx.tools.bench.swarm import Goal

DIGITS = dict(peers=3, inner_steps=5, rounds=3, seed=0, metric="accuracy")


def test_a_fresh_state_changes_nothing_until_the_second_phase_and_then_does():
    """The first phase of every variant starts from the same zero state: only later phases differ."""
    kept = simulate("digits-mlp", "", Variant("kept", False, 0, 0), **DIGITS)
    fresh = simulate("digits-mlp", "", Variant("fresh", True, 0, 0), **DIGITS)
    assert kept[0] == fresh[0]
    assert kept[1:] != fresh[1:]
    assert kept[-1] > 0.5  # digits' ten classes: training happened


def test_sitters_count_no_contribution_and_are_at_most_a_third():
    ramp = simulate("digits-mlp", "", Variant("ramp", True, 2, 0), **DIGITS)
    sitting = simulate("digits-mlp", "", Variant("sitting", True, 2, 1), **DIGITS)
    assert ramp[0] == sitting[0]  # nobody sits the first phase out (no seed before it)
    assert ramp[1:] != sitting[1:]
    # two members: a third of them is nobody
    two = {**DIGITS, "peers": 2}
    assert simulate("digits-mlp", "", Variant("ramp", True, 2, 0), **two) == simulate(
        "digits-mlp", "", Variant("sitting", True, 2, 1), **two
    )


def test_steps_to_counts_from_one_and_follows_the_metric():
    assert steps_to([0.5, 0.8, 0.9], "accuracy", 0.8) == 2
    assert steps_to([3.1, 2.9, 2.6], "loss", 2.7) == 3
    assert steps_to([3.1, 2.9], "loss", 2.7) is None


def test_the_bench_prints_every_variant_with_its_steps_to_the_target():
    out = io.StringIO()
    goal = Goal.for_task("inner-state", "digits-mlp", "", 0.99, 0.0)
    results = run_inner_state_bench(
        goal, peers=2, inner_steps=3, rounds=2, seeds=2, phase_warmup=2, validators=1,
        console=Console(file=out, width=250),
    )  # fmt: skip
    assert len(results) == 4 and all(len(runs) == 2 and len(runs[0]) == 2 for runs in results.values())
    text = out.getvalue()
    assert "kept (unverified)" in text and "sitting (verified)" in text
    assert "not reached in 2 of 2" in text  # 99 % in two outer steps of three inner steps: no


def test_the_outer_step_follows_its_learning_rate_and_momentum():
    """Outer lr 1 without momentum moves θ by the mean Δ, a plain average; other values move it elsewhere."""
    plain = simulate("digits-mlp", "", Variant("kept", False, 0, 0), **DIGITS, outer_lr=1.0, outer_momentum=0.0)
    default = simulate("digits-mlp", "", Variant("kept", False, 0, 0), **DIGITS)
    assert plain[0] != default[0] and plain[-1] > 0.5


def test_the_inner_learning_rate_is_the_tasks_unless_given():
    """lr None is the task's own rate (digits-mlp: 0.1): giving that rate changes nothing, another does."""
    default = simulate("digits-mlp", "", Variant("kept", False, 0, 0), **DIGITS)
    assert simulate("digits-mlp", "", Variant("kept", False, 0, 0), **DIGITS, lr=0.1) == default
    assert simulate("digits-mlp", "", Variant("kept", False, 0, 0), **DIGITS, lr=0.02) != default


def test_unverified_only_simulates_the_kept_variant_alone():
    out = io.StringIO()
    goal = Goal.for_task("inner-state", "digits-mlp", "", 0.99, 0.0)
    results = run_inner_state_bench(
        goal, peers=2, inner_steps=3, rounds=2, seeds=1, phase_warmup=2, validators=1, lr=0.05,
        unverified_only=True, console=Console(file=out, width=250),
    )  # fmt: skip
    assert list(results) == ["kept (unverified)"]
    assert "inner learning rate 0.05" in out.getvalue()
