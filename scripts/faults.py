"""Measure the fault scenarios of docs/reliability.md and print their numbers, asserting nothing.

    sudo .venv/bin/python scripts/faults.py --scenario a            # one row of the table
    sudo .venv/bin/python scripts/faults.py --scenario all --json   # every row, and JSON lines too

Each scenario starts a bootstrap and 4 trainers, each in its own network namespace (needs root,
iproute2 and iptables). The acceptance checks that `pytest tests/faults` applies are listed
after each table, as PASS or FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: its tests package

from phalanx.tools.lab.hosts import missing_requirements, sweep_stale  # noqa: E402
from phalanx.tools.lab.swarm import PEER_DEBUG_ENV  # noqa: E402
from tests.faults.fault_table import BY_KEY, CHECKS, SCENARIOS, failed_checks, format_rows, rows_json, run_scenario  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="all", help=f"comma-separated keys ({', '.join(BY_KEY)}) or all")
    parser.add_argument("--json", action="store_true", help="also print one JSON object per row")
    parser.add_argument("--workdir", type=Path, help="keep logs and checkpoints here (default: a temporary folder)")
    parser.add_argument("--debug", action="store_true", help="peers log at debug level (matchmaking, rounds); use with --workdir")
    args = parser.parse_args()
    if args.debug:
        os.environ[PEER_DEBUG_ENV] = "1"
    keys = [s.key for s in SCENARIOS] if args.scenario == "all" else [k.strip() for k in args.scenario.split(",") if k.strip()]
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        print(f"error: --scenario: unknown {', '.join(unknown)}; choose from {', '.join(BY_KEY)} or all", file=sys.stderr)
        return 2
    why = missing_requirements()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    sweep_stale()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every lab closes what it made
    code = 0
    with tempfile.TemporaryDirectory(prefix="phalanx-faults-") as scratch:
        root = args.workdir or Path(scratch)
        for key in keys:
            scenario = BY_KEY[key]
            began = time.monotonic()
            try:
                rows = run_scenario(scenario, root / key, log=lambda m: print(m, file=sys.stderr, flush=True))
            except AssertionError as e:  # the swarm never got to the fault: say so, measure the next row
                print(f"\n## ({key}) {scenario.title}\n\n- ERROR: {str(e).splitlines()[0]}")
                code = 1
                continue
            print(f"\n## ({key}) {scenario.title}  [{time.monotonic() - began:.0f} s]\n")
            print(format_rows(rows))
            failed = set(failed_checks(scenario, rows))
            for check in scenario.checks:
                text = CHECKS[check][0]
                verdict = "FAIL" if any(text in f for f in failed) else "PASS"
                open_goal = " (open goal: not asserted by the tests yet)" if check in scenario.open_goals else ""
                print(f"- {verdict}: {text}{open_goal}")
            if args.json:
                for row in rows_json(rows):
                    print(json.dumps(row))
            sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
