"""Aggregates that reach a member through the others when their reducer fails it.

A reducer that answers one member late, wrongly or never must not get that member convicted for being
late in its turn. The aggregate's bytes it takes from another member that got them (checked against the
reducer's signed hash): right away when the reducer's call failed, RELAY_AFTER of a phase timeout after
another member's report arrived when the call still hangs. At BYTES_PATIENCE it stops waiting, and its
report lists the part as undelivered.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from phalanx.errors import PeerProtocolError, RoundAbortedError
from phalanx.protocol.btard.messages import RELAY_METHOD, RelayRequest
from phalanx.protocol.codec import Codec, encoded_size_bound
from phalanx.protocol.transport import CallFailed
from phalanx.security.commitments import part_hash
from phalanx.security.phases import RoundPhase
from phalanx.security.statements import Signed
from phalanx.security.wire import pack, unpack

if TYPE_CHECKING:
    from phalanx.protocol.btard.state import RoundState

logger = logging.getLogger(__name__)

BYTES_PATIENCE = 0.75  # of a phase timeout: how long a member waits for aggregates once reports began
RELAY_AFTER = 0.25  # of a phase timeout after the first report: ask the others for aggregates still missing


class AggregateRelay:
    """One member's relays in one verified round: the aggregates it takes from others, those it serves."""

    def __init__(self, vr: RoundState, adopt: Callable[[Signed], None]) -> None:
        self.vr = vr
        self._adopt = adopt  # records an aggregate statement a relaying member showed us
        self.received: dict[int, bytes | memoryview] = {}  # part -> the aggregate's bytes (to pass on)
        self._fallbacks: dict[int, asyncio.Future] = {}  # part -> its bytes from another member, or None: gave up
        self._holding: dict[int, asyncio.Future] = {}  # part -> True once it landed here, False if it never will
        self._relays: dict[int, asyncio.Task] = {}  # part -> fetching it from the other members
        self._served: set[tuple[str, int, bool]] = set()  # (peer, part, with bytes): each relay answered once
        self._patience: list[asyncio.Task] = []

    @property
    def _timeout_s(self) -> float:
        return self.vr.config.phase_timeout_s

    def fallback(self, part: int) -> asyncio.Future:
        """Resolves to the aggregate of `part` as another member relayed it (its hash checked), or to
        None once this member stopped waiting for it."""
        if part not in self._fallbacks:
            self._fallbacks[part] = asyncio.get_running_loop().create_future()
        return self._fallbacks[part]

    def _holds(self, part: int) -> asyncio.Future:
        if part not in self._holding:
            self._holding[part] = asyncio.get_running_loop().create_future()
        return self._holding[part]

    def landed(self, part: int) -> None:
        if not self._holds(part).done():
            self._holds(part).set_result(True)

    def settled(self, relayed: bool) -> set[int]:
        """Parts whose fallback resolved: with relayed bytes, or (relayed=False) with None, we gave up."""
        return {p for p, f in self._fallbacks.items() if f.done() and (f.result() is not None) == relayed}

    def give_up(self, parts: set[int]) -> None:
        for part in sorted(parts):
            future = self.fallback(part)
            if not future.done():
                logger.info(
                    f"round {self.vr.round_id.hex()[:8]}: stopped waiting for the aggregate of {self.vr.members[part][-8:]}"
                )
                future.set_result(None)
            if not self._holds(part).done():
                self._holds(part).set_result(False)
            relay = self._relays.get(part)
            if relay is not None and not relay.done():
                relay.cancel()

    def reducer_failed(self, part: int) -> None:
        """The reducer of `part` will not answer us (an error, bytes that are not what it signed): ask the
        others at once, and stop waiting after as long as we would for a late reply."""
        if part in self._relays or self.fallback(part).done():
            return
        self._start(part)

        async def give_up_later() -> None:
            await asyncio.sleep(self._timeout_s * BYTES_PATIENCE)
            self.give_up({part} - self.vr.landed_parts)

        self._patience.append(asyncio.ensure_future(give_up_later()))

    def wait_for_reports(self) -> None:
        """Once reports begin, the others wait for ours: what has not landed by then is asked of them,
        and given up a little later."""
        self._patience.append(asyncio.ensure_future(self._stop_waiting_for_bytes()))

    async def _stop_waiting_for_bytes(self) -> None:
        await self.vr.service.exchange.arrivals(self.vr.round_id, RoundPhase.REPORT, set())
        # the others wait a whole phase timeout for our report, counted from about then
        await asyncio.sleep(self._timeout_s * RELAY_AFTER)
        for part in sorted(self.vr.missing_parts()):
            self._start(part)
        await asyncio.sleep(self._timeout_s * (BYTES_PATIENCE - RELAY_AFTER))
        self.give_up(self.vr.missing_parts())

    def _start(self, part: int) -> None:
        if part not in self._relays and not self.fallback(part).done():
            self._relays[part] = asyncio.ensure_future(self._relay(part))

    async def _relay(self, part: int) -> None:
        """Take the aggregate of `part` from another member that holds it. Every candidate is asked at
        once whether it holds the part (the answer waits until it does, and carries the reducer's signed
        statement); the bytes come from the first to answer, checked against that hash. A member that
        answers and then stalls must not run out our patience: every `hedge` seconds without the bytes,
        the next holder is asked too, so that even with all but one holder stalling the last is asked
        within half the time left."""
        vr = self.vr
        reducer = vr.members[part]
        candidates = [p for p in vr.members if p in vr.commits and p not in (reducer, vr.identity.peer_id)]
        a, b = vr.bounds[part]
        limit = encoded_size_bound(b - a, vr.codec)
        timeout = self._timeout_s * BYTES_PATIENCE
        hedge = self._timeout_s * (BYTES_PATIENCE - RELAY_AFTER) / (2 * max(len(candidates), 1))

        async def ask(peer: str, payload: bool) -> tuple[bytes, bytes | memoryview]:
            request = pack(RelayRequest(round_id=vr.round_id, part=part, payload=payload))
            return await vr.service.transport.call(
                peer, RELAY_METHOD, request, max_reply_payload=limit if payload else 0, timeout_s=timeout,
                expect_large_reply=payload and limit > (64 << 10),
            )  # fmt: skip

        asking = {asyncio.ensure_future(ask(peer, False)): peer for peer in candidates}
        fetching: dict[asyncio.Task, str] = {}
        holders: list[str] = []  # answered that they hold it, not asked for the bytes yet
        last_fetch = -math.inf
        try:
            while asking or fetching or holders:
                if holders and (not fetching or time.monotonic() >= last_fetch + hedge):
                    peer = holders.pop(0)
                    fetching[asyncio.ensure_future(ask(peer, True))] = peer
                    last_fetch = time.monotonic()
                wait = max(last_fetch + hedge - time.monotonic(), 0.0) if holders else None
                done, _ = await asyncio.wait(
                    set(asking) | set(fetching), timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    if task in asking:
                        peer = asking.pop(task)
                        try:
                            self._adopt(unpack(task.result()[0], Signed, peer=peer))
                        except (CallFailed, RoundAbortedError, PeerProtocolError):
                            continue
                        if part in vr.aggregates:
                            holders.append(peer)
                        continue
                    peer = fetching.pop(task)
                    try:
                        data = task.result()[1]
                    except (CallFailed, RoundAbortedError, PeerProtocolError):
                        continue
                    if self._relayed(part, data):
                        logger.info(
                            f"round {vr.round_id.hex()[:8]}: took the aggregate of {reducer[-8:]} from {peer[-8:]}"
                        )
                        return
        finally:
            for task in list(asking) + list(fetching):
                task.cancel()
            await asyncio.gather(*asking, *fetching, return_exceptions=True)

    def _relayed(self, part: int, data: bytes | memoryview) -> bool:
        """Resolve the fallback of `part` with relayed bytes if they are exactly what its reducer signed."""
        a, b = self.vr.bounds[part]
        if self.fallback(part).done() or (self.vr.codec is Codec.NONE and len(data) != 4 * (b - a)):
            return False
        if part_hash(data) != self.vr.aggregates[part][1].hash:
            return False
        self.received[part] = data
        self.fallback(part).set_result(data)
        return True

    async def serve(self, peer: str, part: int, payload: bool) -> tuple[bytes, bytes | memoryview]:
        """Another member's request for an aggregate we received: answered once we hold it."""
        vr = self.vr
        if (
            peer not in vr.commits
            or peer == vr.identity.peer_id
            or part >= len(vr.members)
            or vr.members[part] in (peer, vr.identity.peer_id)
        ):
            raise PeerProtocolError("relay request from outside the round or for no relayable part", peer=peer)
        if (peer, part, payload) in self._served:
            raise PeerProtocolError("asked twice for the same relay", peer=peer)
        # under an honest majority fewer than half the reducers can fail an honest member: more relayed
        # bytes than that would only let one member double another's upload
        if payload and sum(1 for p, _, b in self._served if p == peer and b) >= (len(vr.members) - 1) // 2:
            raise PeerProtocolError("asked for more relayed aggregates than an honest member needs", peer=peer)
        self._served.add((peer, part, payload))
        if not await asyncio.shield(self._holds(part)):
            raise RoundAbortedError("we never got that aggregate either")
        statement = pack(vr.aggregates[part][0])
        return (statement, self.received[part]) if payload else (statement, b"")

    async def close(self) -> None:
        for task in (*self._patience, *self._relays.values()):
            if not task.done():
                task.cancel()
        for future in self._holding.values():
            if not future.done():
                future.set_result(False)  # relay requests still waiting for a part get an error
        await asyncio.gather(*self._patience, *self._relays.values(), return_exceptions=True)
