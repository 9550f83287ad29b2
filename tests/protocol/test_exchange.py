"""Exchange mailboxes (protocol/exchange.py): messages only under the round's phases, one per member and phase."""

import asyncio
import os
import time

import msgpack
import pytest

from phalanx.errors import PeerProtocolError
from phalanx.protocol.channel import CallFailed
from phalanx.protocol.exchange import EXCHANGE_METHOD, ExchangeHeader, ExchangeService
from phalanx.protocol.transport_wire import Status
from phalanx.protocol.waiting import MAX_WAITING_PER_CALLER
from phalanx.security.phases import RoundPhase
from phalanx.security.wire import pack

pytestmark = pytest.mark.timeout(60)
ME, OTHER, OUTSIDER = "QmMe", "QmOther", "QmOutsider"


class _Transport:
    """Just enough of protocol.transport.Transport to hold the handler the service registers."""

    peer_id = ME

    def __init__(self) -> None:
        self.handlers = {}

    def register(self, method, handler, *, max_payload):
        self.handlers[method] = handler


def _header(round_id: bytes, phase: str) -> bytes:
    return msgpack.packb({"round_id": round_id, "phase": phase}, use_bin_type=True)  # as any peer can send it


def test_the_wire_keeps_phase_names_as_strings():
    header = pack(ExchangeHeader(round_id=b"r" * 16, phase=RoundPhase.REVEAL))
    assert header == _header(b"r" * 16, "reveal")


def test_made_up_phases_are_refused_and_the_mailbox_stays_bounded():
    async def main():
        transport = _Transport()
        service = ExchangeService(transport, wait_for_round_s=1.0)
        serve = transport.handlers[EXCHANGE_METHOD]
        round_id = os.urandom(16)
        service.open_round(round_id, (ME, OTHER))
        big = b"\x00" * (512 << 10)  # the most one message may carry
        for name in ["junk0", "junk1", "COMMIT", "commit ", "x" * 16, "data", "validate"]:
            with pytest.raises(PeerProtocolError, match="invalid ExchangeHeader.phase"):
                await serve(OTHER, _header(round_id, name), big)
        with pytest.raises(PeerProtocolError, match="invalid ExchangeHeader.phase"):
            await serve(OTHER, msgpack.packb({"round_id": round_id, "phase": 1}), b"m")
        for phase in RoundPhase:
            await serve(OTHER, _header(round_id, phase.value), b"m")
            with pytest.raises(PeerProtocolError, match=f"sent two {phase.value} messages in one round"):
                await serve(OTHER, _header(round_id, phase.value), b"m")
        with pytest.raises(PeerProtocolError, match="not a member"):
            await serve(OUTSIDER, _header(round_id, "commit"), b"m")
        assert len(service._rounds[round_id].messages) == len(RoundPhase)  # members × phases at most
        for phase in RoundPhase:  # each one reached its phase
            assert await service.arrivals(round_id, phase, set()) == {OTHER: b"m"}

    asyncio.run(main())


def test_one_callers_calls_for_made_up_rounds_leave_room_for_the_others():
    """A member may be a phase ahead of us: its message waits for the round to open here. Made-up round
    ids cost their sender nothing, so one caller may hold only a few waiting slots."""

    async def main():
        transport = _Transport()
        service = ExchangeService(transport, wait_for_round_s=30.0)
        serve = transport.handlers[EXCHANGE_METHOD]
        flood = [asyncio.create_task(serve(OUTSIDER, _header(os.urandom(16), "commit"), b"m")) for _ in range(300)]
        await asyncio.sleep(0)  # every call reached the wait list
        refused = [t for t in flood if t.done()]
        assert len(refused) == 300 - MAX_WAITING_PER_CALLER
        assert all("too many of this caller's calls" in str(t.exception()) for t in refused)
        round_id = os.urandom(16)
        early = asyncio.create_task(serve(OTHER, _header(round_id, "commit"), b"m"))  # before the round opens here
        await asyncio.sleep(0)
        assert not early.done()
        service.open_round(round_id, (ME, OTHER))
        assert await early == (b"", b"")
        assert await service.arrivals(round_id, RoundPhase.COMMIT, set()) == {OTHER: b"m"}
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)

    asyncio.run(main())


class _FlakyLink(_Transport):
    """Calls to each peer first meet the given failures (a failed connection: no status; a refusal: a
    status), then reach the peer's mailbox."""

    def __init__(self, failures: dict[str, list]) -> None:
        super().__init__()
        self.failures = failures
        self.tries: dict[str, int] = {}
        self.peers: dict[str, ExchangeService] = {}

    async def call(self, peer, method, header, payload, *, max_reply_payload, timeout_s):
        self.tries[peer] = self.tries.get(peer, 0) + 1
        if self.failures.get(peer):
            raise CallFailed("connection failed", self.failures[peer].pop(0))
        await self.peers[peer]._serve(ME, header, payload)
        return b"", b""


def test_a_phase_message_whose_connection_failed_is_sent_again_but_a_refusal_is_final():
    """A member that misses our message judges us silent: a failed connection is retried within the phase."""

    async def main():
        link = _FlakyLink({OTHER: [None, None], OUTSIDER: [Status.REJECTED]})
        mine = ExchangeService(link)
        round_id = os.urandom(16)
        members = (ME, OTHER, OUTSIDER)
        for name in (OTHER, OUTSIDER):
            peer_link = _Transport()
            peer_link.peer_id = name
            link.peers[name] = ExchangeService(peer_link)
            link.peers[name].open_round(round_id, members)
        mine.open_round(round_id, members)
        deadline = time.monotonic() + 5.0
        await mine.all_to_all(round_id, RoundPhase.REVEAL, b"share", deadline=deadline, expect=set())
        assert link.tries == {OTHER: 3, OUTSIDER: 1}
        assert await link.peers[OTHER].arrivals(round_id, RoundPhase.REVEAL, set()) == {ME: b"share"}
        assert not link.peers[OUTSIDER]._rounds[round_id].messages

    asyncio.run(main())
