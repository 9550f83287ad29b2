"""sim/grid.py, presets.py, plots.py and report.py on a tiny grid."""

from __future__ import annotations

import csv
import json

import pytest

from phalanx.errors import ConfigError
from phalanx.sim.config import Budget, SimConfig
from phalanx.sim.grid import GridRun, run_grid, summarize, write_outputs
from phalanx.sim.plots import plot_run
from phalanx.sim.presets import EQUAL_TIME_METHODS, STALENESS_DELAYS, STALENESS_WORKERS, TableSpec, build_preset
from phalanx.sim.report import (
    READING_END,
    READING_START,
    Check,
    checks_table,
    existing_reading,
    markdown_table,
    write_report,
)
from phalanx.sim.runner import policy_spec


def tiny_runs() -> list[GridRun]:
    budget = Budget(kind="gradients", amount=24)
    return [
        GridRun("t", method, "N=2", SimConfig(method=method, workers=2, budget=budget, seed=seed, eval_points=3))
        for method in ("asgd", "ssgd")
        for seed in (0, 1)
    ]


@pytest.fixture(scope="module")
def records():
    return run_grid(tiny_runs(), jobs=1)


def test_records_keep_the_order_and_the_cell(records):
    assert [(r["row"], r["config"]["seed"]) for r in records] == [("asgd", 0), ("asgd", 1), ("ssgd", 0), ("ssgd", 1)]
    assert all(r["table"] == "t" and r["column"] == "N=2" and r["gradients"] == 24 for r in records)


def test_parallel_processes_give_the_same_records(records):
    parallel = run_grid(tiny_runs(), jobs=2)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "wall_s"} for r in rs]  # noqa: E731
    assert strip(parallel) == strip(records)


def test_summary_averages_over_seeds(records):
    summary = summarize(records)
    cell = summary[("t", "asgd", "N=2")]
    assert cell["seeds"] == 2
    assert cell["final_accuracy"] == pytest.approx((records[0]["final_accuracy"] + records[1]["final_accuracy"]) / 2)


def test_outputs_and_plots(records, tmp_path):
    paths = write_outputs(tmp_path, "sim_tiny", records)
    with paths["runs_csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["asgd", "asgd", "ssgd", "ssgd"]
    assert json.loads(paths["runs_json"].read_text())[0]["curve"][0]["updates"] == 0
    with paths["summary_csv"].open() as f:
        assert len(list(csv.DictReader(f))) == 2
    png = plot_run(records[0], tmp_path / "run.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_table(records):
    table = TableSpec("t", "Tiny", "note", ("asgd", "ssgd", "gossip"), (("two", "t", "N=2"),))
    text = markdown_table(table, summarize(records))
    lines = text.splitlines()
    assert lines[:2] == ["|  | two |", "|---|---|"]
    assert lines[3].startswith("| ssgd | 0.") and lines[4] == "| gossip | — |"


def test_report_keeps_the_hand_written_reading(tmp_path):
    path = tmp_path / "results.md"
    path.write_text(f"old\n{READING_START}\nWe read this.\n{READING_END}\nold tail\n")
    assert existing_reading(path).strip() == "We read this."
    write_report(path, [], "phalanx sim grid --preset staleness")
    text = path.read_text()
    assert "phalanx sim grid --preset staleness" in text and "We read this." in text and "old tail" not in text
    assert checks_table([Check("a", "agrees", "b")]).splitlines()[-1] == "| a | **agrees** | b |"


def test_presets_cover_the_issue_grids():
    staleness = build_preset("staleness")
    cells = len(STALENESS_WORKERS) * len(STALENESS_DELAYS)
    assert len(staleness.runs) == 2 * (1 + cells * (18 + len(EQUAL_TIME_METHODS)))
    byzantine = build_preset("byzantine", seeds=1)
    assert len(byzantine.runs) == 7 * (1 + 2 * 8)
    for preset in (staleness, byzantine, build_preset("groups")):
        keys = {(r.table, r.row, r.column) for r in preset.runs}
        for table in preset.tables:
            assert {(k, row, c) for row in table.rows for _, k, c in table.columns} <= keys
        for run in preset.runs[:40]:
            policy_spec(run.config)  # every config resolves
    groups = build_preset("groups")
    assert len(groups.runs) == 4 * (1 + 2 * 4)
    assert {r.config.method for r in groups.runs} == {"grouped"}
    assert "grouped" not in staleness.tables[0].rows
    with pytest.raises(ConfigError, match="--preset 'speed' is unknown; use one of staleness, byzantine, groups"):
        build_preset("speed")


def test_the_groups_section_renders_from_a_tiny_grid(tmp_path):
    from phalanx.sim.config import ByzantineConfig
    from phalanx.sim.plots import plot_preset
    from phalanx.sim.presets import NO_ATTACK, Preset
    from phalanx.sim.report import Section

    preset = build_preset("groups")
    runs = [
        GridRun(key, row, column, SimConfig(
            method="grouped", workers=8, group_size=size, budget=Budget(kind="updates", amount=4), eval_points=2,
            aggregator="centered_clip:tau=1", byzantine=ByzantineConfig(count=b, attack="alie"),
        ))
        for row, size in (("one group", None), ("G=16", 4))
        for key, column, b in (("b=0", NO_ATTACK, 0), ("20%", "ALIE", 2))
    ]  # fmt: skip
    tiny = Preset("groups", preset.title, runs, preset.tables)
    records = run_grid(runs, jobs=1)
    summary = summarize(records)
    assert summary[("20%", "G=16", "ALIE")]["final_spread"] > 0
    figures = plot_preset(tiny, records, summary, tmp_path)
    assert [p.name for _, p in figures] == ["sim_groups.png", "sim_groups_curves.png"]
    path = write_report(tmp_path / "results.md", [Section(tiny, records, summary, figures, 1.0, 1.0, 1)], "cmd")
    text = path.read_text()
    assert "Byzantine-majority groups: seen / expected per run" in text
    assert "<!-- doc-test: skip long: 4 simulated runs" in text  # the docs tests never run the grid
    assert "20% attackers, groups of 16: within 0.01 of one group of all under every attack" in text
