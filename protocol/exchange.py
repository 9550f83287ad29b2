"""All-to-all exchange of one small message per member, for the verification phases of a round.

Each member sends its message to every other member and waits (until a deadline) for
theirs; a phase that allows it then asks the members that answered for the messages that never
reached this peer (every such message is signed by its sender, so the relaying member cannot forge
one). Messages may arrive before this peer reaches the phase: they wait in a mailbox
keyed by (round, phase, sender). Only members of a round this peer opened can fill its
mailbox, one message per phase of the round (RoundPhase) each, so a mailbox holds at most
members × phases messages; a call for a round not opened yet is held (a bounded number of
them, fewer from any one caller, for a bounded time) until it opens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Optional

from pydantic import Strict

from phalanx.errors import PeerProtocolError, RoundAbortedError
from phalanx.protocol.transport import CallFailed, Transport
from phalanx.protocol.waiting import WaitingCalls
from phalanx.security.phases import RoundPhase
from phalanx.security.statements import Signed, check_statement
from phalanx.security.wire import PeerIdStr, RoundId, WireModel, pack, unpack

logger = logging.getLogger(__name__)

EXCHANGE_METHOD = "exchange"
EXCHANGE_RELAY_METHOD = "exchange_relay"
MAX_PHASE_BYTES = 512 << 10
MAX_OPEN_ROUNDS = 64
# calls held for rounds not opened yet (each holds at most MAX_PHASE_BYTES), MAX_WAITING_PER_CALLER of them a caller
MAX_WAITING_CALLS = 64
# pauses before a phase message whose connection failed is sent again (bounded: a peer that died after
# sending its own message keeps the phase open at most this long past the last arrival)
SEND_RETRY_PAUSES_S = (0.2, 0.5)


class ExchangeHeader(WireModel):
    round_id: RoundId  # the round whose mailbox the message goes to
    phase: Annotated[RoundPhase, Strict(False)]  # a msgpack string; a name the round has no phase of is refused


class RelayAsk(WireModel):
    round_id: RoundId
    phase: Annotated[RoundPhase, Strict(False)]
    sender: PeerIdStr  # whose message of `phase` the asking member lacks


Check = Callable[[str, bytes], bool]  # (sender, message) -> whether the message is the sender's own


def signed_by_sender(round_id: bytes, phase: RoundPhase) -> Check:
    """A relayed message must be a statement of `phase` in this round, signed by its sender."""

    def check(sender: str, raw: bytes) -> bool:
        try:
            check_statement(unpack(raw, Signed, peer=sender), kind=phase, round_id=round_id, sender=sender)
        except PeerProtocolError:
            return False
        return True

    return check


@dataclass
class _Mailbox:
    members: frozenset[str]
    messages: dict[tuple[RoundPhase, str], bytes] = field(default_factory=dict)  # (phase, sender) -> payload
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class ExchangeService:
    """Routes phase messages to open rounds. Open a round with `open_round`, close with `close_round`."""

    def __init__(self, transport: Transport, *, wait_for_round_s: float = 10.0) -> None:
        self.transport = transport
        self.wait_for_round_s = wait_for_round_s
        self._rounds: dict[bytes, _Mailbox] = {}
        self._opened: dict[bytes, asyncio.Event] = {}
        self._waiting = WaitingCalls(MAX_WAITING_CALLS)
        transport.register(EXCHANGE_METHOD, self._serve, max_payload=MAX_PHASE_BYTES)
        transport.register(EXCHANGE_RELAY_METHOD, self._serve_relay, max_payload=0)

    def open_round(self, round_id: bytes, members: tuple[str, ...]) -> None:
        self._rounds[round_id] = _Mailbox(frozenset(members))
        while len(self._rounds) > MAX_OPEN_ROUNDS:
            self._rounds.pop(next(iter(self._rounds)))
        self._opened.setdefault(round_id, asyncio.Event()).set()

    def close_round(self, round_id: bytes) -> None:
        self._rounds.pop(round_id, None)
        self._opened.pop(round_id, None)

    async def _round(self, round_id: bytes, peer: str) -> _Mailbox:
        box = self._rounds.get(round_id)
        if box is not None:
            return box
        with self._waiting.hold(peer):  # one caller's made-up round ids cannot fill the list for everyone
            event = self._opened.setdefault(round_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout=self.wait_for_round_s)
            except asyncio.TimeoutError:
                if self._opened.get(round_id) is event and not event.is_set():
                    del self._opened[round_id]
                raise RoundAbortedError("unknown round") from None
        box = self._rounds.get(round_id)
        if box is None:
            raise RoundAbortedError("round already closed")
        return box

    async def _serve(self, peer: str, header: bytes, payload) -> tuple[bytes, bytes]:
        head = unpack(header, ExchangeHeader, peer=peer)
        box = await self._round(head.round_id, peer)  # the sender may be a phase ahead of us
        if peer not in box.members:
            raise PeerProtocolError("sent a phase message for a round it is not a member of", peer=peer)
        if (head.phase, peer) in box.messages:
            raise PeerProtocolError(f"sent two {head.phase} messages in one round", peer=peer)
        box.messages[(head.phase, peer)] = bytes(payload)
        box.arrived.set()
        return b"", b""

    async def _serve_relay(self, peer: str, header: bytes, payload) -> tuple[bytes, bytes]:
        """Another member's message of a phase, for a member it never reached (empty: we lack it too)."""
        ask = unpack(header, RelayAsk, peer=peer)
        box = self._rounds.get(ask.round_id)
        if box is None:
            raise RoundAbortedError("round is not open for exchange")
        if peer not in box.members:
            raise PeerProtocolError("asked for a phase message of a round it is not a member of", peer=peer)
        return b"", box.messages.get((ask.phase, ask.sender), b"")

    async def arrivals(self, round_id: bytes, phase: RoundPhase, seen: set[str]) -> dict[str, bytes]:
        """The `phase` messages of the round from members not in `seen`, once there is at least one
        (they stay for `all_to_all` to collect): a member may act on early messages of a later phase."""
        box = self._rounds.get(round_id)
        if box is None:
            raise RoundAbortedError("round is not open for exchange")
        while True:
            new = {p: m for (ph, p), m in box.messages.items() if ph == phase and p not in seen}
            if new:
                return new
            box.arrived.clear()
            await box.arrived.wait()

    async def all_to_all(
        self,
        round_id: bytes,
        phase: RoundPhase,
        payload: bytes,
        *,
        deadline: float,
        send: bool = True,
        expect: Optional[set[str]] = None,
        payload_for: Optional[dict[str, Optional[bytes]]] = None,
        relay: Optional[tuple[float, Check]] = None,
    ) -> dict[str, bytes]:
        """Send `payload` to every other member (unless `send` is False) and collect theirs until every
        member (or every peer in `expect`) answered or `deadline` (time.monotonic()) passed.
        `payload_for` sends some members another payload, or None: nothing (attacks, for tests).
        `relay` = (seconds, check): then, for at most that long, ask the members that answered for the
        messages still missing, and keep those `check` takes as their senders' own."""
        box = self._rounds.get(round_id)
        if box is None:
            raise RoundAbortedError("round is not open for exchange")
        me = self.transport.peer_id
        others = sorted(box.members - {me})
        awaited = set(others) if expect is None else (set(expect) & box.members) - {me}
        header = pack(ExchangeHeader(round_id=round_id, phase=phase))

        async def send_one(peer: str) -> None:
            data = payload if payload_for is None else payload_for.get(peer, payload)
            if data is None:
                return
            for attempt, pause in enumerate((*SEND_RETRY_PAUSES_S, None)):
                timeout = max(deadline - time.monotonic(), 0.1)
                try:
                    await self.transport.call(peer, EXCHANGE_METHOD, header, data, max_reply_payload=0, timeout_s=timeout)
                    return
                except (CallFailed, PeerProtocolError) as e:
                    # The member that misses this message judges us silent: a connection that failed is
                    # tried again while the phase lasts. The callee's own refusal (a status) is final.
                    refused = not isinstance(e, CallFailed) or e.status is not None
                    if refused or pause is None or deadline - time.monotonic() <= pause:
                        logger.debug(f"{phase} to {peer[-8:]} failed after {attempt + 1} tries: {e}")
                        return
                    logger.debug(f"{phase} to {peer[-8:]} failed ({e}); trying again in {pause} s")
                await asyncio.sleep(pause)

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
        missing = awaited - {p for (ph, p) in box.messages if ph == phase}
        if missing and relay is not None:
            await self._take_missing(box, round_id, phase, missing, time.monotonic() + relay[0], relay[1])
        received = {p: data for (ph, p), data in box.messages.items() if ph == phase}
        received[me] = payload
        return received

    async def _take_missing(
        self, box: _Mailbox, round_id: bytes, phase: RoundPhase, missing: set[str], deadline: float, check: Check
    ) -> None:
        """Ask every member whose message of `phase` we hold for each message that never reached us: a
        connection that lost one sender's message to us alone (a relayed one, between two homes) would
        otherwise leave us with another view of the round than every other member's."""
        me = self.transport.peer_id
        holders = sorted({p for (ph, p) in box.messages if ph == phase} - {me})
        header = {s: pack(RelayAsk(round_id=round_id, phase=phase, sender=s)) for s in missing}

        async def ask(holder: str, sender: str) -> tuple[str, bytes]:
            timeout = max(deadline - time.monotonic(), 0.1)
            _, data = await self.transport.call(
                holder, EXCHANGE_RELAY_METHOD, header[sender], b"", max_reply_payload=MAX_PHASE_BYTES, timeout_s=timeout
            )
            return holder, bytes(data)

        async def take(sender: str) -> None:
            asks = [asyncio.ensure_future(ask(h, sender)) for h in holders if h != sender]
            try:
                for answer in asyncio.as_completed(asks, timeout=max(deadline - time.monotonic(), 0.1)):
                    try:
                        holder, data = await answer
                    except (CallFailed, PeerProtocolError, RoundAbortedError):
                        continue
                    if (phase, sender) in box.messages:
                        return  # it came itself meanwhile
                    if data and check(sender, data):
                        box.messages[(phase, sender)] = data
                        box.arrived.set()
                        logger.info(f"round {round_id.hex()[:8]}: took {sender[-8:]}'s {phase} message from {holder[-8:]}, as it never reached us")
                        return
            except TimeoutError:
                pass
            finally:
                for task in asks:
                    task.cancel()
                await asyncio.gather(*asks, return_exceptions=True)

        await asyncio.gather(*(take(s) for s in sorted(missing)))
