"""All-to-all exchange of one small message per member, for the verification phases of a round.

Each member sends its message to every other member and waits (until a deadline) for
theirs. Messages may arrive before this peer reaches the phase: they wait in a bounded
mailbox keyed by (round, phase, sender). Only members of a round this peer registered
can fill its mailbox, and each sender gets one message per phase.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Annotated, Optional

from pydantic import Field

from aggregation.errors import PeerProtocolError, RoundAbortedError
from protocol.transport import CallFailed, Transport
from security.wire import RoundId, WireModel, pack, unpack

logger = logging.getLogger(__name__)

EXCHANGE_METHOD = "exchange"
MAX_PHASE_BYTES = 512 << 10
MAX_OPEN_ROUNDS = 64


class ExchangeHeader(WireModel):
    round_id: RoundId
    phase: Annotated[str, Field(min_length=1, max_length=16)]


@dataclass
class _Mailbox:
    members: frozenset[str]
    messages: dict[tuple[str, str], bytes] = field(default_factory=dict)  # (phase, sender) -> payload
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class ExchangeService:
    """Routes phase messages to open rounds. Open a round with `open_round`, close with `close_round`."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._rounds: dict[bytes, _Mailbox] = {}
        self._early: dict[bytes, list[tuple[str, str, bytes]]] = {}  # before the round is opened here
        transport.register(EXCHANGE_METHOD, self._serve, max_payload=MAX_PHASE_BYTES)

    def open_round(self, round_id: bytes, members: tuple[str, ...]) -> None:
        box = _Mailbox(frozenset(members))
        self._rounds[round_id] = box
        while len(self._rounds) > MAX_OPEN_ROUNDS:
            self._rounds.pop(next(iter(self._rounds)))
        for phase, sender, payload in self._early.pop(round_id, []):
            if sender in box.members:
                box.messages.setdefault((phase, sender), payload)

    def close_round(self, round_id: bytes) -> None:
        self._rounds.pop(round_id, None)
        self._early.pop(round_id, None)

    async def _serve(self, peer: str, header: bytes, payload) -> tuple[bytes, bytes]:
        head = unpack(header, ExchangeHeader, peer=peer)
        box = self._rounds.get(head.round_id)
        if box is None:
            # the sender may be a phase ahead of us; keep a little, bounded
            early = self._early.setdefault(head.round_id, [])
            if len(self._early) > MAX_OPEN_ROUNDS or len(early) > 64:
                self._early.pop(head.round_id, None)
                raise RoundAbortedError("unknown round")
            early.append((head.phase, peer, bytes(payload)))
            return b"", b""
        if peer not in box.members:
            raise PeerProtocolError("sent a phase message for a round it is not a member of", peer=peer)
        if (head.phase, peer) in box.messages:
            raise PeerProtocolError(f"sent two {head.phase} messages in one round", peer=peer)
        box.messages[(head.phase, peer)] = bytes(payload)
        box.arrived.set()
        return b"", b""

    async def all_to_all(
        self,
        round_id: bytes,
        phase: str,
        payload: bytes,
        *,
        deadline: float,
        send: bool = True,
        expect: Optional[set[str]] = None,
    ) -> dict[str, bytes]:
        """Send `payload` to every other member (unless `send` is False) and collect theirs until every
        member (or every peer in `expect`) answered or `deadline` (time.monotonic()) passed."""
        box = self._rounds.get(round_id)
        if box is None:
            raise RoundAbortedError("round is not open for exchange")
        me = self.transport.peer_id
        others = sorted(box.members - {me})
        awaited = set(others) if expect is None else (set(expect) & box.members) - {me}
        header = pack(ExchangeHeader(round_id=round_id, phase=phase))

        async def send_one(peer: str) -> None:
            timeout = max(deadline - time.monotonic(), 0.1)
            try:
                await self.transport.call(peer, EXCHANGE_METHOD, header, payload, max_reply_payload=0, timeout_s=timeout)
            except (CallFailed, PeerProtocolError) as e:
                logger.debug(f"{phase} to {peer[-8:]} failed: {e}")

        sending = [asyncio.create_task(send_one(p)) for p in others] if send else []
        try:
            while True:
                got = {p for (ph, p) in box.messages if ph == phase}
                if got >= awaited:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                box.arrived.clear()
                try:
                    await asyncio.wait_for(box.arrived.wait(), timeout=remaining)
                except asyncio.TimeoutError:
                    pass
            if sending:
                await asyncio.wait(sending, timeout=max(deadline - time.monotonic(), 0.0))
        finally:
            for task in sending:
                task.cancel()
        received = {p: data for (ph, p), data in box.messages.items() if ph == phase}
        received[me] = payload
        return received
