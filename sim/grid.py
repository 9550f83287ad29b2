"""Run many simulations (a grid) in parallel processes and summarize them over seeds.

Each run is independent and seeded, so the results do not depend on ``jobs`` or on the
order runs finish in. Worker processes use one torch thread each: the model is tiny, and
two processes on two cores beat one process with two threads.
"""

from __future__ import annotations

import csv
import json
import math
import os
import resource
import statistics
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from phalanx.sim.config import SimConfig

SUMMARY_FIELDS = (
    "table", "row", "column", "seeds", "final_accuracy", "final_accuracy_std", "best_accuracy",
    "mean_staleness", "max_staleness", "updates", "gradients", "time_s", "diverged",
    "final_spread", "worst_peer_accuracy", "captured_groups",
)  # fmt: skip
RUN_FIELDS = (
    "table", "row", "column", "seed", "method", "workers", "delay", "budget", "aggregator", "byzantine", "attack",
    "final_accuracy", "best_accuracy", "final_loss", "mean_staleness", "max_staleness", "updates", "gradients",
    "time_s", "diverged", "wall_s", "group_size", "final_spread", "worst_peer_accuracy", "captured_groups",
)  # fmt: skip
GROUPED_FIELDS = ("final_spread", "worst_peer_accuracy", "captured_groups")  # None for other methods


@dataclass(frozen=True)
class GridRun:
    """One run of a grid and where it goes: the cell (table, row, column), averaged over seeds."""

    table: str
    row: str
    column: str
    config: SimConfig


def _init_process() -> None:
    import torch

    torch.set_num_threads(1)


def _run_one(config: SimConfig) -> dict[str, Any]:
    from phalanx.sim.runner import run_sim

    return run_sim(config).to_dict()


def cpu_seconds() -> float:
    """User + system CPU time of this process and its reaped children (grid worker processes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def default_jobs() -> int:
    """Parallel processes: one per core, at most 2 (the presets are sized for a 2-core machine)."""
    return max(1, min(2, os.cpu_count() or 1))


def run_grid(
    runs: Sequence[GridRun], *, jobs: int = 1, on_done: Callable[[int, dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Run every config; returns one record per run, in the order of ``runs``.

    A record is SimResult.to_dict() plus table/row/column. ``on_done(index, record)`` is
    called as runs finish (for progress bars).
    """
    records: list[dict[str, Any] | None] = [None] * len(runs)

    def done(i: int, result: dict[str, Any]) -> None:
        run = runs[i]
        records[i] = {"table": run.table, "row": run.row, "column": run.column, **result}
        if on_done is not None:
            on_done(i, records[i])  # type: ignore[arg-type]

    if jobs <= 1:
        _init_process()
        for i, run in enumerate(runs):
            done(i, _run_one(run.config))
    else:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_init_process) as pool:
            futures = {pool.submit(_run_one, run.config): i for i, run in enumerate(runs)}
            for future in as_completed(futures):
                done(futures[future], future.result())
    return [r for r in records if r is not None]


def summarize(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(table, row, column) → means over seeds (and the std of the final accuracy)."""
    cells: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in records:
        cells.setdefault((r["table"], r["row"], r["column"]), []).append(r)
    out = {}
    for key, rs in cells.items():
        finals = [r["final_accuracy"] for r in rs]
        out[key] = {
            "table": key[0],
            "row": key[1],
            "column": key[2],
            "seeds": len(rs),
            "final_accuracy": statistics.fmean(finals),
            "final_accuracy_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "best_accuracy": statistics.fmean(r["best_accuracy"] for r in rs),
            "mean_staleness": statistics.fmean(r["mean_staleness"] for r in rs),
            "max_staleness": max(r["max_staleness"] for r in rs),
            "updates": statistics.fmean(r["updates"] for r in rs),
            "gradients": statistics.fmean(r["gradients"] for r in rs),
            "time_s": statistics.fmean(r["time_s"] for r in rs),
            "diverged": sum(bool(r["diverged"]) for r in rs),
            **{k: _mean_or_none([r.get(k) for r in rs]) for k in GROUPED_FIELDS},
        }
    return out


def _mean_or_none(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def run_row(record: dict[str, Any]) -> dict[str, Any]:
    """A flat CSV row of one run record."""
    c = record["config"]
    return {
        **{k: record[k] for k in RUN_FIELDS if k in record},
        "seed": c["seed"],
        "method": c["method"],
        "workers": c["workers"],
        "delay": c["delay"],
        "budget": f"{c['budget']['kind']}={c['budget']['amount']:g}",
        "aggregator": c["aggregator"],
        "byzantine": c["byzantine"]["count"],
        "attack": c["byzantine"]["attack"] if c["byzantine"]["count"] else "",
        "group_size": c.get("group_size") or "",
    }


def write_outputs(out: Path, prefix: str, records: list[dict[str, Any]]) -> dict[str, Path]:
    """Write <prefix>_runs.csv, <prefix>_runs.json (with curves) and <prefix>_summary.csv into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "runs_csv": out / f"{prefix}_runs.csv",
        "runs_json": out / f"{prefix}_runs.json",
        "summary_csv": out / f"{prefix}_summary.csv",
    }
    with paths["runs_csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RUN_FIELDS)
        writer.writeheader()
        for r in records:
            writer.writerow({k: _fmt(v) for k, v in run_row(r).items()})
    with paths["runs_json"].open("w") as f:
        json.dump([json_ready(r) for r in records], f, separators=(",", ":"))
    with paths["summary_csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
        writer.writeheader()
        for s in summarize(records).values():
            writer.writerow({k: _fmt(s[k]) for k in SUMMARY_FIELDS})
    return paths


def _fmt(v: Any) -> Any:
    return f"{v:.6g}" if isinstance(v, float) else v


def json_ready(record: dict[str, Any]) -> dict[str, Any]:
    """Floats rounded to 6 significant digits (small, diffable JSON); NaN/Inf become null."""

    def walk(v: Any) -> Any:
        if isinstance(v, float):
            return float(f"{v:.6g}") if math.isfinite(v) else None  # NaN/Inf (diverged runs) → null
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(record)
