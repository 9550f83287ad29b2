"""Issue 16's fault scenarios on separate network hosts, one test per row of fault_table.SCENARIOS.

Each asserts the acceptance numbers of its row; `python scripts/faults.py --scenario <key>` prints
the same numbers without asserting.
"""

import warnings

import pytest
from fault_table import SCENARIOS, failed_checks, format_rows, run_scenario

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # (g) restarts a trainer 20 times


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.key for s in SCENARIOS])
def test_fault_scenario(scenario, lab_machine, tmp_path):
    rows = run_scenario(scenario, tmp_path)
    failed = failed_checks(scenario, rows, scenario.held)
    assert not failed, "\n".join(failed) + "\n\n" + format_rows(rows)
    still_open = failed_checks(scenario, rows, scenario.open_goals)
    if still_open:  # not met yet (docs/reliability.md): said loudly, not asserted
        warnings.warn("OPEN GOAL NOT MET: " + "; ".join(still_open), stacklevel=1)
    reached = [c for c in scenario.open_goals if not failed_checks(scenario, rows, (c,))]
    if reached:
        warnings.warn(f"open goal now met in ({scenario.key}): {', '.join(reached)}; assert it (drop it from open_goals)", stacklevel=1)
