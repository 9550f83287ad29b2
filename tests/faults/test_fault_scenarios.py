"""Issue 16's fault scenarios on separate network hosts, one test per row of fault_table.SCENARIOS.

Each asserts the acceptance numbers of its row; `python scripts/faults.py --scenario <key>` prints
the same numbers without asserting.
"""

import pytest
from fault_table import SCENARIOS, failed_checks, format_rows, run_scenario

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # (g) restarts a trainer 20 times


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.key for s in SCENARIOS])
def test_fault_scenario(scenario, lab_machine, tmp_path):
    rows = run_scenario(scenario, tmp_path)
    failed = failed_checks(scenario, rows)
    assert not failed, "\n".join(failed) + "\n\n" + format_rows(rows)
