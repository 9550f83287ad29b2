"""The node's calls into hivemind's DHT process: bounded, and never a thread that can block forever."""

import asyncio
import logging
import os
import signal
import socket
import threading

import hivemind
import pytest

from phalanx.errors import PhalanxError
from phalanx.peer.dht_keys import install, run_keys
from phalanx.peer.node import (
    daemon_socket_file,
    in_dht,
    quiet_p2p_daemon_noise,
    remove_if_stale,
    visible_maddrs,
)
from tests.procs import LOOPBACK, children


async def _never_returns(_dht, _node) -> None:
    await asyncio.sleep(3600)




def _waiting_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if not t.daemon}


def test_dht_calls_are_bounded_and_refused_once_the_dht_process_is_gone():
    dht = hivemind.DHT(host_maddrs=[LOOPBACK], start=True)
    threads = _waiting_threads()
    try:

        async def main() -> None:
            assert all("/127.0.0.1/" in m for m in await visible_maddrs(dht))
            await install(dht, run_keys("run", "phalanx.run.0"))
            with pytest.raises(asyncio.TimeoutError):
                await in_dht(dht, _never_returns, timeout=1.0)
            daemon_socket = await daemon_socket_file(dht)
            p2pd = children(dht.pid)
            for pid in [dht.pid, *p2pd]:  # p2pd would exit without removing its socket file
                os.kill(pid, signal.SIGKILL)
            dht.join()
            # p2pd's main thread shows as a zombie while its other threads still close its sockets: the
            # file is stale (and removed) once they have; the test's timeout bounds this
            while daemon_socket.exists():
                remove_if_stale(daemon_socket)
                await asyncio.sleep(0.05)
            with pytest.raises(PhalanxError, match="the DHT process died"):
                await visible_maddrs(dht)

        asyncio.run(main())
        assert _waiting_threads() <= threads  # nothing left that keeps the process from exiting
    finally:
        dht.shutdown()


def test_a_socket_file_is_removed_only_when_nothing_listens_on_it(tmp_path):
    live, stale = tmp_path / "live.sock", tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(live))
        listening.listen()
        with socket.socket(socket.AF_UNIX) as closed:
            closed.bind(str(stale))  # bound, then closed without unlinking: what a killed daemon leaves
        remove_if_stale(live)
        remove_if_stale(stale)
        remove_if_stale(tmp_path / "missing.sock")
        assert live.exists() and not stale.exists()


def test_routine_p2p_daemon_events_are_not_logged_as_errors(caplog):
    loop = asyncio.new_event_loop()
    try:
        caplog.set_level(logging.DEBUG)
        reset = asyncio.IncompleteReadError(b"", 1)
        quiet_p2p_daemon_noise(loop, {"message": "Unhandled exception in client_connected_cb", "exception": reset})
        assert [r.levelno for r in caplog.records] == [logging.DEBUG]
        caplog.clear()
        quiet_p2p_daemon_noise(loop, {"message": "Unhandled exception in client_connected_cb", "exception": ValueError("ours")})
        quiet_p2p_daemon_noise(loop, {"message": "Task exception was never retrieved", "exception": ConnectionResetError()})
        assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]  # not hivemind's: as before
    finally:
        loop.close()


def test_a_snapshot_holds_the_counters_of_that_instant():
    """What statistics(), the trainer's report and health read: one copy, which later rounds leave as it was."""
    from types import SimpleNamespace

    from phalanx.peer.node import Node, NodeSnapshot
    from phalanx.protocol.engine import EngineStats
    from phalanx.protocol.round_counts import RoundCounts
    from phalanx.protocol.transport_wire import TransportStats

    stats = EngineStats(rounds_ok=5, rounds_partial=2, rounds_failed=1, resyncs=3, last_group_size=4, last_round_s=0.5)
    stats.members_dropped_late = 1
    engine = SimpleNamespace(stats=stats, step=7, version=bytes.fromhex("ab12"))
    sent = TransportStats(bytes_sent=100, bytes_received=200, relayed_bytes=10)
    transport = SimpleNamespace(peer_id="12D3KooWme", stats=sent)
    membership = SimpleNamespace(banned={"12D3KooWzz", "12D3KooWaa"})
    node = Node(None, None, transport, membership, engine, None, {}, None)

    snapshot = node.snapshot()
    assert snapshot == NodeSnapshot(
        peer_id="12D3KooWme", step=7, state_version="ab12", rounds=RoundCounts(ok=5, partial=2, failed=1, resyncs=3),
        last_group_size=4, last_round_s=0.5, members_dropped_late=1, bytes_sent=100, bytes_received=200,
        relayed_bytes=10, banned=("12D3KooWaa", "12D3KooWzz"),
    )  # fmt: skip
    stats.rounds_ok += 1
    membership.banned.add("12D3KooWbb")
    assert snapshot.rounds.ok == 5 and snapshot.banned == ("12D3KooWaa", "12D3KooWzz")
    assert node.snapshot().rounds == RoundCounts(ok=6, partial=2, failed=1, resyncs=3)
