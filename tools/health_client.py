"""`phalanx health`: join the DHT as a client, read every peer's signed health record and print
a table (or JSON), once or every few seconds.

    phalanx health --initial-peers /ip4/…/p2p/Qm…              one table
    phalanx health --initial-peers … --json                      one JSON document
    phalanx health --initial-peers … --watch                     a live table
    phalanx health --initial-peers … --expect 3 --timeout-s 60   wait until 3 peers are online (exit 1 if not)
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Optional

import hivemind
from hivemind.utils import get_dht_time
from rich.console import Console
from rich.live import Live
from rich.table import Table

from phalanx.peer.config import NetworkSettings
from phalanx.peer.health.legality import swarm_problems
from phalanx.peer.health.record import HealthRecord
from phalanx.peer.health.service import fetch_records, install_validator
from phalanx.peer.node import start_dht
from phalanx.protocol.round_counts import RoundCounts
from phalanx.tasks.metric import ACCURACY, METRICS, Metric

logger = logging.getLogger(__name__)


@dataclass
class PeerRow:
    """One line of the table (and one object of the JSON output)."""

    peer_id: str
    short_id: str
    role: str
    state: str
    version: str
    step: int
    samples_per_s: float
    loss: Optional[float]  # last minibatch loss
    accuracy: Optional[float]  # last evaluation's, on the task's held-out split
    eval_loss: Optional[float]  # the same evaluation's loss
    metric: str  # which of accuracy and eval_loss the task is judged by
    last_seen_s: float  # seconds since the record was signed
    reachability: str
    relayed_bytes: int  # its rounds' bytes to and from peers reached through a relay
    rounds: RoundCounts  # in the JSON output: {"ok": …, "partial": …, "failed": …, "resyncs": …}
    config_hash: str
    legal: bool
    problems: list[str]
    record: dict[str, Any]

    def value(self, metric: Metric) -> Optional[float]:
        """Its last evaluation's value of `metric`."""
        return self.accuracy if metric.key == "accuracy" else self.eval_loss

    def reach(self) -> str:
        """How others reach it, and what its rounds moved through relays."""
        relayed = f" ({self.relayed_bytes / 1e6:.1f} MB relayed)" if self.relayed_bytes else ""
        return self.reachability + relayed


def swarm_metric(keys: Iterable[str]) -> Metric:
    """What the run's trainers are judged by, from their records' `metric` (the most common one; test
    accuracy when there is none): tables and plots show it."""
    found = Counter(keys).most_common(1)
    return METRICS.get(found[0][0], ACCURACY) if found else ACCURACY


def swarm_rows(records: dict[str, HealthRecord], *, now: float) -> list[PeerRow]:
    """Rows sorted by role (bootstrap first), then peer ID."""
    problems = swarm_problems(records, now=now)
    rows = []
    for peer, r in records.items():
        rows.append(
            PeerRow(
                peer_id=peer,
                short_id=peer[-8:],
                role=r.role,
                state=r.state,
                version=r.version,
                step=r.step,
                samples_per_s=round(r.samples_per_s, 1),
                loss=r.loss,
                accuracy=r.accuracy,
                eval_loss=r.eval_loss,
                metric=r.metric,
                last_seen_s=round(max(0.0, now - r.published_at), 1),
                reachability=r.reachability,
                relayed_bytes=r.relayed_bytes,
                rounds=RoundCounts(r.rounds_ok, r.rounds_partial, r.rounds_failed, r.resyncs),
                config_hash=r.config_hash,
                legal=r.legal,
                problems=problems[peer],
                record=r.model_dump(mode="json"),
            )
        )
    return sorted(rows, key=lambda row: (row.role != "bootstrap", row.peer_id))


def render_table(rows: list[PeerRow], *, title: str) -> Table:
    """One row per peer; the evaluation columns are the trainers' task's metric (accuracy, or validation
    loss and perplexity)."""
    metric = swarm_metric(r.metric for r in rows if r.role == "trainer")
    table = Table(title=title, expand=False)
    numbers = ("step", "samples/s", "train loss", *metric.columns, "last seen")
    for col in ("peer", "role", "state", "version", *numbers[:3], *metric.columns, "last seen", "reach", "problems"):
        table.add_column(col, justify="right" if col in numbers else "left")
    for row in rows:
        state_style = {"online": "green", "joining": "yellow", "offline": "dim"}.get(row.state, "")
        table.add_row(
            row.short_id,
            row.role,
            f"[{state_style}]{row.state}[/]" if state_style else row.state,
            row.version,
            str(row.step),
            f"{row.samples_per_s:.0f}",
            "" if row.loss is None else f"{row.loss:.4f}",
            *metric.cells(row.value(metric)),
            f"{row.last_seen_s:.0f} s",
            row.reach(),
            "[red]" + "; ".join(row.problems) + "[/]" if row.problems else "[green]none[/]",
        )
    return table


