"""The HTTP side of a peer's health: aiohttp on the peer's own event loop (no extra threads).

GET /healthz        200 while the process and its DHT are alive
GET /readyz         200 when connected, in sync, not banned, legal and seeing its whole swarm; 503 with the reasons
GET /metrics        Prometheus text format (a per-peer registry)
GET /api/v1/status  JSON: everything above plus peer ID, addresses, role, version, config hash
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from phalanx.aggregation.errors import ConfigError

logger = logging.getLogger(__name__)


class Endpoints(Protocol):
    """What a peer's routes answer from: its HealthService, which imports this module (not the reverse)."""

    peer_id: str

    def alive(self) -> bool: ...
    def readiness(self) -> tuple[bool, list[str]]: ...
    def metrics_text(self) -> bytes: ...
    def status(self) -> dict[str, Any]: ...


class HttpServer:
    """A running aiohttp site; `aclose()` stops it. Open with `open_http`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner, self.host, self.port = runner, host, port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def aclose(self) -> None:
        await self._runner.cleanup()


async def open_http(app: web.Application, host: str, port: int) -> HttpServer:
    """Serve `app` on host:port; a port in use is the user's to fix (one line, exit 2)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(
            f"--http-port: cannot listen on {host}:{port} ({e.strerror or e}); choose another port, or 0 to turn HTTP off"
        ) from None
    server = HttpServer(runner, host, port)
    logger.info(f"HTTP on {server.url} (/healthz /readyz /metrics /api/v1/status)")
    return server


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body, indent=1, sort_keys=True), status=status, content_type="application/json")


def peer_app(service: Endpoints) -> web.Application:
    """The routes of one peer."""

    async def healthz(_: web.Request) -> web.Response:
        alive = service.alive()
        return json_response({"alive": alive, "peer_id": service.peer_id}, 200 if alive else 503)

    async def readyz(_: web.Request) -> web.Response:
        ready, reasons = service.readiness()
        return json_response({"ready": ready, "reasons": reasons, "peer_id": service.peer_id}, 200 if ready else 503)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=service.metrics_text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(_: web.Request) -> web.Response:
        return json_response(service.status())

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/api/v1/status", status)
    return app
