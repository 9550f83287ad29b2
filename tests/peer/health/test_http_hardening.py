"""The health port against clients that misbehave: a malformed request is answered 400 and costs the
log one line, not an ERROR with a traceback; headers not finished within the deadline close the
connection; one address cannot hold more than its share of connections."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import pytest
import uvloop

from phalanx.peer.health import server
from phalanx.peer.health.server import open_http, peer_app
from tests.peer.health.health_swarm import free_port

pytestmark = pytest.mark.timeout(300)

BOUND_S = 60.0  # how long a test waits for what should happen: far above every deadline under test, never a measure

MALFORMED = {
    "tls hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,
    "garbage": b"\x00\xff\xfe garbage \r\n\r\n",
    "no version": b"GET\r\n\r\n",
    "bad version": b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
    "header without colon": b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n",
    "nul in a header": b"GET /healthz HTTP/1.1\r\nHost: \x00x\r\n\r\n",
    "oversized header": b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n",
    "oversized request line": b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n",
    "too many headers": b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X%d: y\r\n" % i for i in range(300)) + b"\r\n",
    "bad content-length": b"GET /healthz HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
    "two content-lengths": b"GET /healthz HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    "bad chunk": b"POST /healthz HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\nxx\r\n0\r\n\r\n",
}
GOOD = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}  # a bootstrap serves HTTP on uvloop


class FakeEndpoints:
    peer_id = "12D3KooWFake"

    def alive(self) -> bool:
        return True

    def readiness(self) -> tuple[bool, list[str]]:
        return True, []

    def metrics_text(self) -> bytes:
        return b""

    def status(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id}


async def exchange(port: int, data: bytes, local: str = "127.0.0.1") -> bytes:
    """Send `data` on a fresh connection and read until the server closes it ("RESET" if it resets it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(local, 0))
    try:
        writer.write(data)
        async with asyncio.timeout(BOUND_S):
            return await reader.read()
    except ConnectionResetError:
        return b"RESET"
    finally:
        writer.close()


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """All the server sends until it closes the connection; fails the test if it is still open after BOUND_S."""
    got = b""
    async with asyncio.timeout(BOUND_S):
        try:
            while chunk := await reader.read(65536):
                got += chunk
        except ConnectionResetError:  # closed too, if less politely
            pass
    return got


def run(loop: str, main: Callable[[], Awaitable[None]]) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(main())


def http_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(("aiohttp", "phalanx.peer.health"))]


@pytest.mark.parametrize("loop", LOOPS)
def test_malformed_requests_get_400_and_at_most_one_quiet_line_each(caplog, loop):
    async def main():
        port = free_port()
        http = await open_http(peer_app(FakeEndpoints()), "127.0.0.1", port)
        try:
            caplog.clear()
            with caplog.at_level(logging.DEBUG):
                for name, data in MALFORMED.items():
                    answer = await exchange(port, data)
                    assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n")[0], (name, answer[:80])
                records = http_records(caplog)
            assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
            assert [r for r in caplog.records if r.exc_info] == []
            assert len(records) <= len(MALFORMED), [r.getMessage() for r in records]
            assert all("\n" not in r.getMessage() for r in records)
            assert (await exchange(port, GOOD)).startswith(b"HTTP/1.1 200 ")
        finally:
            await http.aclose()

    run(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_unfinished_headers_are_closed_at_the_deadline_also_after_a_request_and_when_dripped(monkeypatch, loop):
    monkeypatch.setattr(server, "HEADER_DEADLINE_S", 1.5)  # the same timer as the default 5 s, waited out 3 times

    async def main():
        port = free_port()
        http = await open_http(peer_app(FakeEndpoints()), "127.0.0.1", port)
        try:
            # headers never finished
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            assert await closed_by_server(reader) == b""
            writer.close()

            # keep-alive: the first request is answered, the second never finished
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n")
            got = await closed_by_server(reader)
            assert got.startswith(b"HTTP/1.1 200 ") and got.count(b"HTTP/1.1") == 1, got
            writer.close()

            # a header line every half second: bytes keep coming, the headers never end
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\n")
            closing = asyncio.ensure_future(closed_by_server(reader))
            for i in range(int(BOUND_S / 0.5)):
                await asyncio.wait([closing], timeout=0.5)
                if closing.done():
                    break
                writer.write(b"X-%d: y\r\n" % i)
            assert await closing == b""
            writer.close()

            assert (await exchange(port, GOOD)).startswith(b"HTTP/1.1 200 ")
        finally:
            await http.aclose()

    run(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_one_address_cannot_hold_more_than_its_share_of_connections(caplog, monkeypatch, loop):
    monkeypatch.setattr(server, "HEADER_DEADLINE_S", 3600.0)  # the held connections stay until the test closes them

    async def main():
        port = free_port()
        http = await open_http(peer_app(FakeEndpoints()), "127.0.0.1", port)
        held = []
        try:
            with caplog.at_level(logging.INFO):
                for _ in range(server.MAX_CONNECTIONS_PER_SOURCE):
                    held.append(await asyncio.open_connection("127.0.0.1", port))
                assert await exchange(port, GOOD) in (b"", b"RESET")  # accepted after the held ones, so refused
                assert (await exchange(port, GOOD, local="127.0.0.2")).startswith(b"HTTP/1.1 200 ")  # another address
            refusals = [r for r in http_records(caplog) if "refused" in r.getMessage()]
            assert len(refusals) == 1 and refusals[0].levelno == logging.INFO
            for _, writer in held:
                writer.close()
            async with asyncio.timeout(BOUND_S):  # the server sees the closes in its own time
                while not (await exchange(port, GOOD)).startswith(b"HTTP/1.1 200 "):
                    await asyncio.sleep(0.05)
        finally:
            for _, writer in held:
                writer.close()
            await http.aclose()

    run(loop, main)


def test_notices_are_one_line_per_source_per_interval_for_a_bounded_number_of_sources(caplog):
    now = [1000.0]
    notices = server.Notices(clock=lambda: now[0])
    interval, places = server.NOTICE_INTERVAL_S, server.MAX_NOTICE_SOURCES
    with caplog.at_level(logging.INFO, logger=server.logger.name):
        assert notices.info("a", "from a") and not notices.info("a", "from a again")
        assert notices.info("b", "from b")
        now[0] += interval / 2
        assert not notices.info("a", "from a, half an interval later")
        now[0] += interval / 2
        assert notices.info("a", "from a, an interval later")
        # "a" holds one place; "b"'s line is an interval old, so its place is free again
        assert sum(notices.info(f"s{i}", f"from s{i}") for i in range(2 * places)) == places - 1
        assert not notices.info("another", "from another")  # every place taken within this interval
        assert len(caplog.records) == 3 + places - 1
        now[0] += interval
        caplog.clear()
        assert notices.info("another", "x" * 1000)
    assert [len(r.getMessage()) for r in caplog.records] == [server.MAX_NOTICE_CHARS]
