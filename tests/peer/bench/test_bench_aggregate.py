"""tools/bench/aggregate.py on a tiny input: every registry name gets a row (no timing asserted)."""

from __future__ import annotations

import io

from rich.console import Console

from phalanx.aggregation.registry import AGGREGATORS
from phalanx.tools.bench.aggregate import goal_check, run_aggregate_bench


def test_tiny_bench_covers_every_aggregator():
    out = io.StringIO()
    rows = run_aggregate_bench(
        ns=[4], ds=[1000], names=None, device="cpu", repeats=1, seed=0, console=Console(file=out, width=200)
    )
    assert [r["aggregator"] for r in rows] == list(AGGREGATORS)
    assert all(r["status"] == "ok" and r["ratio"] > 0 and r["n"] == 4 and r["d"] == 1000 for r in rows)
    assert "per_read" in next(r for r in rows if r["aggregator"] == "centered_clip")
    text = out.getvalue()
    assert all(name in text for name in AGGREGATORS)
    assert "goal: centered_clip <= (iterations + 2) reads" in text


def test_goal_check_reports_misses():
    rows = [
        {"aggregator": "median", "status": "ok", "ratio": 12.0, "iterations": 1, "n": 8, "d": 10**6, "device": "cpu"},
        {"aggregator": "median", "status": "ok", "ratio": 3.0, "iterations": 1, "n": 8, "d": 10**7, "device": "cpu"},
    ]
    assert goal_check(rows) == (
        "goal: median <= 10 reads: [red]met in 1/2 cells[/red] (worst 12.0× vs 10 at n=8 d=1e6 cpu)"
    )
