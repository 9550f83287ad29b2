"""Phase messages that never reached one member (protocol/exchange.py, `relay=`): it takes them from the
members that hold them, signed by their senders, so every member sees the same commitments and reveals."""

import asyncio
import os
import time

import pytest

from phalanx.errors import PeerProtocolError
from phalanx.protocol.channel import CallFailed
from phalanx.protocol.exchange import EXCHANGE_METHOD, EXCHANGE_RELAY_METHOD, ExchangeService, RelayAsk, signed_by_sender
from phalanx.security.identity import Identity
from phalanx.security.phases import RoundPhase
from phalanx.security.statements import sign_statement
from phalanx.security.wire import pack

pytestmark = pytest.mark.timeout(60)
PHASE = RoundPhase.REVEAL


class _Mesh:
    """Members' exchange services wired to each other in one process; `lost` links drop phase messages."""

    def __init__(self, names: list[str], lost: set[tuple[str, str]]) -> None:
        self.services = {name: ExchangeService(_Link(self, name)) for name in names}
        self.lost = lost
        self.asked: list[tuple[str, str]] = []  # (asker, holder) of every relay call


class _Link:
    def __init__(self, mesh: _Mesh, peer_id: str) -> None:
        self.mesh, self.peer_id, self.handlers = mesh, peer_id, {}

    def register(self, method, handler, *, max_payload):
        self.handlers[method] = handler

    async def call(self, peer, method, header, payload, *, max_reply_payload, timeout_s):
        if method == EXCHANGE_METHOD and (self.peer_id, peer) in self.mesh.lost:
            raise CallFailed("stream reset")
        if method == EXCHANGE_RELAY_METHOD:
            self.mesh.asked.append((self.peer_id, peer))
        return await self.mesh.services[peer].transport.handlers[method](self.peer_id, header, payload)


def _members(tmp_path, n: int) -> dict[str, Identity]:
    identities = [Identity.generate_ed25519(tmp_path / f"{i}.key") for i in range(n)]
    return {identity.peer_id: identity for identity in identities}


def _signed(identity: Identity, round_id: bytes) -> bytes:
    body = RelayAsk(round_id=round_id, phase=PHASE, sender=identity.peer_id)  # any body will do
    return pack(sign_statement(identity, PHASE, round_id, body))


async def _phase(mesh: _Mesh, round_id: bytes, messages: dict[str, bytes], relay_s: float) -> dict[str, dict[str, bytes]]:
    for service in mesh.services.values():
        service.open_round(round_id, tuple(mesh.services))
    deadline = time.monotonic() + 1.0
    results = await asyncio.gather(*(
        service.all_to_all(round_id, PHASE, messages[name], deadline=deadline, relay=(relay_s, signed_by_sender(round_id, PHASE)))
        for name, service in mesh.services.items()
    ))  # fmt: skip
    return dict(zip(mesh.services, results))


def _third_lost_to_me(tmp_path):
    """Three members, each message signed for a fresh round; the link from the third to the first loses all."""
    ids = _members(tmp_path, 3)
    me, other, third = ids
    round_id = os.urandom(16)
    messages = {name: _signed(identity, round_id) for name, identity in ids.items()}
    return ids, (me, other, third), round_id, messages, _Mesh(list(ids), lost={(third, me)})


def test_a_message_lost_on_one_link_comes_from_a_member_that_holds_it(tmp_path):
    async def main():
        ids, (me, other, third), round_id, messages, mesh = _third_lost_to_me(tmp_path)
        views = await _phase(mesh, round_id, messages, relay_s=2.0)
        assert all(view == messages for view in views.values())  # one view of the phase, ours included
        assert {asker for asker, _ in mesh.asked} == {me} and (me, other) in mesh.asked

    asyncio.run(main())


def test_a_relayed_message_its_sender_did_not_sign_is_not_taken(tmp_path):
    async def main():
        ids, (me, other, third), round_id, messages, mesh = _third_lost_to_me(tmp_path)
        messages[third] = _signed(ids[other], round_id)  # what `other` passes off as third's, signed by itself
        views = await _phase(mesh, round_id, messages, relay_s=2.0)
        assert third not in views[me] and views[other][third] == messages[third]
        other_round = os.urandom(16)  # a statement of another round is not taken either
        messages = {name: _signed(identity, round_id) for name, identity in ids.items()}
        views = await _phase(mesh, other_round, messages, relay_s=2.0)
        assert third not in views[me]

    asyncio.run(main())


def test_without_relay_a_lost_message_stays_lost_and_outsiders_get_nothing(tmp_path):
    async def main():
        ids, (me, other, third), round_id, messages, mesh = _third_lost_to_me(tmp_path)
        for service in mesh.services.values():
            service.open_round(round_id, tuple(mesh.services))
        deadline = time.monotonic() + 1.0
        views = await asyncio.gather(*(s.all_to_all(round_id, PHASE, messages[n], deadline=deadline) for n, s in mesh.services.items()))
        assert third not in views[0] and not mesh.asked
        serve = mesh.services[other].transport.handlers[EXCHANGE_RELAY_METHOD]
        with pytest.raises(PeerProtocolError, match="not a member"):
            await serve("QmOutsider", pack(RelayAsk(round_id=round_id, phase=PHASE, sender=third)), b"")

    asyncio.run(main())
