"""Our circuit relay (`protocol.hop_relay`) replaces p2pd's, whose relayed connections may close after
128 KiB: the relay p2pd here runs with `-relayService=0`, so the only relay it has of its own is the one with
libp2p's default limits. Homes and callers are unmodified p2pd clients on this host; the home announces a
closed port and the caller listens nowhere, so nothing between them but the relay connects them."""

from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager, contextmanager
from types import SimpleNamespace
from typing import Optional

import pytest
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P
from multiaddr import Multiaddr

from phalanx.protocol import hop_relay
from phalanx.protocol.hop_relay import HOP, HopMessage, HopRelay, read_message, write_message

pytestmark = pytest.mark.timeout(120)

CALL_BYTES = 48 << 10
CALLS = 4  # 192 KiB each way on one relayed connection: past libp2p's default 128 KiB
UNDIALABLE = "/ip4/127.0.0.1/tcp/1"
ECHO = "echo"


@contextmanager
def _p2pd_flags(**flags):
    """p2pd flags `P2P.create` has no parameter for."""
    make = P2P._make_process_args
    P2P._make_process_args = staticmethod(lambda *args, **kwargs: make(*args, **{**kwargs, **flags}))
    try:
        yield
    finally:
        P2P._make_process_args = staticmethod(make)


@asynccontextmanager
async def _relay(ours: bool, data_limit: int = 1 << 30):
    with _p2pd_flags(relayService=False):
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], force_reachability="public")
    relay = HopRelay(p2p, data_limit=data_limit, time_limit_s=600, max_circuits=4)
    try:
        if ours:
            await relay.start()
        yield p2p, relay, f"{(await p2p.get_visible_maddrs())[0]}"
    finally:
        if ours:
            await relay.aclose()
        await p2p.shutdown()


@asynccontextmanager
async def _home_and_caller(relay: str):
    home = caller = None
    try:
        with _p2pd_flags(relayDiscovery=False):  # static relays: a slot at once
            home = await P2P.create(
                host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[UNDIALABLE], dht_mode="client",
                force_reachability="private", use_relay=True, use_auto_relay=True, trusted_relays=[relay],
            )  # fmt: skip
        caller = await P2P.create(no_listen=True, host_maddrs=[], dht_mode="client", use_relay=True)

        async def echo(request: BytesValue, _context) -> BytesValue:
            return request

        await home.add_protobuf_handler(ECHO, echo, BytesValue)
        relay_id = relay.rsplit("/p2p/", 1)[1]
        async with asyncio.timeout(30):
            while not any(info.peer_id.to_base58() == relay_id for info in await home.list_peers()):
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # the reservation follows the connection; a dial before it is backed off 5 s
            circuit = Multiaddr(f"{relay}/p2p-circuit/p2p/{home.peer_id.to_base58()}")
            while True:
                try:
                    await caller._client.connect(home.peer_id, [circuit])
                    break
                except Exception:
                    await asyncio.sleep(0.5)
        yield home, caller
    finally:
        for p2p in (caller, home):
            if p2p is not None:
                await p2p.shutdown()


async def _calls_through(home: P2P, caller: P2P) -> tuple[int, Optional[str]]:
    """Echo calls that went through before the first failure, and that failure."""
    for number in range(CALLS):
        payload = os.urandom(CALL_BYTES)
        try:
            reply = await asyncio.wait_for(caller.call_protobuf_handler(home.peer_id, ECHO, BytesValue(value=payload), BytesValue), 20)
        except Exception as e:
            return number, repr(e)
        assert reply.value == payload
    addresses = [str(a) for info in await caller.list_peers() if info.peer_id == home.peer_id for a in info.addrs]
    assert addresses and all("p2p-circuit" in a for a in addresses), addresses  # it stayed relayed
    return CALLS, None


def test_a_relayed_connection_through_our_relay_outlives_libp2ps_default_limit():
    async def main():
        async with _relay(ours=True) as (_, relay, address):
            async with _home_and_caller(address) as (home, caller):
                done = await _calls_through(home, caller)
            return done, relay.stats

    (done, failure), stats = asyncio.run(main())
    assert done == CALLS, failure
    assert stats.circuits_total == 1 and stats.relayed_bytes >= 2 * CALLS * CALL_BYTES and stats.reservations == 1


