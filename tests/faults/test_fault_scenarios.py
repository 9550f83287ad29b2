"""Issue 16's fault scenarios on separate network hosts, one test per row of fault_table.SCENARIOS.

CI runs the rows of fault_table.IN_CI: "short" (the faults of a, c, d, e and h on one swarm, with shorter
windows) and the rows no other covers; the others skip, saying so, unless FAULT_TABLE_FULL=1 (about 20
minutes on 2 cores, against 10 for CI's). Each asserts the acceptance numbers of its row; `python scripts/faults.py --scenario <key>` prints
the same numbers without asserting. A row that fails only checks of time and rate (fault_table.LOAD_BOUND:
this machine is shared and has 2 cores) runs again, up to RUNS runs, and each failed run's table is
printed as a warning; it must pass one of them. Failures of the other checks are never retried.
"""

import os
import warnings

import pytest

from tests.faults.fault_table import IN_CI, SCENARIOS, SHORT, failed_checks, format_rows, only_load_bound, run_scenario

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]  # (g) restarts a trainer 20 times

# A row's runs at most, while it fails only load-bound checks: a 2-core machine shared with other work
# starves a row's peers now and then (a CI run's (h) stalled 10.8 s, against 6 s in most runs).
RUNS = 3
FULL_ENV = "FAULT_TABLE_FULL"  # set: every row of the table, not CI's share of it


@pytest.mark.parametrize("scenario", (*SCENARIOS, SHORT), ids=[s.key for s in (*SCENARIOS, SHORT)])
def test_fault_scenario(scenario, lab_machine, tmp_path):
    full = bool(os.environ.get(FULL_ENV))
    if full and scenario is SHORT:
        pytest.skip(f"{FULL_ENV} is set: rows a, c, d, e and h run whole instead of the short row")
    if not full and scenario.key not in IN_CI:
        why = (
            "its faults run in CI without the delay" if scenario.delay_s
            else "the short row holds its fault in CI" if scenario.checks else "it measures, asserting no check"
        )  # fmt: skip
        pytest.skip(f"row ({scenario.key}) runs with {FULL_ENV}=1 ({why})")
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
