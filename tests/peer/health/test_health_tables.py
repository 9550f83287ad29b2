"""What `phalanx health` and the monitor show of a run's quality: the trainers' task's metric (test
accuracy, or validation loss with its perplexity), from the health records."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from phalanx.peer.health.record import HealthRecord
from phalanx.tools.health_client import render_table, rows_json, swarm_rows
from phalanx.tools.monitor.history import SwarmHistory
from phalanx.tools.monitor.page import render_page

NOW = 1_700_000_000.0
A, B = "QmAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "QmBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"


def record(peer: str, **changes) -> HealthRecord:
    fields = dict(
        peer_id=peer, role="trainer", state="online", version="0.1.0", protocol=1, run_id="phalanx", config_hash="ab",
        published_at=NOW, started_at=NOW - 60, addresses=[], reachability="direct", step=40, samples_per_s=480.0,
        loss=2.8,
    )  # fmt: skip
    return HealthRecord(**{**fields, **changes})


LANGUAGE_MODEL = {A: record(A, accuracy=0.31, eval_loss=2.5, metric="loss"), B: record(B, metric="loss")}
CLASSIFIER = {A: record(A, accuracy=0.9612, eval_loss=0.14)}


def _table(records: dict[str, HealthRecord]) -> tuple[list[str], str]:
    out = io.StringIO()
    Console(file=out, width=200).print(render_table(swarm_rows(records, now=NOW), title="t"))
    lines = out.getvalue().splitlines()
    header = next(line for line in lines if "peer" in line)
    return [c.strip() for c in header.split("┃")[1:-1]], out.getvalue()


@pytest.mark.parametrize(
    ("records", "columns", "cells"),
    [(LANGUAGE_MODEL, ["val loss", "perplexity"], ["2.5000", "12.18"]), (CLASSIFIER, ["accuracy"], ["0.9612"])],
)
def test_phalanx_health_shows_the_trainers_metric(records, columns, cells):
    header, text = _table(records)
    assert header[5:7 + len(columns)] == ["samples/s", "train loss", *columns], header
    row = next(line for line in text.splitlines() if A[-8:] in line)
    assert [c.strip() for c in row.split("│")[8 : 8 + len(cells)]] == cells, row
    assert rows_json(swarm_rows(records, now=NOW))["metric"] == records[A].metric


def test_the_monitor_page_and_its_evaluation_plot_show_the_trainers_metric():
    from phalanx.tools.monitor.plots import PLOTS, render_plot

    page = render_page("phalanx", swarm_rows(LANGUAGE_MODEL, now=NOW), polls=1)
    assert "<th>train loss</th><th>val loss</th><th>perplexity</th>" in page and "<th>accuracy</th>" not in page
    assert "<td class=\"num\">2.5000</td><td class=\"num\">12.18</td>" in page
    history = SwarmHistory()
    history.add(NOW, LANGUAGE_MODEL)
    history.add(NOW + 1, LANGUAGE_MODEL)
    assert history.series("eval_loss") == {A: ([NOW, NOW + 1], [2.5, 2.5])}
    assert "evaluation" in PLOTS and render_plot("evaluation", history).startswith(b"\x89PNG")