def test_without_it_p2pds_remaining_relay_closes_the_connection_at_128_kib():
    """What the relay replaces: the same calls through p2pd's relay with libp2p's defaults."""

    async def main():
        async with _relay(ours=False) as (_, _, address):
            async with _home_and_caller(address) as (home, caller):
                return await _calls_through(home, caller)

    done, failure = asyncio.run(main())
    assert 0 < done < CALLS and failure is not None


def test_a_relayed_connection_closes_at_our_data_limit():
    async def main():
        async with _relay(ours=True, data_limit=100 << 10) as (_, relay, address):
            async with _home_and_caller(address) as (home, caller):
                return await _calls_through(home, caller), relay.stats

    (done, failure), stats = asyncio.run(main())
    assert done < CALLS and failure is not None and stats.relayed_bytes <= 2 * (100 << 10)


def test_malformed_and_unknown_requests_are_refused():
    async def main():
        async with _relay(ours=True) as (p2p, relay, _):
            client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[f"{(await p2p.get_visible_maddrs())[0]}"])
            try:
                answers = []
                for send in (
                    lambda w: w.write(b"\xff\xff\xff\xff\xff\xff"),  # a varint longer than any message
                    lambda w: w.write(b"\x05\xff\xff\xff\xff\xff"),  # not a protobuf message
                    lambda w: write_message(w, HopMessage(type=hop_relay.HOP_CONNECT, peer=dict(id=client.peer_id.to_bytes()))),
                    lambda w: write_message(w, HopMessage(type=hop_relay.HOP_CONNECT, peer=dict(id=b"not a peer id"))),
                    lambda w: write_message(w, HopMessage(type=7)),
                ):
                    _, reader, writer = await client.call_binary_stream_handler(p2p.peer_id, HOP)
                    send(writer)
                    await writer.drain()
                    answers.append((await asyncio.wait_for(read_message(reader, HopMessage), 15)).status)
                    writer.close()
                return answers, relay.stats
            finally:
                await client.shutdown()

    answers, stats = asyncio.run(main())
    assert answers == [
        hop_relay.MALFORMED_MESSAGE, hop_relay.MALFORMED_MESSAGE, hop_relay.NO_RESERVATION,
        hop_relay.MALFORMED_MESSAGE, hop_relay.UNEXPECTED_MESSAGE,
    ]  # fmt: skip
    assert stats.refused == 5 and stats.circuits_total == 0


class _Writer:
    def __init__(self):
        self.data = bytearray()

    def write(self, chunk: bytes) -> None:
        self.data += chunk


async def _answer(writer: _Writer) -> int:
    reader = asyncio.StreamReader()
    reader.feed_data(bytes(writer.data))
    reader.feed_eof()
    return (await read_message(reader, HopMessage)).status


def test_one_host_gets_a_bounded_number_of_slots_and_renewals_always_go_through():
    """Fresh identities are free: a host that reserves with many takes at most MAX_RESERVATIONS_PER_IP slots,
    and the homes already holding theirs keep renewing them. A slot whose peer disconnected is given up
    when another is asked for (a home restarted under a new identity)."""
    connected: set[str] = set()

    class _P2P:
        async def list_peers(self):
            return [SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda p=p: p)) for p in connected]

    relay = HopRelay(p2p=_P2P(), data_limit=1, time_limit_s=1, max_circuits=1)

    def reserve(peer: str, host: str) -> int:
        connected.add(peer)
        writer = _Writer()
        asyncio.run(relay._reserve(peer, host, writer))
        return asyncio.run(_answer(writer))

    cap = hop_relay.MAX_RESERVATIONS_PER_IP
    assert [reserve(f"peer{i}", "10.0.0.9") for i in range(cap)] == [hop_relay.OK] * cap
    assert reserve("one too many", "10.0.0.9") == hop_relay.RESERVATION_REFUSED
    assert reserve("peer0", "10.0.0.9") == hop_relay.OK  # a renewal
    assert reserve("a home elsewhere", "10.0.0.10") == hop_relay.OK
    assert relay.stats.reservations == cap + 1 and relay.stats.refused == 1
    connected.discard("peer3")  # gone: restarted under another identity
    assert reserve("peer3, restarted", "10.0.0.9") == hop_relay.OK
    assert "peer3" not in relay._reservations and relay.stats.reservations == cap + 1
