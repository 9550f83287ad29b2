"""`phalanx sim run` and `phalanx sim grid`: the simulator's command line.

Only typer is imported here; torch, matplotlib and the simulator load when a command runs,
so `phalanx --help` stays fast.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any, Optional

import typer

sim_app = typer.Typer(
    help="Discrete-event simulator: N virtual workers computing real gradients on a virtual clock.",
    no_args_is_help=True,
)


@sim_app.command("run")
def run(
    method: str = typer.Option("dana_ga", "--method", help="ssgd, k_sync, k_async, k_batch_async, asgd, nag_asgd, multi_asgd, sa, dc_asgd, ga, ga_momentum, dana_zero, dana_slim, dana_ga, adasync, hybrid, lasgd, gossip."),
    workers: int = typer.Option(16, "--workers", min=1, help="N, virtual workers."),
    delay: str = typer.Option("exp", "--delay", help="const, exp, shifted-exp, gamma or volunteer; parameters as volunteer:offline_mean=20."),
    updates: Optional[int] = typer.Option(None, "--updates", min=1, help="Budget: model updates (server steps; local steps for lasgd/gossip)."),
    gradients: Optional[int] = typer.Option(None, "--gradients", min=1, help="Budget: gradients applied (equal data). Default 2000 when no budget is given."),
    time_budget: Optional[float] = typer.Option(None, "--time", min=0.0, help="Budget: virtual time (mean minibatch time is 1)."),
    seed: int = typer.Option(0, "--seed", help="Seeds the model, minibatches, delays and attacks."),
    task: str = typer.Option("digits-mlp", "--task", help="Task name or package.module:factory."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Learning rate (default: the task's)."),
    momentum: Optional[float] = typer.Option(None, "--momentum", help="Momentum (default: the task's for momentum methods, else 0)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="Minibatch per gradient (default: the task's)."),
    sync: Optional[str] = typer.Option(None, "--sync", help="K schedule of K-family methods: full, k:<K>, hybrid:<linear|exp>:<T>, adasync:<K0>:<T0>."),
    aggregator: str = typer.Option("mean", "--aggregator", help="Aggregator of groups of 2+ rows, e.g. centered_clip:tau=1, trimmed_mean:b=3."),
    byzantine: int = typer.Option(0, "--byzantine", min=0, help="b, Byzantine workers (the last b)."),
    attack: str = typer.Option("sign_flip", "--attack", help="sign_flip, random_direction, constant_direction, ipm, alie, gaussian, nan, inf, label_flip, delayed; parameters as ipm:eps=0.5."),
    attack_from: int = typer.Option(0, "--attack-from", min=0, help="First update at which the Byzantine workers attack."),
    local_steps: int = typer.Option(8, "--local-steps", min=1, help="H of lasgd."),
    gossip_tau: float = typer.Option(math.inf, "--gossip-tau", help="ClippedGossip radius for gossip (inf: plain averaging)."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="G of grouped: groups of at most G, redrawn every round (default: one group of all N)."),
    eval_points: int = typer.Option(20, "--eval-points", min=1, help="Test evaluations spread over the budget."),
    engine: str = typer.Option("auto", "--engine", help="Gradient engine: auto, mlp, vmap, loop."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the run as JSON, its curve as CSV and a PNG plot here."),
) -> None:  # fmt: skip
    """Simulate one method: prints final and best test accuracy, mean staleness and the accuracy curve against updates and virtual time.

    [bold]Examples[/bold]

      phalanx sim run --method dana_ga --workers 32 --delay exp --updates 3000 --seed 0

      phalanx sim run --method ssgd --workers 16 --byzantine 7 --attack alie --aggregator centered_clip:tau=1

      phalanx sim run --method k_async --sync hybrid:exp:50 --time 200 --delay volunteer --out runs/hybrid

      phalanx sim run --method grouped --workers 512 --group-size 16 --byzantine 102 --attack alie --aggregator centered_clip:tau=1 --updates 150
    """
    from phalanx.sim.config import ByzantineConfig, SimConfig

    _one_thread()
    config = SimConfig(
        method=method, workers=workers, delay=delay, budget=_budget(updates, gradients, time_budget), seed=seed,
        task=task, lr=lr, momentum=momentum, batch_size=batch_size, sync=sync, aggregator=aggregator,
        byzantine=ByzantineConfig(count=byzantine, attack=attack, start=attack_from), local_steps=local_steps,
        gossip_tau=gossip_tau, group_size=group_size, eval_points=eval_points, engine=engine,
    )  # fmt: skip
    from phalanx.sim.runner import describe, run_sim

    console = _console()
    with console.status(f"simulating {method} with {workers} workers..."):
        result = run_sim(config)
    _print_run(console, result, describe(config))
    if out is not None:
        _write_run(out, result.to_dict(staleness_trace=True), console)


@sim_app.command("grid")
def grid(
    preset: list[str] = typer.Option(..., "--preset", help="staleness, byzantine or groups; repeat to run several."),
    out: Path = typer.Option(Path("sim-results"), "--out", help="Folder for CSV, JSON and PNG files."),
    seeds: Optional[int] = typer.Option(None, "--seeds", min=1, help="Seeds per cell (default: 2)."),
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1, help="Parallel processes (default: cores, at most 2)."),
    report: Optional[Path] = typer.Option(None, "--report", help="Also write a Markdown report with tables, plots and checks (e.g. docs/results.md)."),
) -> None:  # fmt: skip
    """Run a comparison grid with a progress bar; write CSV/JSON and PNG plots to --out and print the tables.

    [bold]staleness[/bold]: every method × N ∈ {8, 16, 32} × delay ∈ {exp, const, volunteer} at equal gradients, the K-family at equal virtual time, one worker as the reference.

    [bold]byzantine[/bold]: SSGD, N = 16, b ∈ {0, 3, 7}, attacks × aggregators.

    [bold]groups[/bold]: grouped rounds, N = 512, one group of all against random groups of 32, 16 and 8, with 10 % and 20 % attackers.

    [bold]Examples[/bold]

      phalanx sim grid --preset staleness --out sim-results

      phalanx sim grid --preset byzantine --seeds 3 --jobs 2

      phalanx sim grid --preset staleness --preset byzantine --preset groups --out docs --report docs/results.md
    """
    import time

    from phalanx.errors import ConfigError
    from phalanx.sim.grid import cpu_seconds, default_jobs, run_grid, summarize, write_outputs
    from phalanx.sim.plots import plot_preset
    from phalanx.sim.presets import build_preset
    from phalanx.sim.report import Section, write_report

    jobs = jobs or default_jobs()
    if len(set(preset)) != len(preset):
        raise ConfigError(f"--preset lists a preset twice: {', '.join(preset)}")
    presets = [build_preset(name, seeds) for name in preset]
    console = _console()
    sections = []
    for p in presets:
        t0, cpu0 = time.perf_counter(), cpu_seconds()
        records = _run_with_progress(console, p, jobs, run_grid)
        wall_s, cpu_s = time.perf_counter() - t0, cpu_seconds() - cpu0
        summary = summarize(records)
        paths = write_outputs(out, f"sim_{p.name}", records)
        figures = plot_preset(p, records, summary, out)
        _print_tables(console, p, summary)
        console.print(
            f"[bold]{p.name}[/bold]: {len(records)} runs in {wall_s / 60:.1f} min ({cpu_s / 60:.1f} CPU-min); wrote "
            + ", ".join(str(x) for x in [*paths.values(), *(f for _, f in figures)])
        )
        sections.append(Section(p, records, summary, figures, wall_s, cpu_s, jobs))
    if report is not None:
        command = "phalanx sim grid " + " ".join(f"--preset {shlex.quote(x)}" for x in preset)
        command += f" --out {shlex.quote(str(out))}"
        command += "" if seeds is None else f" --seeds {seeds}"
        command += f" --report {shlex.quote(str(report))}"
        console.print(f"wrote {write_report(report, sections, command)}")


def _budget(updates: Optional[int], gradients: Optional[int], time_budget: Optional[float]) -> Any:
    from phalanx.errors import ConfigError
    from phalanx.sim.config import Budget

    given = {k: v for k, v in (("updates", updates), ("gradients", gradients), ("time", time_budget)) if v is not None}
    if len(given) > 1:
        raise ConfigError(f"give one budget, not {' and '.join('--' + k for k in given)}")
    kind, amount = next(iter(given.items()), ("gradients", 2000))
    return Budget(kind=kind, amount=float(amount))


def _console() -> Any:
    """Rich console; wide when writing to a file or pipe, so the grid tables are not cut."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # a tiny model: one thread beats two that wait on each other


