"""`phalanx bench aggregate`: time each registered aggregator against one read of its input.

Reference: x.sum(0) on the same (n, d) float32 tensor, timed interleaved with each rule
(same load on a shared host), i.e. one read of the input (the memory-bandwidth floor);
every time is reported as a ratio to it. At n·d·4 bytes below the last-level cache (e.g.
n = 8, d = 1e6 is 32 MB) the reference reads from cache, which makes ratios look worse.
Input: honest rows only, x_i = μ + σ_i·ξ_i with μ, ξ_i ~ N(0, I) and per-row noise norms
σ_i·√d spread evenly over [0.5, 2] (peers with different batch noise). With tau = 1 the
noisier rows are clipped and CenteredClip converges in about ten iterations.

    phalanx bench aggregate --n 8 --d 1000000 --repeats 3
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from phalanx.aggregation.registry import AGGREGATORS, make_aggregator, typical_params
from phalanx.errors import ConfigError
from phalanx.tools.bench import bench_console

CELL_MEMORY_FACTOR = 2.5  # input + the largest temporaries (a mean-sized copy, sort chunks) must fit
GOAL_READS_ORDER_STATS = 10.0  # median and trimmed mean: at most 10× one read


def make_input(n: int, d: int, device: torch.device, seed: int) -> torch.Tensor:
    """(n, d) float32 honest rows μ + σ_i·ξ_i (see the module docstring)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.empty(n, d, dtype=torch.float32)
    mu = torch.randn(d, generator=g)
    for i, noise_norm in enumerate(torch.linspace(0.5, 2.0, n).tolist()):  # row by row: no (n, d) temporary
        x[i] = torch.randn(d, generator=g).mul_(noise_norm / d**0.5).add_(mu)
    return x.to(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Wall time of one call; synchronizes before and after on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


def time_against_reference(
    fn: Callable[[], Any], ref: Callable[[], Any], device: torch.device, repeats: int
) -> tuple[float, float, Any]:
    """Median times of ``fn`` and ``ref`` over ``repeats`` interleaved runs, after one warm-up each.

    Interleaving keeps both under the same machine load, which drifts on a shared host.
    Returns (fn median s, ref median s, fn's last output).
    """
    ref()
    out = fn()
    fn_times, ref_times = [], []
    for _ in range(repeats):
        ref_times.append(_timed(ref, device)[0])
        t, out = _timed(fn, device)
        fn_times.append(t)
    return statistics.median(fn_times), statistics.median(ref_times), out


def _devices(device: str) -> list[torch.device]:
    if device == "auto":
        return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device must be cpu, cuda, cuda:N or auto, not {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available here; use cpu or auto")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu, cuda, cuda:N or auto, not {device!r}")
    return [dev]


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in str(e).lower()


def run_aggregate_bench(
    ns: list[int],
    ds: list[int],
    names: list[str] | None,
    device: str,
    repeats: int,
    seed: int,
    *,
    console: Console | None = None,
) -> list[dict[str, Any]]:
    """Time every aggregator (or ``names``) at each n and d; print a table and return its rows.

    Row keys: device, n, d, aggregator, status ("ok" or why the cell did not run), time_s,
    ref_s, ratio (time / one read), iterations, per_read (CenteredClip: ratio / (iterations + 2)).
    """
    names = list(AGGREGATORS) if names is None else names
    for name in names:
        AGGREGATORS[name]  # unknown names fail before any work, listing the valid ones
    console = console or bench_console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # piped or captured: do not wrap the table
    rows: list[dict[str, Any]] = []
    for dev in _devices(device):
        for n in ns:
            for d in ds:
                rows += _bench_cell(dev, n, d, names, repeats, seed, console)
    console.print(_table(rows, repeats))
    console.print(goal_check(rows))
    return rows


def _bench_cell(
    dev: torch.device, n: int, d: int, names: list[str], repeats: int, seed: int, console: Console
) -> list[dict[str, Any]]:
    base = {"device": str(dev), "n": n, "d": d}
    need, free = int(CELL_MEMORY_FACTOR * n * d * 4), _free_bytes(dev)
    if need > free:
        why = f"does not fit: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        return [{**base, "aggregator": name, "status": why} for name in names]
    try:
        with console.status(f"[{dev}] n={n} d={_short(d)}: generating input"):
            x = make_input(n, d, dev, seed)
    except (RuntimeError, MemoryError) as e:
        if not _is_oom(e):
            raise
        return [{**base, "aggregator": name, "status": "input does not fit: out of memory"} for name in names]
    out = []
    for name in names:
        row: dict[str, Any] = {**base, "aggregator": name}
        try:
            with console.status(f"[{dev}] n={n} d={_short(d)}: {name}"):
                agg = make_aggregator(name, **typical_params(name, n))
                t, ref_s, result = time_against_reference(lambda agg=agg: agg(x), lambda: x.sum(0), dev, repeats)
        except (RuntimeError, MemoryError) as e:
            if not _is_oom(e):
                raise
            out.append({**row, "status": "out of memory"})
            continue
        ratio = t / ref_s
        row.update(status="ok", time_s=t, ref_s=ref_s, ratio=ratio, iterations=result.iterations)
        if name == "centered_clip":
            row["per_read"] = ratio / (result.iterations + 2)
        out.append(row)
    return out


def _table(rows: list[dict[str, Any]], repeats: int) -> Table:
    table = Table(title=f"aggregators vs one read of x (x.sum(0)), float32, median of {repeats}")
    for col in ("device", "n", "d", "aggregator", "time ms", "x.sum(0) ms", "ratio", "iters", "ratio/(iters+2)"):
        table.add_column(col, justify="left" if col in ("device", "aggregator") else "right", no_wrap=True)
    for r in rows:
        cells = [r["device"], str(r["n"]), _short(r["d"]), r["aggregator"]]
        if r["status"] != "ok":
            table.add_row(*cells, r["status"], "", "", "", "")
            continue
        per_read = f"{r['per_read']:.2f}" if "per_read" in r else ""
        table.add_row(
            *cells,
            f"{r['time_s'] * 1e3:.1f}",
            f"{r['ref_s'] * 1e3:.1f}",
            f"{r['ratio']:.1f}×",
            str(r["iterations"]),
            per_read,
        )
    return table


def _short(d: int) -> str:
    """1000000 -> 1e6 (exact powers of ten), else the number."""
    text = f"{d:.0e}".replace("e+0", "e").replace("e+", "e")
    return text if float(text) == d else str(d)


def goal_check(rows: list[dict[str, Any]]) -> str:
    """One line: CenteredClip <= (iterations + 2) reads; median and trimmed mean <= 10 reads."""
    parts = []
    goals = {
        "centered_clip": (lambda r: r["iterations"] + 2, "(iterations + 2)"),
        "median": (lambda r: GOAL_READS_ORDER_STATS, f"{GOAL_READS_ORDER_STATS:g}"),
        "trimmed_mean": (lambda r: GOAL_READS_ORDER_STATS, f"{GOAL_READS_ORDER_STATS:g}"),
    }
    for name, (limit, text) in goals.items():
        cells = [r for r in rows if r["aggregator"] == name and r["status"] == "ok"]
        if not cells:
            continue
        met = sum(r["ratio"] <= limit(r) for r in cells)
        color = "green" if met == len(cells) else "red"
        worst = max(cells, key=lambda r: r["ratio"] / limit(r))
        parts.append(
            f"{name} <= {text} reads: [{color}]met in {met}/{len(cells)} cells[/{color}] "
            f"(worst {worst['ratio']:.1f}× vs {limit(worst):g} at n={worst['n']} d={_short(worst['d'])} {worst['device']})"
        )
    return "goal: " + "; ".join(parts) if parts else "goal: no CenteredClip, median or trimmed mean cell ran"
