"""The HTTP side of a peer's health: aiohttp on the peer's own event loop (no extra threads).

GET /healthz        200 while the process and its DHT are alive
GET /readyz         200 when connected, in sync, not banned, legal and seeing its whole swarm; 503 with the reasons
GET /metrics        Prometheus text format (a per-peer registry)
GET /api/v1/status  JSON: everything above plus peer ID, addresses, role, version, config hash
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable, Optional, Protocol

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST

from phalanx.errors import ConfigError

logger = logging.getLogger(__name__)

# The port may face the internet (--http-host 0.0.0.0), so a client gets little for free:
HEADER_DEADLINE_S = 5.0  # to finish a request's headers, from connecting or from the previous response
LINGER_S = 5.0  # reading a body no route wants before closing (all routes are GETs)
MAX_CONNECTIONS_PER_SOURCE = 16  # open at once from one address: a prober or a scraper needs one or two
MAX_CONNECTIONS = 256  # open at once from all addresses
NOTICE_INTERVAL_S = 60.0  # a malformed request or a refused connection: one log line per source per this
MAX_NOTICE_SOURCES = 128  # sources logged per NOTICE_INTERVAL_S; more are silent, so no address range floods the log
MAX_NOTICE_CHARS = 240  # of one such line (it quotes what the client sent)


class Endpoints(Protocol):
    """What a peer's routes answer from: its HealthService, which imports this module (not the reverse)."""

    peer_id: str

    def alive(self) -> bool: ...
    def readiness(self) -> tuple[bool, list[str]]: ...
    def metrics_text(self) -> bytes: ...
    def status(self) -> dict[str, Any]: ...


class Notices:
    """One INFO line per source per NOTICE_INTERVAL_S: what clients do wrong is worth knowing, not a
    line per attempt, which would let anyone who reaches the port fill the peer's log."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: dict[str, float] = {}

    def info(self, source: str, line: str) -> bool:
        """Log `line` unless `source` was logged within NOTICE_INTERVAL_S; whether it was logged."""
        now = self._clock()
        if len(self._last) >= MAX_NOTICE_SOURCES:
            self._last = {k: t for k, t in self._last.items() if now - t < NOTICE_INTERVAL_S}
        last = self._last.get(source)
        if (last is not None and now - last < NOTICE_INTERVAL_S) or len(self._last) >= MAX_NOTICE_SOURCES:
            return False
        self._last[source] = now
        logger.info(line[:MAX_NOTICE_CHARS])
        return True


class _ServerLog(logging.LoggerAdapter):
    """aiohttp's server log, except for requests it cannot parse: those are the client's doing, so a
    throttled line instead of an ERROR with a traceback each. Its own errors still log in full."""

    def __init__(self, notices: Notices) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self._notices = notices

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **kwargs: Any) -> None:
        if isinstance(exc_info, (HttpProcessingError, web.RequestPayloadError)):
            where = str(msg) % args if args else str(msg)  # "Error handling request from <address>"
            detail = getattr(exc_info, "message", "") or str(exc_info)
            self._notices.info(where, f"malformed HTTP request: {where}: {type(exc_info).__name__} {detail!r}")
            return
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)


class _Gate(asyncio.Protocol):
    """Admits a connection to aiohttp unless its address, or all addresses together, hold too many."""

    def __init__(self, server: web.Server, notices: Notices) -> None:
        self._server, self._notices = server, notices

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        source = _host(transport)
        live = [_host(h.transport) for h in self._server.connections if h.transport is not None]
        if len(live) >= MAX_CONNECTIONS or live.count(source) >= MAX_CONNECTIONS_PER_SOURCE:
            self._notices.info(f"refused {source}", f"HTTP: refused a connection from {source} ({len(live)} open)")
            transport.abort()
            return
        handler = self._server()
        transport.set_protocol(handler)
        handler.connection_made(transport)


def _host(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


class HttpServer:
    """A running aiohttp app; `aclose()` stops it. Open with `open_http`."""

    def __init__(self, runner: web.AppRunner, listener: asyncio.Server, host: str, port: int) -> None:
        self._runner, self._listener, self.host, self.port = runner, listener, host, port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def aclose(self) -> None:
        self._listener.close()
        await self._runner.cleanup()  # closes the connections still open
        await self._listener.wait_closed()


async def open_http(app: web.Application, host: str, port: int) -> HttpServer:
    """Serve `app` on host:port; a port in use is the user's to fix (one line, exit 2).

    Port 0 picks a free port (`HttpServer.port` says which). The listener is ours rather than a
    web.TCPSite so that `_Gate` sees each connection before aiohttp does."""
    notices = Notices()
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        logger=_ServerLog(notices),
        # the header deadline: aiohttp arms this timer on connecting and after each response, and on
        # expiry closes the connection if it is still waiting for a whole request
        keepalive_timeout=HEADER_DEADLINE_S,
        lingering_time=LINGER_S,
    )
    await runner.setup()
    server: Optional[web.Server] = runner.server
    if server is None:  # setup() always makes one; a typed guard, not an expected case
        raise RuntimeError("aiohttp runner has no server after setup")
    try:
        listener = await asyncio.get_running_loop().create_server(
            lambda: _Gate(server, notices), host, port, reuse_address=True
        )
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(
            f"--http-port: cannot listen on {host}:{port} ({e.strerror or e}); choose another port, or 0 to turn HTTP off"
        ) from None
    bound = listener.sockets[0].getsockname()[1] if listener.sockets else port
    http = HttpServer(runner, listener, host, bound)
    logger.info(f"HTTP on {http.url} (/healthz /readyz /metrics /api/v1/status)")
    return http


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