def _run_with_progress(console: Any, preset: Any, jobs: int, run_grid: Any) -> list[dict[str, Any]]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(f"{preset.name} ({jobs} processes)", total=len(preset.runs))
        return run_grid(preset.runs, jobs=jobs, on_done=lambda i, r: progress.advance(task))


def _print_tables(console: Any, preset: Any, summary: Any) -> None:
    from rich.table import Table

    for spec in preset.tables:
        table = Table(title=f"{spec.title} ({spec.note})", title_justify="left")
        table.add_column("")
        for header, _, _ in spec.columns:
            table.add_column(header, justify="right")
        for row in spec.rows:
            cells = []
            for _, key, column in spec.columns:
                cell = summary.get((key, row, column))
                if cell is None:
                    cells.append("—")
                else:
                    acc = cell["final_accuracy"]
                    style = "red" if acc < 0.5 else "yellow" if acc < 0.9 else "green"
                    cells.append(f"[{style}]{acc:.3f}[/{style}]" + ("†" if cell["diverged"] else ""))
            table.add_row(row, *cells)
        console.print(table)


def _print_run(console: Any, result: Any, settings: dict[str, Any]) -> None:
    from rich.table import Table

    c = result.config
    summary = Table(title=f"{c.method}, N={c.workers}, {c.delay} delays, seed {c.seed}", show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    rows = [
        ("final test accuracy", f"{result.final_accuracy:.4f}"),
        ("best test accuracy", f"{result.best_accuracy:.4f}"),
        ("mean / max staleness", f"{result.mean_staleness:.2f} / {result.max_staleness}"),
        ("updates / gradients", f"{result.updates} / {result.gradients}"),
        ("virtual time", f"{result.time_s:.1f}"),
        ("diverged", "yes" if result.diverged else "no"),
    ]
    if result.final_spread is not None:
        rows += [
            ("spread: max ‖θ_i − θ̄‖/‖θ̄‖, honest", f"{result.final_spread:.2e}"),
            ("worst honest peer's accuracy", f"{result.worst_peer_accuracy:.4f}"),
            ("groups with a Byzantine majority", str(result.captured_groups)),
        ]
    rows += [
        ("settings", ", ".join(f"{k}={v}" for k, v in settings.items() if k != "method")),
        ("wall time", f"{result.wall_s:.1f} s"),
    ]
    for name, value in rows:
        summary.add_row(name, value)
    console.print(summary)
    grouped = result.final_spread is not None
    curve = Table(title="accuracy curve")
    for name in ("updates", "gradients", "virtual time", "test accuracy", "test loss", "spread" if grouped else "K"):
        curve.add_column(name, justify="right")
    for p in result.curve:
        last = f"{p.spread:.2e}" if grouped and p.spread is not None else "" if p.k is None else str(p.k)
        curve.add_row(
            str(p.updates), str(p.gradients), f"{p.time_s:.1f}", f"{p.accuracy:.4f}", f"{p.loss:.4f}", last
        )  # fmt: skip
    console.print(curve)


def _write_run(out: Path, record: dict[str, Any], console: Any) -> None:
    import csv
    import json

    from phalanx.sim.grid import json_ready
    from phalanx.sim.plots import plot_run

    out.mkdir(parents=True, exist_ok=True)
    record = json_ready(record)
    (out / "run.json").write_text(json.dumps(record))
    with (out / "curve.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(record["curve"][0]))
        writer.writeheader()
        writer.writerows(record["curve"])
    png = plot_run(record, out / "curve.png")
    console.print(f"wrote {out / 'run.json'}, {out / 'curve.csv'}, {png}")
