"""The monitor process: a client-mode DHT node that polls every peer's health record, and the
dashboard it serves on the same event loop.

    GET /                    the page: peer table and plots (refreshes itself)
    GET /plots/<kind>.png    loss | evaluation (the task's metric) | throughput | states
    GET /api/v1/status       JSON: the monitor itself, every peer (record + problems), counts by state
    GET /api/v1/peers        JSON: the peer table only
    GET /metrics             Prometheus: the swarm, aggregated from the records
    GET /healthz, /readyz    the monitor's own liveness and readiness
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import hivemind
from aiohttp import web
from hivemind.utils import get_dht_time
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from phalanx.peer.config import MonitorSettings
from phalanx.peer.health.metrics import package_version, render
from phalanx.peer.health.server import HttpServer, json_response, open_http
from phalanx.peer.health.service import fetch_records
from phalanx.tools.health_client import PeerRow, open_observer, rows_json, swarm_rows
from phalanx.tools.monitor.history import STATES, SwarmHistory
from phalanx.tools.monitor.page import render_page
from phalanx.tools.monitor.plots import PLOTS, render_plot

logger = logging.getLogger(__name__)


class Monitor:
    """Polls the records into a `SwarmHistory`; the HTTP handlers only read it."""

    def __init__(self, dht: hivemind.DHT, settings: MonitorSettings) -> None:
        self.dht, self.settings = dht, settings
        self.history = SwarmHistory(max_points=settings.history_points)
        self.invalid_records = 0
        self.started = time.monotonic()
        self.registry = CollectorRegistry()
        self.registry.register(SwarmCollector(self))
        self._renderer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plots")
        self._plot_cache: dict[str, tuple[int, bytes]] = {}
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="monitor-poll")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._renderer.shutdown(wait=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning(f"poll failed: {e!r}")
            await asyncio.sleep(self.settings.poll_s)

    async def poll(self) -> None:
        found, invalid = await fetch_records(self.dht, self.settings.run_id)
        self.invalid_records += invalid
        self.history.add(get_dht_time(), {p: r for p, (r, _) in found.items()})

    def rows(self) -> list[PeerRow]:
        return swarm_rows(self.history.latest, now=get_dht_time())

    async def plot(self, kind: str) -> bytes:
        """The PNG for `kind` as of the latest poll (rendered at most once per poll)."""
        cached = self._plot_cache.get(kind)
        if cached is not None and cached[0] == self.history.polls:
            return cached[1]
        polls = self.history.polls
        png = await asyncio.get_running_loop().run_in_executor(self._renderer, render_plot, kind, self.history)
        self._plot_cache[kind] = (polls, png)
        return png

    def readiness(self) -> tuple[bool, list[str]]:
        reasons = []
        if not self.dht.is_alive():
            reasons.append("the DHT process is not running")
        if self.history.last_poll_at is None:
            reasons.append("no poll of the health records completed yet")
        elif get_dht_time() - self.history.last_poll_at > 5 * self.settings.poll_s + 10:
            reasons.append(f"last successful poll {get_dht_time() - self.history.last_poll_at:.0f} s ago")
        return not reasons, reasons

    def status(self) -> dict[str, Any]:
        ready, reasons = self.readiness()
        table = rows_json(self.rows())
        return {
            "monitor": {
                "run_id": self.settings.run_id,
                "version": package_version(),
                "ready": ready,
                "not_ready_because": reasons,
                "polls": self.history.polls,
                "poll_s": self.settings.poll_s,
                "uptime_s": round(time.monotonic() - self.started, 3),
                "invalid_records": self.invalid_records,
            },
            **table,
        }


class SwarmCollector(Collector):
    """Prometheus families for the whole swarm, one label per peer, from the latest records."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        rows = self.monitor.rows()
        info = InfoMetricFamily("phalanx_monitor_build", "Version and run of this monitor.")
        info.add_metric([], {"version": package_version(), "run_id": self.monitor.settings.run_id})
        yield info
        by_state = GaugeMetricFamily(
            "phalanx_swarm_peers", "Peers with a valid health record, by state.", labels=["state"]
        )
        for state in STATES:
            by_state.add_metric([state], sum(r.state == state for r in rows))
        yield by_state
        total = GaugeMetricFamily(
            "phalanx_swarm_samples_per_second",
            "Sum of the trainers' throughput.",
            value=sum(r.samples_per_s for r in rows),
        )
        yield total
        labels = ["peer", "role"]
        families = {
            "step": GaugeMetricFamily("phalanx_swarm_peer_step", "Training step per peer.", labels=labels),
            "sps": GaugeMetricFamily("phalanx_swarm_peer_samples_per_second", "Throughput per peer.", labels=labels),
            "loss": GaugeMetricFamily("phalanx_swarm_peer_loss", "Last minibatch loss per peer.", labels=labels),
            "accuracy": GaugeMetricFamily("phalanx_swarm_peer_accuracy", "Last evaluation's accuracy per peer.", labels=labels),
            "eval_loss": GaugeMetricFamily("phalanx_swarm_peer_eval_loss", "Last evaluation's loss per peer.", labels=labels),
            "seen": GaugeMetricFamily(
                "phalanx_swarm_peer_last_seen_seconds", "Age of each peer's record.", labels=labels
            ),
            "problems": GaugeMetricFamily(
                "phalanx_swarm_peer_problems", "Problems found per peer (0: healthy).", labels=labels
            ),
        }
        rounds = CounterMetricFamily(
            "phalanx_swarm_peer_rounds", "Rounds per peer by outcome.", labels=[*labels, "outcome"]
        )
        for r in rows:
            key = [r.peer_id, r.role]
            families["step"].add_metric(key, r.step)
            families["sps"].add_metric(key, r.samples_per_s)
            if r.loss is not None:
                families["loss"].add_metric(key, r.loss)
            if r.accuracy is not None:
                families["accuracy"].add_metric(key, r.accuracy)
            if r.eval_loss is not None:
                families["eval_loss"].add_metric(key, r.eval_loss)
            families["seen"].add_metric(key, r.last_seen_s)
            families["problems"].add_metric(key, len(r.problems))
            for outcome, value in (
                ("ok", r.rounds.ok),
                ("partial", r.rounds.partial),
                ("failed", r.rounds.failed),
                ("resync", r.rounds.resyncs),
            ):
                rounds.add_metric([*key, outcome], value)
        yield from families.values()
        yield rounds
        yield CounterMetricFamily(
            "phalanx_swarm_invalid_records", "Health records dropped as invalid.", value=self.monitor.invalid_records
        )


