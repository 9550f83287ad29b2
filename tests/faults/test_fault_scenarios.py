"""Issue 16's fault scenarios on separate network hosts, one test per row of fault_table.SCENARIOS.

CI runs the rows of fault_table.IN_CI: "short" (the faults of a, b, c, d, e and h, and f's SIGKILL of a
whole tree, on one swarm with shorter windows) and (g); the other rows are long (`pytest --long`: about
25 minutes on 2 cores, against 6 for CI's). Each asserts the acceptance numbers of its row; `python scripts/faults.py --scenario <key>` prints
the same numbers without asserting. A row that fails only checks of time and rate (fault_table.LOAD_BOUND:
this machine is shared and has 2 cores) runs again, up to RUNS runs, and each failed run's table is
printed as a warning; it must pass one of them. Failures of the other checks are never retried.
"""

import warnings

import pytest

from tests.faults.fault_table import (
    IN_CI,
    IN_CI_INSTEAD,
    SCENARIOS,
    SHORT,
    SHORT_HOLDS,
    failed_checks,
    format_rows,
    only_load_bound,
    run_scenario,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

# A row's runs at most, while it fails only load-bound checks: a 2-core machine shared with other work
# starves a row's peers now and then (a CI run's (h) stalled 10.8 s, against 6 s in most runs).
RUNS = 3


def _param(scenario):
    if scenario.key in IN_CI:
        return pytest.param(scenario, id=scenario.key)
    variant = (
        "the same faults without the delay" if scenario.delay_s
        else "the short row" if scenario.key in SHORT_HOLDS else IN_CI_INSTEAD.get(scenario.key, "nothing: it asserts no check")
    )  # fmt: skip
    return pytest.param(scenario, id=scenario.key, marks=pytest.mark.long(variant))


@pytest.mark.parametrize("scenario", [_param(s) for s in (*SCENARIOS, SHORT)])
def test_fault_scenario(scenario, lab_machine, tmp_path, request):
    if scenario is SHORT and request.config.getoption("--long"):
        pytest.skip("--long: rows a to h run whole instead of the short row")
    rows = run_scenario(scenario, tmp_path / "run-1")
    failed = failed_checks(scenario, rows, scenario.held)
    for run in range(2, RUNS + 1):
        if not (failed and only_load_bound(scenario, rows, scenario.held)):
            break
        warnings.warn(f"RETRIED ({scenario.key}): its run {run - 1} failed " + "; ".join(failed) + "\n" + format_rows(rows), stacklevel=1)
        rows = run_scenario(scenario, tmp_path / f"run-{run}")
        failed = failed_checks(scenario, rows, scenario.held)
    assert not failed, "\n".join(failed) + "\n\n" + format_rows(rows)
    still_open = failed_checks(scenario, rows, scenario.open_goals)
    if still_open:  # not met yet (docs/reliability.md): said loudly, not asserted
        warnings.warn("OPEN GOAL NOT MET: " + "; ".join(still_open), stacklevel=1)
    reached = [c for c in scenario.open_goals if not failed_checks(scenario, rows, (c,))]
    if reached:
        warnings.warn(f"open goal now met in ({scenario.key}): {', '.join(reached)}; assert it (drop it from open_goals)", stacklevel=1)
