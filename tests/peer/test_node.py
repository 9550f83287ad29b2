"""The node's calls into hivemind's DHT process: bounded, and never a thread that can block forever."""

import asyncio
import os
import signal
import socket
import threading
from pathlib import Path

import hivemind
import pytest

from aggregation.errors import PhalanxError
from peer.node import add_validators, in_dht, remove_if_stale, visible_maddrs
from protocol.bans import BanVoteValidator
from trainer_procs import LOOPBACK, children, group_members


async def _never_returns(_dht, _node) -> None:
    await asyncio.sleep(3600)


async def _daemon_socket(_dht, node) -> str:
    return node.p2p.daemon_listen_maddr.value_for_protocol("unix")


def _waiting_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if not t.daemon}


def test_dht_calls_are_bounded_and_refused_once_the_dht_process_is_gone():
    dht = hivemind.DHT(host_maddrs=[LOOPBACK], start=True)
    threads = _waiting_threads()
    try:

        async def main() -> None:
            assert all("/127.0.0.1/" in m for m in await visible_maddrs(dht))
            await add_validators(dht, [BanVoteValidator("run.bans")])
            with pytest.raises(asyncio.TimeoutError):
                await in_dht(dht, _never_returns, timeout=1.0)
            daemon_socket = Path(await in_dht(dht, _daemon_socket))
            p2pd = children(dht.pid)
            for pid in [dht.pid, *p2pd]:  # p2pd would exit without removing its socket file
                os.kill(pid, signal.SIGKILL)
            dht.join()
            while any(pid in group_members(os.getpgid(0)) for pid in p2pd):
                await asyncio.sleep(0.05)
            remove_if_stale(daemon_socket)
            assert not daemon_socket.exists()
            with pytest.raises(PhalanxError, match="DHT process is not running"):
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