def monitor_app(monitor: Monitor) -> web.Application:
    async def page(_: web.Request) -> web.Response:
        return web.Response(
            text=render_page(monitor.settings.run_id, monitor.rows(), monitor.history.polls), content_type="text/html"
        )

    async def plot(request: web.Request) -> web.Response:
        kind = request.match_info["kind"]
        if kind not in PLOTS:
            raise web.HTTPNotFound(text=f"no plot {kind!r}; choose from {', '.join(PLOTS)}")
        return web.Response(
            body=await monitor.plot(kind), content_type="image/png", headers={"Cache-Control": "no-store"}
        )

    async def status(_: web.Request) -> web.Response:
        return json_response(monitor.status())

    async def peers(_: web.Request) -> web.Response:
        return json_response({"polls": monitor.history.polls, **rows_json(monitor.rows())})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=render(monitor.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        alive = monitor.dht.is_alive()
        return json_response({"alive": alive}, 200 if alive else 503)

    async def readyz(_: web.Request) -> web.Response:
        ready, reasons = monitor.readiness()
        return json_response({"ready": ready, "reasons": reasons}, 200 if ready else 503)

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/plots/{kind}.png", plot)
    app.router.add_get("/api/v1/status", status)
    app.router.add_get("/api/v1/peers", peers)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def serve_monitor(settings: MonitorSettings, stop: asyncio.Event) -> None:
    dht = await open_observer(settings)
    monitor = Monitor(dht, settings)
    http: Optional[HttpServer] = None
    try:
        await monitor.start()
        http = await open_http(monitor_app(monitor), settings.http_host, settings.http_port)
        logger.info(f"dashboard on {http.url}/")
        await stop.wait()
    finally:
        if http is not None:
            await http.aclose()
        await monitor.aclose()
        await asyncio.get_running_loop().run_in_executor(None, dht.shutdown)


def run_monitor(settings: MonitorSettings) -> None:
    """Serve the dashboard until SIGINT/SIGTERM."""
    import uvloop

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_monitor(settings, stop)

    uvloop.run(main())
