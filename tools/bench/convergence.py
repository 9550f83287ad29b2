"""`phalanx bench convergence`: wall time to a target accuracy with one straggler, per mode.

Every peer's local step takes at least `base_step_s` (a stand-in for real GPU work, so the
tiny digits model does not make the network the only cost) and one straggler draws its
step time from `straggler` (about 5× the others). Each case runs `repeats` times as a
`phalanx swarm`; the clock starts when the peers start training and stops at the first
honest evaluation at or above the target.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

import uvloop

from phalanx.tools.bench import bench_console
from phalanx.tools.launcher.swarm import Swarm

CASES = (
    ("sync", ["--mode", "sync"]),
    ("lasgd, gap_aware", ["--mode", "lasgd", "--staleness", "gap_aware"]),
    ("lasgd, none", ["--mode", "lasgd", "--staleness", "none"]),
    ("gossip", ["--mode", "gossip"]),
)


def _time_to_target(result, target: float) -> Optional[float]:
    events = [e for v in result.peers for e in v.events]
    starts = [e["t"] for e in events if e["event"] == "training"]
    hits = [e["t"] for v in result.peers if v.attack is None for e in v.events if e["event"] == "eval" and e["accuracy"] >= target]
    return (min(hits) - min(starts)) if hits and starts else None


def run_convergence_bench(
    peers: int, target: float, repeats: int, *, base_step_s: float, straggler: str, max_steps: int, console=None
) -> list[dict[str, Any]]:
    from rich.table import Table

    console = console or bench_console()
    rows = []
    for label, case in CASES:
        times = []
        for i in range(repeats):
            console.print(f"{label}: run {i + 1}/{repeats} ({peers} peers, one straggler {straggler})…")
            args = [
                "--task", "digits-mlp", "--steps", str(max_steps), "--target-accuracy", str(target),
                "--eval-every", "10", "--sync-every", "5", "--wait-for-peers", str(peers), "--seed", str(i),
                "--slowdown", f"const:{base_step_s}", *case,
            ]  # fmt: skip
            swarm = Swarm(
                peers, args, target=target, live=False, stragglers=1,
                straggler_args=["--slowdown", straggler], console=console,
            )  # fmt: skip
            result = uvloop.run(swarm.run())
            if result.kept_workdir is not None:
                console.print(f"{label}: target not reached; the run's logs are kept in {result.kept_workdir}", soft_wrap=True)
            times.append(_time_to_target(result, target))
        reached = [t for t in times if t is not None]
        rows.append(
            {
                "mode": label,
                "median_s": statistics.median(reached) if len(reached) == len(times) else None,
                "runs": times,
            }
        )
    table = Table(title=f"wall time to {target} test accuracy on digits, {peers} peers, one straggler ({straggler})")
    for col in ("mode", "median s", "runs (s)", "vs sync"):
        table.add_column(col, justify="right")
    sync = rows[0]["median_s"]
    for r in rows:
        runs = ", ".join("—" if t is None else f"{t:.1f}" for t in r["runs"])
        ratio = f"{r['median_s'] / sync:.2f}×" if r["median_s"] and sync else ""
        table.add_row(r["mode"], "not reached" if r["median_s"] is None else f"{r['median_s']:.1f}", runs, ratio)
    console.print(table)
    by = {r["mode"]: r["median_s"] for r in rows}
    ga, none = by["lasgd, gap_aware"], by["lasgd, none"]
    if ga and sync and none:
        verdict = "met" if ga < sync and ga <= none else "NOT met"
        console.print(
            f"goal: lasgd with gap_aware faster than sync and at least as fast as without correction — "
            f"{ga:.1f} s vs {sync:.1f} s (sync) and {none:.1f} s (none): {verdict}"
        )
    return rows