def rows_json(rows: list[PeerRow]) -> dict[str, Any]:
    states: dict[str, int] = {}
    for row in rows:
        states[row.state] = states.get(row.state, 0) + 1
    return {
        "t": time.time(),
        "metric": swarm_metric(r.metric for r in rows if r.role == "trainer").key,  # what the peers' tables show
        "peers": [asdict(r) for r in rows],
        "by_state": states,
        "problems": sum(bool(r.problems) for r in rows),
    }


async def open_observer(settings: NetworkSettings) -> hivemind.DHT:
    """A client-mode DHT node (it only dials out) that refuses forged health records."""
    dht = await asyncio.get_running_loop().run_in_executor(None, lambda: start_dht(settings, client_mode=True))
    try:
        await install_validator(dht, settings.run_id)
    except BaseException:
        dht.shutdown()
        raise
    return dht


async def _poll(dht: hivemind.DHT, run_id: str) -> list[PeerRow]:
    found, invalid = await fetch_records(dht, run_id)
    if invalid:
        logger.warning(f"dropped {invalid} invalid health record(s)")
    return swarm_rows({p: r for p, (r, _) in found.items()}, now=get_dht_time())


async def run_health_async(
    settings: NetworkSettings,
    *,
    as_json: bool,
    watch: bool,
    interval_s: float,
    expect: int,
    timeout_s: float,
    console: Console,
) -> int:
    dht = await open_observer(settings)
    try:
        deadline = time.monotonic() + timeout_s
        rows = await _poll(dht, settings.run_id)
        while expect and sum(r.state == "online" for r in rows) < expect and time.monotonic() < deadline:
            await asyncio.sleep(min(interval_s, 1.0))
            rows = await _poll(dht, settings.run_id)
        if expect and sum(r.state == "online" for r in rows) < expect:
            logger.error(
                f"only {sum(r.state == 'online' for r in rows)} of {expect} expected peers online after {timeout_s:.0f} s"
            )
            _print(rows, as_json, console, settings.run_id)
            return 1
        if not watch:
            _print(rows, as_json, console, settings.run_id)
            return 0 if rows else 1
        if as_json:
            while True:
                _print(rows, True, console, settings.run_id)
                await asyncio.sleep(interval_s)
                rows = await _poll(dht, settings.run_id)
        with Live(_table(rows, settings.run_id), console=console, refresh_per_second=2) as live:
            while True:
                await asyncio.sleep(interval_s)
                rows = await _poll(dht, settings.run_id)
                live.update(_table(rows, settings.run_id))
    finally:
        await asyncio.get_running_loop().run_in_executor(None, dht.shutdown)


def _table(rows: list[PeerRow], run_id: str) -> Table:
    online = sum(r.state == "online" for r in rows)
    return render_table(
        rows, title=f"swarm {run_id!r}: {len(rows)} peers, {online} online — {time.strftime('%H:%M:%S')}"
    )


def _print(rows: list[PeerRow], as_json: bool, console: Console, run_id: str) -> None:
    if as_json:
        sys.stdout.write(json.dumps(rows_json(rows)) + "\n")
        sys.stdout.flush()
    else:
        console.print(_table(rows, run_id))


def run_health(
    settings: NetworkSettings, *, as_json: bool, watch: bool, interval_s: float, expect: int, timeout_s: float
) -> int:
    """Exit status: 0 when peers were found (and --expect was met), 1 otherwise."""
    import uvloop

    console = Console()
    if not console.is_terminal:
        console.width = 160  # logs and pipes: do not squeeze the table into 80 columns

    async def main() -> int:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await run_health_async(
                settings,
                as_json=as_json,
                watch=watch,
                interval_s=interval_s,
                expect=expect,
                timeout_s=timeout_s,
                console=console,
            )
        except asyncio.CancelledError:
            return 0  # our own signal handler cancelled the top task: Ctrl-C is how --watch ends

    return uvloop.run(main())
