"""The per-peer side of verified rounds: the part bytes each round keeps as evidence for its judges,
served to the round's members only, and the open rounds whose aggregates members relay to each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol


from phalanx.errors import PeerProtocolError, RoundAbortedError
from phalanx.protocol.btard.messages import EVIDENCE_METHOD, RELAY_METHOD, EvidenceRequest, RelayRequest
from phalanx.protocol.exchange import ExchangeService
from phalanx.protocol.transport import Transport
from phalanx.security.identity import Identity
from phalanx.security.wire import pack, unpack

HELD_ROUNDS = 8


class OpenRound(Protocol):
    """A round as the service sees it while it is open (a VerifiedRound): it passes the aggregates it
    received on to members that lack them. The rounds import the service, not the other way round."""

    async def serve_relay(self, peer: str, part: int, payload: bool) -> tuple[bytes, bytes | memoryview]: ...


@dataclass
class Held:
    """What a reducer keeps of a round so judges can check accusations: each contributor's part bytes
    (for raw float32 parts, the rows they were received into; no copy); a validator also keeps every
    part its target committed to (checked against the commitment), to show what its reports lied about."""

    part: int
    payloads: dict[str, bytes | memoryview]
    members: frozenset[str]  # who may ask for them: the round's judges
    target: str = ""
    validated: dict[int, bytes | memoryview] = field(default_factory=dict)

    def lookup(self, part: int, contributor: str) -> Optional[bytes | memoryview]:
        if part == self.part and contributor in self.payloads:
            return self.payloads[contributor]
        return self.validated.get(part) if contributor == self.target else None


class BtardService:
    """One per peer: serves held part bytes to judges and opens verified rounds."""

    def __init__(self, transport: Transport, exchange: ExchangeService, identity: Identity) -> None:
        self.transport, self.exchange, self.identity = transport, exchange, identity
        self._held: dict[bytes, Held] = {}
        self.open: dict[bytes, OpenRound] = {}  # rounds whose received aggregates we pass on
        transport.register(EVIDENCE_METHOD, self._serve_evidence, max_payload=0)
        transport.register(RELAY_METHOD, self._serve_relay, max_payload=0)

    def hold_target(self, round_id: bytes, target: str, parts: dict[int, bytes | memoryview]) -> None:
        """Keep a validator's copies of its target's parts with the round's evidence (held since the reveal)."""
        held = self._held.get(round_id)
        if held is not None:
            held.target, held.validated = target, parts

    def hold(self, round_id: bytes, held: Held) -> None:
        self._held[round_id] = held
        while len(self._held) > HELD_ROUNDS:
            self._held.pop(next(iter(self._held)))

    def release(self, round_id: bytes) -> None:
        self._held.pop(round_id, None)

    def holds(self, round_id: bytes) -> bool:
        """Whether this peer still keeps the round's parts as evidence."""
        return round_id in self._held

    async def _serve_evidence(self, peer: str, header: bytes, payload) -> tuple[bytes, bytes]:
        request = unpack(header, EvidenceRequest, peer=peer)
        held = self._held.get(request.round_id)
        if held is not None and peer not in held.members:
            raise PeerProtocolError("asked for the evidence of a round it was not in", peer=peer)
        data = None if held is None else held.lookup(request.part, request.contributor)
        if data is None:
            raise RoundAbortedError("no such evidence here")
        return b"", data

    async def _serve_relay(self, peer: str, header: bytes, payload) -> tuple[bytes, bytes | memoryview]:
        request = unpack(header, RelayRequest, peer=peer)
        vr = self.open.get(request.round_id)
        if vr is None:
            raise RoundAbortedError("round not open here")
        return await vr.serve_relay(peer, request.part, request.payload)

    async def fetch_part(
        self, holder: str, round_id: bytes, part: int, contributor: str, max_bytes: int, timeout_s: float
    ) -> bytes:
        """`contributor`'s committed bytes of `part` from a member that holds them (its reducer, or the
        validator that checked it)."""
        if holder == self.transport.peer_id:
            held = self._held.get(round_id)
            data = None if held is None else held.lookup(part, contributor)
            if data is None:
                raise RoundAbortedError("evidence not held")
            return data
        _, data = await self.transport.call(
            holder,
            EVIDENCE_METHOD,
            pack(EvidenceRequest(round_id=round_id, part=part, contributor=contributor)),
            max_reply_payload=max_bytes,
            timeout_s=timeout_s,
            expect_large_reply=max_bytes > (64 << 10),
        )
        return bytes(data)
