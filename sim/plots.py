"""PNG plots of grid results (matplotlib, Agg backend: no display needed). Small files: dpi 80.

Heatmaps show a table's mean final accuracy per cell; curve plots average each method's
accuracy curve over seeds after interpolating it onto a common x grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from phalanx.sim.presets import NO_ATTACK, Preset, TableSpec  # noqa: E402

DPI = 90
CURVE_METHODS = ("ssgd", "asgd", "nag_asgd", "sa", "ga", "ga_momentum", "dana_zero", "dana_ga", "lasgd", "gossip")


def heatmap(ax: Any, table: TableSpec, summary: dict[tuple[str, str, str], dict[str, Any]]) -> None:
    """Mean final accuracy of every (row, column) of ``table``, annotated; missing cells blank."""
    values = np.full((len(table.rows), len(table.columns)), np.nan)
    for i, row in enumerate(table.rows):
        for j, (_, key, column) in enumerate(table.columns):
            cell = summary.get((key, row, column))
            if cell is not None:
                values[i, j] = cell["final_accuracy"]
    ax.imshow(values, cmap="RdYlGn", vmin=0.1, vmax=1.0, aspect="auto")
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            if not np.isnan(values[i, j]):
                ax.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(table.columns)), [c[0] for c in table.columns], rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(table.rows)), table.rows, fontsize=8)
    ax.set_title(table.title, fontsize=10)


def mean_curve(records: Sequence[dict[str, Any]], x: str, points: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """(x grid, mean accuracy) over runs; x is 'gradients', 'updates' or 'time_s'. Grid up to the shortest run."""
    end = min(r["curve"][-1][x] for r in records)
    grid = np.linspace(0.0, end, points)
    ys = [np.interp(grid, [c[x] for c in r["curve"]], [_acc(c["accuracy"]) for c in r["curve"]]) for r in records]
    return grid, np.mean(ys, axis=0)


def _acc(a: float | None) -> float:
    return 0.0 if a is None else a


def curves(
    ax: Any,
    records: Sequence[dict[str, Any]],
    *,
    table: str,
    column: str,
    rows: Sequence[str],
    x: str,
    title: str,
) -> None:
    """One line per row (method or aggregator) of one (table, column), averaged over seeds."""
    for row in rows:
        runs = [r for r in records if (r["table"], r["row"], r["column"]) == (table, row, column)]
        if runs:
            gx, gy = mean_curve(runs, x)
            ax.plot(gx, gy, label=row, lw=1.2)
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel({"gradients": "gradients", "updates": "updates", "time_s": "virtual time"}[x], fontsize=8)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=7)


def plot_preset(
    preset: Preset, records: list[dict[str, Any]], summary: dict[tuple[str, str, str], dict[str, Any]], out: Path
) -> list[tuple[str, Path]]:
    """Write the preset's figures into ``out``; returns (caption, path) per figure."""
    out.mkdir(parents=True, exist_ok=True)
    if preset.name == "staleness":
        return _staleness(preset, records, summary, out)
    if preset.name == "groups":
        return _groups(preset, records, summary, out)
    return _byzantine(preset, records, summary, out)


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _staleness(preset: Preset, records: list[dict[str, Any]], summary: dict, out: Path) -> list[tuple[str, Path]]:
    tables = {t.key: t for t in preset.tables}
    figures = []
    fig, ax = plt.subplots(figsize=(10, 7.5))
    heatmap(ax, tables["gradients"], summary)
    figures.append(("Final accuracy at equal gradients", _save(fig, out / "sim_staleness_gradients.png")))

    fig, ax = plt.subplots(figsize=(10, 4))
    heatmap(ax, tables["time"], summary)
    figures.append(("Final accuracy at equal virtual time", _save(fig, out / "sim_staleness_time.png")))

    reference = [r for r in records if r["table"] == "reference"]
    n_max = max(r["config"]["workers"] for r in records)
    delays = sorted({r["config"]["delay"] for r in records if r["table"] == "gradients"}, key=_delay_order)
    fig, axes = plt.subplots(1, len(delays), figsize=(4.5 * len(delays), 3.8), sharey=True, squeeze=False)
    for ax, delay in zip(axes[0], delays, strict=True):
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors[::2] + plt.get_cmap("tab20").colors[1::2])
        curves(
            ax, records, table="gradients", column=f"N={n_max} {delay}", rows=CURVE_METHODS, x="gradients",
            title=f"N={n_max}, {delay} delays",
        )  # fmt: skip
        if reference:
            gx, gy = mean_curve(reference, "gradients")
            ax.plot(gx, gy, "k--", lw=1, label="1 worker")
    axes[0][0].set_ylabel("test accuracy", fontsize=8)
    axes[0][-1].legend(fontsize=6, loc="lower right", ncol=2)
    figures.append((f"Accuracy vs gradients at N={n_max}", _save(fig, out / "sim_staleness_curves.png")))

    time_rows = tables["time"].rows
    ns = sorted({r["config"]["workers"] for r in records if r["table"] == "time"})
    n_mid = ns[len(ns) // 2]
    fig, axes = plt.subplots(1, len(delays), figsize=(4 * len(delays), 3.4), sharey=True, squeeze=False)
    for ax, delay in zip(axes[0], delays, strict=True):
        curves(
            ax, records, table="time", column=f"N={n_mid} {delay}", rows=time_rows, x="time_s",
            title=f"N={n_mid}, {delay} delays",
        )  # fmt: skip
    axes[0][0].set_ylabel("test accuracy", fontsize=8)
    axes[0][-1].legend(fontsize=6, loc="lower right", ncol=2)
    figures.append((f"Accuracy vs virtual time at N={n_mid}", _save(fig, out / "sim_staleness_time_curves.png")))
    return figures


def _heatmaps(preset: Preset, summary: dict, caption: str, path: Path, width: float, height: float) -> tuple[str, Path]:
    """One figure with a heatmap per table of the preset, stacked (each `height` inches tall)."""
    fig, axes = plt.subplots(len(preset.tables), 1, figsize=(width, height * len(preset.tables)), squeeze=False)
    for ax, table in zip(axes[:, 0], preset.tables, strict=True):
        heatmap(ax, table, summary)
    fig.tight_layout()
    return caption, _save(fig, path)


def _byzantine(preset: Preset, records: list[dict[str, Any]], summary: dict, out: Path) -> list[tuple[str, Path]]:
    figures = [_heatmaps(preset, summary, "Final accuracy per aggregator and attack", out / "sim_byzantine.png", 8, 4)]

    last = preset.tables[-1]
    attacks = [c for c in last.columns if c[0] != NO_ATTACK][:4]
    fig, axes = plt.subplots(1, len(attacks), figsize=(3.6 * len(attacks), 3.2), sharey=True, squeeze=False)
    for ax, (header, key, column) in zip(axes[0], attacks, strict=True):
        curves(ax, records, table=key, column=column, rows=last.rows, x="updates", title=f"{key}, {header}")
    axes[0][0].set_ylabel("test accuracy", fontsize=8)
    axes[0][-1].legend(fontsize=6, loc="lower right")
    figures.append((f"Accuracy vs updates, {last.key}", _save(fig, out / "sim_byzantine_curves.png")))
    return figures


def _groups(preset: Preset, records: list[dict[str, Any]], summary: dict, out: Path) -> list[tuple[str, Path]]:
    figures = [_heatmaps(preset, summary, "Final accuracy per group size and attack", out / "sim_groups.png", 7, 2.6)]

    first = preset.tables[0]
    panels = [(first.key, "ALIE"), (first.key, "sign flip"), ("b=0", NO_ATTACK)]
    fig, axes = plt.subplots(2, len(panels), figsize=(3.8 * len(panels), 6), sharex=True, squeeze=False)
    for j, (key, column) in enumerate(panels):
        title = column if key == "b=0" else f"{key}, {column}"
        curves(axes[0][j], records, table=key, column=column, rows=first.rows, x="updates", title=title)
        ax = axes[1][j]
        for row in first.rows:
            runs = [r for r in records if (r["table"], r["row"], r["column"]) == (key, row, column)]
            if runs and runs[0]["curve"][-1].get("spread") is not None:
                curve = runs[0]["curve"]
                ax.plot([c["updates"] for c in curve[1:]], [max(c["spread"] or 0, 1e-8) for c in curve[1:]], label=row)
        ax.set_yscale("log")
        ax.set_xlabel("rounds", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("test accuracy", fontsize=8)
    axes[1][0].set_ylabel("spread max ‖θ_i − θ̄‖/‖θ̄‖", fontsize=8)
    axes[0][-1].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    figures.append(
        ("Accuracy and spread of the honest peers' models vs rounds", _save(fig, out / "sim_groups_curves.png"))
    )
    return figures


def _delay_order(name: str) -> int:
    order = ("exp", "const", "volunteer")
    return order.index(name) if name in order else len(order)


def plot_run(record: dict[str, Any], path: Path) -> Path:
    """Accuracy against updates and against virtual time for one `phalanx sim run`."""
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    curve = record["curve"]
    for ax, x, label in ((axes[0], "updates", "updates"), (axes[1], "time_s", "virtual time")):
        ax.plot([c[x] for c in curve], [_acc(c["accuracy"]) for c in curve], marker=".", lw=1.2)
        ax.set_xlabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy", fontsize=8)
    axes[0].set_ylim(0.0, 1.0)
    c = record["config"]
    fig.suptitle(f"{c['method']}, N={c['workers']}, {c['delay']} delays, seed {c['seed']}", fontsize=9)
    return _save(fig, path)
