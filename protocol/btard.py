"""Phases 2 and 6 of a verified round (BTARD, ALGORITHMS.md §2): commit, then verify and judge.

    commit     every member signs the hashes of the parts it will send + an MPRNG commitment;
               nobody sends data before all commitments are in (late members are left out)
    data       parts and aggregates travel with signed statements (protocol.allreduce hooks)
    reveal     MPRNG shares + an echo of the commitments and aggregates each member got; a member
               reveals once it holds every reducer's signed aggregate statement, which heads the
               aggregate's bytes: every aggregate is fixed before anyone can know the seed, and the
               reveal and the projections overlap the rest of the gather
    relay      a reducer that answers one member late, wrongly or never must not get that member
               convicted for being late in its turn. A statement it holds back reaches the member
               anyway, echoed in the others' reveals; the aggregate's bytes it takes from another
               member that got them (checked against the reducer's signed hash): right away when the
               reducer's call failed, ¼ of a phase timeout after another member's report arrived when
               the call still hangs. At ¾ of a phase timeout it stops waiting and its report lists the
               part as undelivered. Every member drops disputed parts. A part that more than half of
               the other members never got was withheld by its reducer, who is banned; a minority that
               never got a part the majority got could have taken it from them, so they are banned
    report     each contributor's projection of its part against each aggregate
    validate   a validator chosen by the public seed recomputes one member's gradient
    accuse     accusations with evidence; every member judges every accusation itself
    vote       signed ban votes are exchanged; security.evidence decides who is banned

Every member runs the same checks on the same signed inputs, so honest members reach the
same verdicts and keep the same state version.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Annotated, Awaitable, Callable, Optional

import torch
from pydantic import Field

from aggregation.base import norm_limit
from aggregation.errors import PeerProtocolError, RoundAbortedError
from protocol.adversary import Behavior
from protocol.config import VerifyConfig
from protocol.codec import Codec, decode, encode, encoded_size_bound, rounding_bound
from protocol.exchange import ExchangeService
from protocol.transport import CallFailed, Transport
from security.commitments import (
    AggregateBody,
    CommitBody,
    PartBody,
    ReportBody,
    ReportEntry,
    members_digest,
    new_share,
    part_hash,
    part_hasher,
    public_seed,
    seeded_choice,
    share_commitment,
)
from security.evidence import BanVote, Offense, RevealBody, Vote, banned, check_self_contained
from security.identity import Identity
from security.projection import (
    clipped_reports,
    differences,
    direction,
    fixed_point_holds,
    project_differences,
    recompute,
    report,
    report_matches,
)
from security.statements import Signed, Statement, open_statement, sign_statement
from security.wire import PeerIdStr, RoundId, WireModel, pack, unpack

logger = logging.getLogger(__name__)

EVIDENCE_METHOD = "evidence"
RELAY_METHOD = "relay"
HELD_ROUNDS = 8
BYTES_PATIENCE = 0.75  # of a phase timeout: how long a member waits for aggregates once reports began
RELAY_AFTER = 0.25  # of a phase timeout after the first report: ask the others for aggregates still missing
Recompute = Callable[[str], Awaitable[torch.Tensor]]  # peer ID -> its honest flat gradient at this round's state
DISMISSED = "dismissed"  # an accusation made in good faith that turned out unfounded: nobody is convicted


class Accusation(WireModel):
    accused: PeerIdStr
    offense: Annotated[Offense, Field(strict=False)]  # sent as its string value
    part: Annotated[int, Field(ge=-1, lt=256)]  # the part concerned, -1 if none
    evidence: Annotated[list[Signed], Field(max_length=4)]


class AccuseBody(WireModel):
    """Kind "accuse"."""

    accusations: Annotated[list[Accusation], Field(max_length=256)]
    suspects: bool = False  # this member saw something wrong (silence, a failed check): everyone votes
    reports: Annotated[list[Signed], Field(max_length=256)] = []  # echo of the reports it judged by


class EvidenceRequest(WireModel):
    round_id: RoundId
    part: int
    contributor: PeerIdStr


class RelayRequest(WireModel):
    """Ask a member for an aggregate it received: `payload` False only asks whether it holds it (the
    reply then waits until it does), True fetches the bytes. The reply header is the reducer's statement."""

    round_id: RoundId
    part: Annotated[int, Field(ge=0, lt=256)]
    payload: bool


class VoteList(WireModel):
    votes: Annotated[list[Signed], Field(max_length=256)]
    disputes: Annotated[list[Signed], Field(max_length=256)] = []  # signed reports that dispute parts


@dataclass
class _Held:
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


@dataclass
class Verdict:
    banned: set[str] = field(default_factory=set)
    bad_parts: set[int] = field(default_factory=set)  # aggregates not to apply (their reducer is guilty)
    votes: list[Signed] = field(default_factory=list)  # every valid vote seen (to publish)
    accusations: int = 0  # accusations made in the round (by anyone)
    disputed: set[int] = field(default_factory=set)  # parts dropped because a member said it never got them
    relayed: set[int] = field(default_factory=set)  # parts this member took from another member, not their reducer
    clean: bool = False  # every member reported a clean round: the held parts were released


class BtardService:
    """One per peer: serves held part bytes to judges and opens verified rounds."""

    def __init__(self, transport: Transport, exchange: ExchangeService, identity: Identity) -> None:
        self.transport, self.exchange, self.identity = transport, exchange, identity
        self._held: dict[bytes, _Held] = {}
        self._open: dict[bytes, VerifiedRound] = {}  # rounds whose received aggregates we pass on
        self._scratch: dict[tuple[int, ...], torch.Tensor] = {}  # fresh memory costs page faults every round
        transport.register(EVIDENCE_METHOD, self._serve_evidence, max_payload=0)
        transport.register(RELAY_METHOD, self._serve_relay, max_payload=0)

    def scratch(self, *shape: int) -> torch.Tensor:
        """A float32 work buffer of `shape`; hand it back with `return_scratch` when no thread uses it."""
        buf = self._scratch.pop(shape, None)
        return torch.empty(shape) if buf is None else buf

    def return_scratch(self, buf: torch.Tensor) -> None:
        self._scratch[tuple(buf.shape)] = buf

    def hold_target(self, round_id: bytes, target: str, parts: dict[int, bytes | memoryview]) -> None:
        """Keep a validator's copies of its target's parts with the round's evidence (held since the reveal)."""
        held = self._held.get(round_id)
        if held is not None:
            held.target, held.validated = target, parts

    def hold(self, round_id: bytes, held: _Held) -> None:
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
        vr = self._open.get(request.round_id)
        if vr is None:
            raise RoundAbortedError("round not open here")
        return await vr.relay_for(peer, request.part, request.payload)

    async def fetch_part(self, holder: str, round_id: bytes, part: int, contributor: str, max_bytes: int, timeout_s: float) -> bytes:
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


class VerifiedRound:
    """One member's view of one verified round; also the data phases' PartGuard."""

    def __init__(
        self,
        service: BtardService,
        *,
        round_id: bytes,
        members: tuple[str, ...],
        group_statement: Signed,
        bounds: list[tuple[int, int]],
        codec: Codec,
        config: VerifyConfig,
        behavior: Behavior,
        vector: torch.Tensor,
        recompute: Optional[Recompute] = None,
    ) -> None:
        self.service, self.identity = service, service.identity
        self.recompute = recompute  # a validator's recomputation of another member's contribution
        self.vector = vector  # this member's committed contribution (flat, CPU float32)
        self.round_id, self.members, self.group_statement = round_id, members, group_statement
        self.bounds, self.codec, self.config, self.behavior = bounds, codec, config, behavior
        self.me = members.index(self.identity.peer_id)
        self.share = new_share()
        self.my_hashes: list[bytes] = []
        self.commits: dict[str, tuple[Signed, CommitBody]] = {}
        self.aggregates: dict[int, tuple[Signed, AggregateBody]] = {}
        self.part_statements: dict[str, Signed] = {}  # contributors to my part -> their signed part statement
        self.payloads: dict[str, bytes | memoryview] = {}  # contributors to my part -> the exact bytes they sent
        self.my_contributors: list[int] = []
        self.accusations: list[Accusation] = []
        self.signed_aggregates: dict[int, dict[bytes, Signed]] = {}  # part -> hash -> the reducer's statement
        self.proofs: dict[str, tuple[Offense, list[Signed]]] = {}  # self-contained proofs found locally
        self._expected: Optional[set[int]] = None  # parts whose aggregate statement we wait for (committed reducers)
        self._reveal_task: Optional[asyncio.Task] = None
        self._seed: Optional[asyncio.Future] = None  # the public seed, once the reveal is done
        self._validating: Optional[asyncio.Task] = None  # starts with the seed, while the gather may still run
        self._target_parts: dict[int, bytes | memoryview] = {}  # as validator: the target's committed parts
        self._equivocators: set[str] = set()  # members proven to have sent different reports
        self._verifying = False  # once verification began, the held parts stay for the judges
        self._landed: set[int] = set()  # parts whose aggregate arrived whole
        self._fallbacks: dict[int, asyncio.Future] = {}  # part -> its bytes from another member, or None: gave up
        self._holding: dict[int, asyncio.Future] = {}  # part -> True once it landed here, False if it never will
        self._received: dict[int, bytes | memoryview] = {}  # part -> the aggregate's bytes (to pass on)
        self._relays: dict[int, asyncio.Task] = {}  # part -> fetching it from the other members
        self._served: set[tuple[str, int, bool]] = set()  # (peer, part, with bytes): each relay answered once
        self._patience: list[asyncio.Task] = []
        # projections, formed as aggregates land: x − v and ‖x − v‖ at once, ⟨z, x − v⟩ once the seed is public
        self._diffs: Optional[torch.Tensor] = None  # (numel,): this member's part minus each aggregate
        self._own: dict[int, asyncio.Task] = {}  # part -> (s, ‖x − v‖) (1,) each of this member's contribution
        self._row_diffs: Optional[torch.Tensor] = None  # (k, part): every received row minus our aggregate
        self._rows: Optional[asyncio.Task] = None  # (s, norms) (k,) each of every row our aggregate came from
        service._open[round_id] = self

    @property
    def committed(self) -> set[str]:
        return set(self.commits)

    def _deadline(self) -> float:
        return time.monotonic() + self.config.phase_timeout_s

    def _prove(self, accused: str, offense: Offense, evidence: list[Signed]) -> None:
        if accused != self.identity.peer_id and check_self_contained(offense, accused, self.round_id, evidence):
            self.proofs.setdefault(accused, (offense, evidence))

    # ---- phase 2: commit ----------------------------------------------------------------------

    async def commit(self, payloads: list[bytes | memoryview]) -> None:
        """Commit to the exact bytes of every part; afterwards `committed` lists who may take part."""
        loop = asyncio.get_running_loop()  # BLAKE3 releases the GIL: hash the parts side by side, off the loop
        self.my_hashes = list(await asyncio.gather(*(loop.run_in_executor(None, part_hash, p) for p in payloads)))
        self.payloads[self.identity.peer_id] = payloads[self.me]  # a view of the vector, which outlives the round
        body = CommitBody(
            members=members_digest(self.members),
            parts=self.behavior.committed_hashes(self.my_hashes),
            mprng=share_commitment(self.round_id, self.identity.peer_id, self.share),
        )
        mine = sign_statement(self.identity, "commit", self.round_id, body)
        received = await self.service.exchange.all_to_all(
            self.round_id, "commit", pack(mine), deadline=self._deadline(), send=self.behavior.speaks("commit")
        )
        digest = members_digest(self.members)
        for peer, raw in received.items():
            try:
                signed = unpack(raw, Signed, peer=peer)
                _, commit = open_statement(signed, CommitBody, kind="commit", round_id=self.round_id, sender=peer)
                if commit.members != digest or len(commit.parts) != len(self.members):
                    raise PeerProtocolError("commitment for another group", peer=peer)
            except PeerProtocolError as e:
                logger.info(f"dropping {peer[-8:]} from round {self.round_id.hex()[:8]}: {e}")
                continue
            self.commits[peer] = (signed, commit)
        self._expected = {self.members.index(peer) for peer in self.commits}
        self._patience.append(asyncio.ensure_future(self._statements_from_reveals()))

    # ---- phases 3-5: PartGuard hooks ----------------------------------------------------------

    def sign_part(self, part: int, payload: bytes | memoryview, weight: float) -> bytes:
        body = PartBody(part=part, hash=self.my_hashes[part], weight=weight)
        return pack(sign_statement(self.identity, "part", self.round_id, body))

    def hasher(self):
        return part_hasher()

    def accept_part(self, sender: int, part: int, payload: bytes | memoryview, header, digest: bytes) -> None:
        peer = self.members[sender]
        if peer not in self.commits:
            raise PeerProtocolError("sent a part without a commitment", peer=peer)
        signed = unpack(header.signature, Signed, peer=peer)
        _, body = open_statement(signed, PartBody, kind="part", round_id=self.round_id, sender=peer)
        if body.part != part:
            raise PeerProtocolError("signed a part statement for another part", peer=peer)
        if body.weight != 1.0:  # BTARD-SGD counts every member once: the checks assume it
            self._prove(peer, Offense.INFLATED_WEIGHT, [signed])
            raise PeerProtocolError(f"claimed weight {body.weight}", peer=peer)
        if body.weight != header.weight:
            raise PeerProtocolError("header weight differs from the signed one", peer=peer)
        commit_signed, commit = self.commits[peer]
        if body.hash != commit.parts[part]:
            self._prove(peer, Offense.BAD_COMMITMENT, [commit_signed, signed])
            raise PeerProtocolError("part does not match its commitment", peer=peer)
        if digest != body.hash:
            raise PeerProtocolError("part bytes do not match their signed hash", peer=peer)
        a, b = self.bounds[part]
        norm = float(torch.linalg.vector_norm(decode(payload, self.codec, b - a, peer=peer)))
        if not norm <= norm_limit(torch.float32):
            # CenteredClip would skip it, but then its sender's report (NaN, Inf) fails every check: the
            # part is left out instead, and a sender whose parts most reducers left out is banned
            raise PeerProtocolError(f"sent a part with NaN, Inf or a norm of {norm:.3g}", peer=peer)
        self.part_statements[peer] = signed
        # raw float32 parts live on in the reducer's rows (kept for the round): no copy needed
        self.payloads[peer] = payload if self.codec is Codec.NONE else bytes(payload)

    def counted(self, received: list[int]) -> list[int]:
        return self.behavior.counted(self, received)

    def sign_aggregate(self, part: int, payload: bytes | memoryview, contributors: list[int]) -> bytes:
        self.my_contributors = list(contributors)
        body = AggregateBody(part=part, hash=part_hash(payload), contributors=list(contributors))
        signed = sign_statement(self.identity, "aggregate", self.round_id, body)
        # held from now on: a validator may fetch a part as soon as the seed is public
        self.service.hold(self.round_id, _Held(part, dict(self.payloads), frozenset(self.members)))
        self._record_aggregate(part, signed, body)
        self._patience.append(asyncio.ensure_future(self._stop_waiting_for_bytes()))
        return pack(signed)

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

    def _give_up(self, parts: set[int]) -> None:
        for part in sorted(parts):
            future = self.fallback(part)
            if not future.done():
                logger.info(f"round {self.round_id.hex()[:8]}: stopped waiting for the aggregate of {self.members[part][-8:]}")
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
        self._start_relay(part)

        async def give_up_later() -> None:
            await asyncio.sleep(self.config.phase_timeout_s * BYTES_PATIENCE)
            self._give_up({part} - self._landed)

        self._patience.append(asyncio.ensure_future(give_up_later()))

    def _start_relay(self, part: int) -> None:
        if part not in self._relays and not self.fallback(part).done():
            self._relays[part] = asyncio.ensure_future(self._relay(part))

    async def _relay(self, part: int) -> None:
        """Take the aggregate of `part` from another member that holds it. Every candidate is asked at
        once whether it holds the part (the answer waits until it does, and carries the reducer's signed
        statement); the bytes come from the first to answer, checked against that hash. A member that
        answers and then stalls must not run out our patience: every `hedge` seconds without the bytes,
        the next holder is asked too, so that even with all but one holder stalling the last is asked
        within half the time left."""
        reducer = self.members[part]
        candidates = [p for p in self.members if p in self.commits and p not in (reducer, self.identity.peer_id)]
        a, b = self.bounds[part]
        limit = encoded_size_bound(b - a, self.codec)
        timeout = self.config.phase_timeout_s * BYTES_PATIENCE
        hedge = self.config.phase_timeout_s * (BYTES_PATIENCE - RELAY_AFTER) / (2 * max(len(candidates), 1))

        async def ask(peer: str, payload: bool) -> tuple[bytes, bytes | memoryview]:
            request = pack(RelayRequest(round_id=self.round_id, part=part, payload=payload))
            return await self.service.transport.call(
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
                done, _ = await asyncio.wait(set(asking) | set(fetching), timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task in asking:
                        peer = asking.pop(task)
                        try:
                            self._adopt_statement(unpack(task.result()[0], Signed, peer=peer))
                        except (CallFailed, RoundAbortedError, PeerProtocolError):
                            continue
                        if part in self.aggregates:
                            holders.append(peer)
                        continue
                    peer = fetching.pop(task)
                    try:
                        data = task.result()[1]
                    except (CallFailed, RoundAbortedError, PeerProtocolError):
                        continue
                    if self._relayed(part, data):
                        logger.info(f"round {self.round_id.hex()[:8]}: took the aggregate of {reducer[-8:]} from {peer[-8:]}")
                        return
        finally:
            for task in list(asking) + list(fetching):
                task.cancel()
            await asyncio.gather(*asking, *fetching, return_exceptions=True)

    def _relayed(self, part: int, data: bytes | memoryview) -> bool:
        """Resolve the fallback of `part` with relayed bytes if they are exactly what its reducer signed."""
        a, b = self.bounds[part]
        if self.fallback(part).done() or (self.codec is Codec.NONE and len(data) != 4 * (b - a)):
            return False
        if part_hash(data) != self.aggregates[part][1].hash:
            return False
        self._received[part] = data
        self.fallback(part).set_result(data)
        return True

    async def relay_for(self, peer: str, part: int, payload: bool) -> tuple[bytes, bytes | memoryview]:
        """Another member's request for an aggregate we received: answered once we hold it."""
        if peer not in self.commits or peer == self.identity.peer_id or part >= len(self.members) or self.members[part] in (peer, self.identity.peer_id):
            raise PeerProtocolError("relay request from outside the round or for no relayable part", peer=peer)
        if (peer, part, payload) in self._served:
            raise PeerProtocolError("asked twice for the same relay", peer=peer)
        # under an honest majority fewer than half the reducers can fail an honest member: more relayed
        # bytes than that would only let one member double another's upload
        if payload and sum(1 for p, _, b in self._served if p == peer and b) >= (len(self.members) - 1) // 2:
            raise PeerProtocolError("asked for more relayed aggregates than an honest member needs", peer=peer)
        self._served.add((peer, part, payload))
        if not await asyncio.shield(self._holds(part)):
            raise RoundAbortedError("we never got that aggregate either")
        statement = pack(self.aggregates[part][0])
        return (statement, self._received[part]) if payload else (statement, b"")

    async def _statements_from_reveals(self) -> None:
        """Take the aggregate statements others echo in early reveals: a reducer that holds its statement
        back from us cannot keep us from revealing in time (each one is signed by its reducer)."""
        seen: set[str] = set()
        while self._reveal_task is None:
            arrived = await self.service.exchange.arrivals(self.round_id, "reveal", seen)
            seen |= set(arrived)
            for peer, raw in arrived.items():
                opened = self._open_reveal(peer, raw)
                for echoed in opened[1].aggregates if opened is not None else []:
                    self._adopt_statement(echoed)

    def _adopt_statement(self, echoed: Signed) -> None:
        """Record an echoed aggregate statement we still lack (its signature is checked only then)."""
        try:
            sender = unpack(echoed.statement, Statement).sender
            part = self.members.index(sender) if sender in self.members else -1
            if part not in (self._expected or set()) or part in self.aggregates or part in self.undelivered:
                return
            _, body = open_statement(echoed, AggregateBody, kind="aggregate", round_id=self.round_id, sender=sender)
        except PeerProtocolError:
            return
        if body.part == part and body.well_formed(len(self.members)) and self._reveal_task is None:
            self._record_aggregate(part, echoed, body)

    async def _stop_waiting_for_bytes(self) -> None:
        await self.service.exchange.arrivals(self.round_id, "report", set())
        # the others wait a whole phase timeout for our report, counted from about then
        await asyncio.sleep(self.config.phase_timeout_s * RELAY_AFTER)
        for part in sorted(self._missing_parts()):
            self._start_relay(part)
        await asyncio.sleep(self.config.phase_timeout_s * (BYTES_PATIENCE - RELAY_AFTER))
        self._give_up(self._missing_parts())

    @property
    def undelivered(self) -> set[int]:
        """Parts we stopped waiting for; once the data phase is over, every part that did not land whole."""
        return self._settled_parts(relayed=False)

    def _settled_parts(self, relayed: bool) -> set[int]:
        """Parts whose fallback resolved: with relayed bytes, or (relayed=False) with None, we gave up."""
        return {p for p, f in self._fallbacks.items() if f.done() and (f.result() is not None) == relayed}

    def _missing_parts(self) -> set[int]:
        return (self._expected or set()) - self._landed - {self.me}

    def reply_for(self, receiver: int, header: bytes, payload: bytes | memoryview) -> tuple[bytes, bytes | memoryview]:
        return self.behavior.aggregate_reply(self, receiver, header, payload)

    def announced(self, part: int, header) -> None:
        """The reducer of `part` signed the aggregate whose bytes now follow."""
        reducer = self.members[part]
        if part in self.undelivered:
            raise PeerProtocolError("aggregate statement came after we stopped waiting for it", peer=reducer)
        signed = unpack(header.statement, Signed, peer=reducer)
        _, body = open_statement(signed, AggregateBody, kind="aggregate", round_id=self.round_id, sender=reducer)
        if body.part != part:
            raise PeerProtocolError("signed an aggregate statement for another part", peer=reducer)
        if not body.well_formed(len(self.members)):
            raise PeerProtocolError("signed an aggregate whose contributors are not a list of members", peer=reducer)
        if part in self.aggregates and self.aggregates[part][0].statement != signed.statement:  # known from an echo
            self._prove(reducer, Offense.EQUIVOCATION, [self.aggregates[part][0], signed])
            raise PeerProtocolError("sent us another aggregate than the one it signed for the others", peer=reducer)
        self._record_aggregate(part, signed, body)

    def accept_aggregate(self, part: int, payload: bytes | memoryview, header, digest: bytes) -> None:
        if part in self.undelivered:
            raise PeerProtocolError("aggregate came after we stopped waiting for it", peer=self.members[part])
        signed, body = self.aggregates.get(part, (None, None))
        if signed is None or signed.statement != unpack(header.statement, Signed, peer=self.members[part]).statement:
            raise PeerProtocolError("aggregate arrived without the statement that announced it", peer=self.members[part])
        if digest != body.hash:
            raise PeerProtocolError("aggregate does not match its signed statement", peer=self.members[part])
        self._received[part] = payload  # a fresh buffer per reply (raw parts: their slice of the output)

    def _record_aggregate(self, part: int, signed: Signed, body: AggregateBody) -> None:
        self.aggregates[part] = (signed, body)
        self.signed_aggregates.setdefault(part, {})[body.hash] = signed
        if self._reveal_task is None and self._expected is not None and self._expected <= set(self.aggregates):
            self._reveal_task = asyncio.ensure_future(self._reveal())  # every aggregate is fixed now

    def landed(self, part: int, value: torch.Tensor, rows: Optional[torch.Tensor] = None, received=()) -> None:
        """Aggregate `part` is final (as this member will apply it): start its projections off the
        event loop while other parts are still moving."""
        self._landed.add(part)
        if not self._holds(part).done():
            self._holds(part).set_result(True)
        if self.me in self.aggregates_contributors(part):
            if self._diffs is None:
                self._diffs = self.service.scratch(self.vector.numel())
            a, b = self.bounds[part]
            own = self._as_sent(part).view(1, -1)
            self._own[part] = asyncio.ensure_future(self._project(part, own, value, self._diffs[a:b].view(1, -1)))
        if rows is not None:
            self._row_diffs = self.service.scratch(*rows.shape)
            self._rows = asyncio.ensure_future(self._project(part, rows, value, self._row_diffs))

    async def counted_projections(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """As a reducer, once the seed is public: (s, ‖x − v‖) of every part its aggregate counted."""
        return None if self._rows is None else await asyncio.shield(self._rows)

    def _seed_future(self) -> asyncio.Future:
        if self._seed is None:
            self._seed = asyncio.get_running_loop().create_future()
        return self._seed

    async def _project(self, part: int, rows: torch.Tensor, value: torch.Tensor, out: torch.Tensor):
        """(s, ‖x − v‖) (k,) each for `rows` against aggregate `value`: x − v and its norms now,
        ⟨z, x − v⟩ once the seed is public. Cancelled only while it waits for the seed."""
        loop = asyncio.get_running_loop()
        norms = await loop.run_in_executor(None, differences, rows, value, out)
        seed = await asyncio.shield(self._seed_future())
        z = direction(seed, part, out.shape[1])
        return clipped_reports(await loop.run_in_executor(None, project_differences, out, z), norms, self.config.tau), norms

    async def close(self) -> None:
        """Stop the round's background work and hand its buffers back (no thread may still write them)."""
        self.service._open.pop(self.round_id, None)
        for task in (self._reveal_task, self._validating, *self._patience, *self._relays.values()):
            if task is not None and not task.done():
                task.cancel()
        for future in self._holding.values():
            if not future.done():
                future.set_result(False)  # relay requests still waiting for a part get an error
        if not self._seed_future().done():
            self._seed_future().cancel()
        pending = list(self._own.values()) + ([self._rows] if self._rows is not None else [])
        await asyncio.gather(
            *pending, *self._relays.values(), *filter(None, [self._reveal_task, self._validating]), return_exceptions=True
        )
        if not self._verifying:  # the data phase failed: nobody will judge this round
            self.service.release(self.round_id)
        for buf in (self._diffs, self._row_diffs):
            if buf is not None:
                self.service.return_scratch(buf)
        self._diffs = self._row_diffs = None

    # ---- phase 6: verify and judge ------------------------------------------------------------

    async def verify(
        self,
        output: torch.Tensor,
        own_rows: Optional[torch.Tensor],
        own_received: tuple[int, ...],
    ) -> Verdict:
        """Run reveal, report, validation, accusation and voting; returns who is banned and which
        aggregates must not be applied. `output` is the gathered result (this member's contribution is `self.vector`)."""
        try:
            verdict = await self._verify(output, own_rows, own_received)
            verdict.relayed = self._settled_parts(relayed=True)
            return verdict
        finally:
            await self.close()

    async def _verify(self, output, own_rows, own_received) -> Verdict:
        self._verifying = True
        if not self.service.holds(self.round_id):  # a round where this member reduced nothing
            self.service.hold(self.round_id, _Held(self.me, dict(self.payloads), frozenset(self.members)))
        t0 = time.monotonic()
        early = self._reveal_task is not None
        if self._reveal_task is None:  # some reducer's statement never came: reveal now
            self._reveal_task = asyncio.ensure_future(self._reveal())
        seed, revealed = await self._reveal_task
        t1 = time.monotonic()
        # What needs only the seed runs while the reports travel: the reducer's own projections of
        # every part it received (off the event loop) and the validator's recomputation (started with the seed).
        truth = None
        if own_rows is not None:
            truth = asyncio.ensure_future(self._reducer_truth(seed, output, own_rows, own_received))
        validating = self._validating
        try:
            reports = await self._report(seed, output)
            t2 = time.monotonic()
            if truth is not None:
                self._check_reports_as_reducer(reports, own_received, await truth)
            await validating
            await self._check_target_reports(seed, output, reports)
        finally:
            validating.cancel()
            if truth is not None:
                await asyncio.gather(truth, return_exceptions=True)  # never leave a thread reading the rows
        suspects = self._suspects_anything(seed, reports, output, revealed)
        t3 = time.monotonic()
        accusations, anyone_suspects = await self._accuse(suspects, reports)
        reports = {peer: r for peer, r in reports.items() if peer not in self._equivocators}
        logger.debug(
            f"round {self.round_id.hex()[:8]} verify: reveal {t1 - t0:.3f} s{' (started in the data phase)' if early else ''}, report {t2 - t1:.3f} s, "
            f"checks {t3 - t2:.3f} s, accuse {time.monotonic() - t3:.3f} s"
        )
        if not anyone_suspects and not any(accusations.values()):
            # Every member saw a clean round: nothing to judge, no vote phase, and nobody will ask for the
            # held parts (validators fetch them before they send their accusations, which we all have).
            self.service.release(self.round_id)
            return Verdict(clean=True)
        return await self._judge(seed, reports, output, accusations, revealed)

    def _suspects_anything(self, seed, reports, output, revealed) -> bool:
        """Whether this member will have a verdict to vote on even without accusations."""
        if self.proofs or self.accusations:
            return True
        if any(p not in self.commits or p not in revealed or p not in reports for p in self.members):
            return True
        if self._disputed(reports) or any(self._left_out_by_most(peer, body) for peer, (_, body) in reports.items()):
            return True  # the disputed parts are dropped (and who failed banned) by a verdict everyone computes alike
        failing = []
        self._check_aggregates(seed, reports, output, {}, {}, lambda peer, *_: failing.append(peer))
        return bool(failing)

    async def _reveal(self) -> tuple[bytes, set[str]]:
        body = RevealBody(
            share=self.share,
            commits=[signed for signed, _ in self.commits.values()],
            aggregates=[signed for signed, _ in self.aggregates.values()],
        )
        mine = sign_statement(self.identity, "reveal", self.round_id, body)
        received = await self.service.exchange.all_to_all(
            self.round_id, "reveal", pack(mine), deadline=self._deadline(), send=self.behavior.speaks("reveal"),
            expect=self.committed,
        )
        shares: dict[str, bytes] = {}
        for peer, raw in received.items():
            if peer not in self.commits:
                continue
            opened = self._open_reveal(peer, raw)
            if opened is None:
                continue
            signed, reveal = opened
            commit_signed, commit = self.commits[peer]
            if share_commitment(self.round_id, peer, reveal.share) != commit.mprng:
                self._prove(peer, Offense.BAD_REVEAL, [commit_signed, signed])
                continue
            shares[peer] = reveal.share
            self._compare_echoes(reveal)
        seed = public_seed(self.round_id, shares)
        self._seed_future().set_result(seed)
        self._validating = asyncio.ensure_future(self._validate(seed))
        return seed, set(shares)

    def _open_reveal(self, peer: str, raw: bytes) -> Optional[tuple[Signed, RevealBody]]:
        try:
            signed = unpack(raw, Signed, peer=peer)
            return signed, open_statement(signed, RevealBody, kind="reveal", round_id=self.round_id, sender=peer)[1]
        except PeerProtocolError as e:
            logger.info(f"bad reveal from {peer[-8:]}: {e}")
            return None

    def _compare_echoes(self, reveal: RevealBody) -> None:
        """Two different signed commitments or aggregates for one slot prove equivocation."""
        for echoed in list(reveal.commits) + list(reveal.aggregates):
            try:
                statement = unpack(echoed.statement, Statement)
            except PeerProtocolError:
                continue
            if statement.kind == "commit" and statement.sender in self.commits:
                mine = self.commits[statement.sender][0]
                if echoed.statement != mine.statement:
                    self._prove(statement.sender, Offense.EQUIVOCATION, [mine, echoed])
            elif statement.kind == "aggregate" and statement.sender in self.members:
                part = self.members.index(statement.sender)
                try:
                    _, body = open_statement(echoed, AggregateBody, kind="aggregate", round_id=self.round_id)
                except PeerProtocolError:
                    continue
                if body.part == part:
                    self.signed_aggregates.setdefault(part, {})[body.hash] = echoed
                if part in self.aggregates and echoed.statement != self.aggregates[part][0].statement:
                    self._prove(statement.sender, Offense.EQUIVOCATION, [self.aggregates[part][0], echoed])

    def _part_values(self, data: bytes | memoryview, part: int, peer: str) -> torch.Tensor:
        a, b = self.bounds[part]
        return decode(bytearray(data), self.codec, b - a, peer=peer).clone()

    def _own_reports(self, seed, output, done: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[int, float, float]]:
        """(part, s, norm) of this member's contribution to every aggregate that counted it."""
        out = []
        for part in range(len(self.members)):
            if self.me not in self.aggregates_contributors(part) or part not in self._landed:
                continue
            if part in done:  # projected as the aggregate landed
                s, norms = done[part]
                out.append((part, float(s[0]), float(norms[0])))
            else:
                a, b = self.bounds[part]
                out.append((part, *report(self._as_sent(part), output[a:b], direction(seed, part, b - a), self.config.tau)))
        return out

    async def _report(self, seed: bytes, output: torch.Tensor) -> dict[str, tuple[Signed, ReportBody]]:
        entries = []
        self._give_up(self._missing_parts())  # the data phase is over: what did not land never will
        done = {part: await task for part, task in self._own.items()}
        own = await asyncio.get_running_loop().run_in_executor(None, self._own_reports, seed, output, done)
        for part, s, norm in own:
            s, norm = await self.behavior.reported(self, part, s, norm)
            entries.append(ReportEntry(part=part, aggregate=self.aggregates[part][1].hash, s=s, norm=norm))
        body = ReportBody(
            entries=entries,
            undelivered=sorted(self.behavior.claimed_undelivered(self, self.undelivered)),
            left_out=sorted(self._left_out_of()),
        )
        mine_signed = sign_statement(self.identity, "report", self.round_id, body)
        received = await self.service.exchange.all_to_all(
            self.round_id, "report", pack(mine_signed), deadline=self._deadline(), send=self.behavior.speaks("report"),
            expect=self.committed, payload_for=self.behavior.reports_for(self, body),
        )
        reports = {}
        for peer, raw in received.items():
            if peer not in self.commits:
                continue
            try:
                signed = unpack(raw, Signed, peer=peer)
                _, body = open_statement(signed, ReportBody, kind="report", round_id=self.round_id, sender=peer)
                reports[peer] = (signed, body)
            except PeerProtocolError as e:
                logger.info(f"bad report from {peer[-8:]}: {e}")
        return reports

    def _as_sent(self, part: int) -> torch.Tensor:
        """This member's part as its reducer decoded it (lossy codecs change it)."""
        a, b = self.bounds[part]
        values = self.vector[a:b].detach().float().cpu()
        if self.codec is Codec.NONE:
            return values
        return decode(bytearray(encode(values, self.codec)), self.codec, b - a)

    def _left_out_of(self) -> set[int]:
        """Aggregates that did not count this member's part, though it sent one (their reducer committed)."""
        return {
            part for part in self.aggregates
            if part != self.me and part in (self._expected or set()) and self.me not in self.aggregates_contributors(part)
        }  # fmt: skip

    def _undelivered_of(self, peer: str, body: ReportBody) -> set[int]:
        """Parts `peer` says it never received (its own part does not count)."""
        return {part for part in body.undelivered if part < len(self.members) and self.members[part] != peer}

    def _left_out_by_most(self, peer: str, body: ReportBody) -> bool:
        """Whether `peer` says most other reducers left its part out: an honest majority of reducers counts
        every part that reached it in time, so `peer` did not deliver (and its claims settle nothing)."""
        claims = {part for part in body.left_out if part < len(self.members) and self.members[part] != peer}
        return 2 * len(claims) > len(self.commits) - 1

    def _left_out_claims(self, peer: str, body: ReportBody) -> set[int]:
        """Parts whose reducer `peer` says left its part out (and whose statement we hold does not count it)."""
        if self._left_out_by_most(peer, body):
            return set()
        index = self.members.index(peer)
        return {
            part for part in body.left_out
            if part < len(self.members) and part != index and index not in self.aggregates_contributors(part)
        }  # fmt: skip

    def _disputes_of(self, peer: str, body: ReportBody) -> set[int]:
        """Parts `peer` disputes: never received, or aggregated without its part. A member most reducers
        left out is banned for it and settles nothing (it could not take every aggregate from the others)."""
        if self._left_out_by_most(peer, body):
            return set()
        return self._undelivered_of(peer, body) | self._left_out_claims(peer, body)

    def _claimants(self, reports, claims) -> dict[int, set[str]]:
        """Part -> the members whose reports make `claims` about it."""
        out: dict[int, set[str]] = {}
        for peer, (_, body) in reports.items():
            for part in claims(peer, body):
                out.setdefault(part, set()).add(peer)
        return out

    def _disputed(self, reports) -> set[int]:
        """Parts some member disputes: nobody applies them (their check lacks its report, or its part)."""
        return set(self._claimants(reports, self._disputes_of))

    def _aggregate_reports(self, part: int, reports) -> tuple[list[str], list[Optional[tuple[float, float]]]]:
        """Contributors of `part` (as its reducer signed them) and their reports for it (None if missing)."""
        contributors = [self.members[i] for i in self.aggregates_contributors(part)]
        out = []
        for peer in contributors:
            entry = None
            if peer in reports:
                for e in reports[peer][1].entries:
                    if e.part == part:
                        entry = (e.s, e.norm)
            out.append(entry)
        return contributors, out

    def aggregates_contributors(self, part: int) -> list[int]:
        if part == self.me:
            return self.my_contributors
        if part in self.aggregates:
            return list(self.aggregates[part][1].contributors)
        return []

    async def _reducer_truth(self, seed, output, own_rows, own_received) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm) of every part this reducer received, from the exact rows it aggregated."""
        if self._rows is not None:
            s, norms = await self._rows
            if len(norms) == len(own_received):
                return s, norms
        a, b = self.bounds[self.me]
        received = list(own_received)
        rows = own_rows if len(received) == own_rows.shape[0] else own_rows[received]  # no copy when all arrived
        z = direction(seed, self.me, b - a)
        return await asyncio.get_running_loop().run_in_executor(None, recompute, rows, output[a:b], z, self.config.tau)

    def _check_reports_as_reducer(self, reports, own_received, truth) -> None:
        part = self.me
        s_true, n_true = truth
        for k, i in enumerate(own_received):
            peer = self.members[i]
            if peer == self.identity.peer_id:
                continue
            true = (float(s_true[k]), float(n_true[k]))
            if peer not in reports:  # a contributor that does not report: judges take the true value from us
                self.accusations.append(Accusation(accused=peer, offense=Offense.FALSE_REPORT, part=part, evidence=[]))
                continue
            if part in reports[peer][1].undelivered:
                continue  # it says our aggregate never reached it: judged as a dispute, the part is dropped
            entry = next((e for e in reports[peer][1].entries if e.part == part), None)
            mine = self.aggregates[part][1].hash
            if entry is None or entry.aggregate != mine or not report_matches((entry.s, entry.norm), true, self.config.tau):
                self.accusations.append(
                    Accusation(accused=peer, offense=Offense.FALSE_REPORT, part=part, evidence=[reports[peer][0]])
                )
        for victim in self.behavior.false_accusations(self, reports):
            self.accusations.append(
                Accusation(accused=victim, offense=Offense.FALSE_REPORT, part=part, evidence=[reports[victim][0]])
            )

    async def _check_target_reports(self, seed, output, reports) -> None:
        """A validator holds every part its target committed to, so it checks the target's reports too.
        Nobody else could check what a reducer reports about its own part (it alone holds that part: one
        made-up report can cancel a wrong aggregate in the fixed-point sum), or what a contributor reports
        when its reducer covers for it."""
        validator, target = self._validator_and_target(seed)
        if validator != self.identity.peer_id or not self._target_parts or target not in reports:
            return
        signed, body = reports[target]
        self.service.hold_target(self.round_id, target, self._target_parts)
        lies = await asyncio.get_running_loop().run_in_executor(None, self._false_entries, seed, output, target, body)
        for part in lies:
            logger.info(f"round {self.round_id.hex()[:8]}: validated {target[-8:]} reported falsely on part {part}")
            self.accusations.append(Accusation(accused=target, offense=Offense.FALSE_REPORT, part=part, evidence=[signed]))

    def _false_entries(self, seed, output, target: str, body: ReportBody) -> list[int]:
        """Parts whose aggregate counted `target` and that it reported on falsely (or not at all)."""
        index, lies = self.members.index(target), []
        for part in sorted(self._target_parts):
            if part == self.me or index not in self.aggregates_contributors(part) or part not in self._landed:
                continue  # our own part its reducer (we) checked already; parts we do not hold cannot be judged
            if part in body.undelivered or part not in self.aggregates:
                continue  # a dispute, judged as one
            entry = next((e for e in body.entries if e.part == part), None)
            if entry is not None and entry.aggregate != self.aggregates[part][1].hash:
                continue  # it reported on another aggregate: its reducer equivocated (the echoes prove it)
            true = self._true_report(seed, output, part, target, self._target_parts[part])
            if entry is None or not report_matches((entry.s, entry.norm), true, self.config.tau):
                lies.append(part)
        return lies

    def _true_report(self, seed, output, part: int, contributor: str, data: bytes | memoryview) -> tuple[float, float]:
        """What `contributor` should have reported on `part`, from the bytes it committed to."""
        a, b = self.bounds[part]
        x = self._part_values(data, part, contributor)
        return report(x, output[a:b], direction(seed, part, b - a), self.config.tau)

    def _validator_and_target(self, seed: bytes) -> tuple[Optional[str], Optional[str]]:
        candidates = sorted(self.commits)
        if len(candidates) < 2 or self.config.validators < 1:
            return None, None
        validator = seeded_choice(seed, "validator", candidates)
        target = seeded_choice(seed, "target", [p for p in candidates if p != validator])
        return validator, target

    async def _validate(self, seed: bytes) -> None:
        validator, target = self._validator_and_target(seed)
        if validator != self.identity.peer_id or self.recompute is None:
            return
        logger.debug(f"round {self.round_id.hex()[:8]}: validating {target[-8:]}")
        parts: dict[int, bytes | memoryview] = {}
        if await self._contribution_holds(target, self.recompute, keep=parts):
            self._target_parts = parts
        else:
            self.accusations.append(Accusation(accused=target, offense=Offense.BAD_CONTRIBUTION, part=-1, evidence=[]))

    async def _contribution_holds(self, target: str, recompute_fn: Recompute, keep: Optional[dict] = None) -> bool:
        """Recompute `target`'s gradient; parts whose hash differs are fetched and compared within tolerance.
        `keep` collects the bytes the target committed to, part by part."""
        honest = (await recompute_fn(target)).detach().float().cpu()
        _, commit = self.commits[target]
        loop = asyncio.get_running_loop()
        for part, (a, b) in enumerate(self.bounds):
            mine = encode(honest[a:b], self.codec)
            if await loop.run_in_executor(None, part_hash, mine) == commit.parts[part]:
                if keep is not None:
                    keep[part] = mine
                continue  # bit-identical recomputation
            try:
                data = await self.service.fetch_part(
                    self.members[part], self.round_id, part, target,
                    encoded_size_bound(b - a, self.codec), self.config.phase_timeout_s,
                )  # fmt: skip
            except (CallFailed, RoundAbortedError, PeerProtocolError):
                return False  # nobody can show the part the target committed to
            if part_hash(data) != commit.parts[part]:
                return False
            if keep is not None:
                keep[part] = data
            theirs = self._part_values(data, part, target)
            expected = decode(bytearray(mine), self.codec, b - a)
            diff = float(torch.linalg.vector_norm((theirs - expected).double()))
            if not math.isfinite(diff) or diff > self.config.contribution_rtol * float(torch.linalg.vector_norm(expected.double())) + 1e-12:
                return False
        return True

    async def _accuse(self, suspects: bool, reports) -> tuple[dict[str, list[Accusation]], bool]:
        """Exchange accusations, with an echo of every report judged by: a member that sent different
        reports to different members (to get an honest reducer convicted by those that got the false one)
        is proven to, and its reports count for nobody."""
        for accused, (offense, evidence) in self.proofs.items():
            self.accusations.append(Accusation(accused=accused, offense=offense, part=-1, evidence=evidence))
        echo = [signed for signed, _ in reports.values()]
        body = AccuseBody(accusations=self.accusations, suspects=suspects, reports=echo)
        mine = sign_statement(self.identity, "accuse", self.round_id, body)
        received = await self.service.exchange.all_to_all(
            self.round_id, "accuse", pack(mine), deadline=self._deadline(), expect=self.committed,
            send=self.behavior.speaks("accuse"),
        )
        out: dict[str, list[Accusation]] = {}
        anyone_suspects = len(received) < len(self.committed)  # a silent member is itself a reason to vote
        for peer, raw in received.items():
            try:
                signed = unpack(raw, Signed, peer=peer)
                _, body = open_statement(signed, AccuseBody, kind="accuse", round_id=self.round_id, sender=peer)
                out[peer] = list(body.accusations)
                anyone_suspects = anyone_suspects or body.suspects
                self._compare_reports(body.reports, reports)
            except PeerProtocolError:
                anyone_suspects = True
        return out, anyone_suspects or bool(self._equivocators)

    def _compare_reports(self, echoed: list[Signed], reports) -> None:
        """Take the echoed reports we lack (a member that kept its report from some members must not split
        their verdicts), and prove equivocation where an echo differs from the report we got."""
        for signed in echoed:
            try:
                sender = unpack(signed.statement, Statement).sender
                mine = reports.get(sender)
                if sender not in self.commits or (mine is not None and mine[0].statement == signed.statement):
                    continue  # the same report: nothing to check (n² of these per round, no signature to verify)
                _, body = open_statement(signed, ReportBody, kind="report", round_id=self.round_id, sender=sender)
            except PeerProtocolError:
                continue
            if mine is None:
                reports[sender] = (signed, body)
            else:
                self._equivocators.add(sender)
                self._prove(sender, Offense.EQUIVOCATION, [mine[0], signed])

    async def _judge(self, seed, reports, output, accusations, revealed) -> Verdict:
        guilty: dict[str, tuple[Offense, list[Signed]]] = {}
        corrected: dict[tuple[str, int], tuple[float, float]] = {}  # (peer, part) -> true report, where one was false

        def convict(peer: str, offense: Offense, evidence: list[Signed]) -> None:
            if peer != self.identity.peer_id and peer not in guilty:
                logger.info(f"round {self.round_id.hex()[:8]}: {peer[-8:]} found guilty of {offense.value}")
                guilty[peer] = (offense, evidence)

        for accused, (offense, evidence) in self.proofs.items():  # provable offenses first
            convict(accused, offense, evidence)
        for accuser, items in accusations.items():
            judged: set[tuple[str, Offense, int]] = set()
            for acc in items:
                # judging may fetch a part per accusation: an accuser found false once, or repeating
                # itself, gets no more of our downloads
                if accuser in guilty or (acc.accused, acc.offense, acc.part) in judged:
                    continue
                judged.add((acc.accused, acc.offense, acc.part))
                if acc.offense.self_contained:
                    if check_self_contained(acc.offense, acc.accused, self.round_id, list(acc.evidence)):
                        convict(acc.accused, acc.offense, list(acc.evidence))
                    else:
                        convict(accuser, Offense.FALSE_ACCUSATION, [self.group_statement])
                elif acc.offense is Offense.FALSE_REPORT:
                    verdict = await self._judge_false_report(seed, output, accuser, acc, reports)
                    if verdict == DISMISSED:
                        continue
                    if verdict is None:
                        convict(accuser, Offense.FALSE_ACCUSATION, [self.group_statement])
                    else:
                        corrected[(acc.accused, acc.part)] = verdict
                        convict(acc.accused, Offense.FALSE_REPORT, [self.group_statement])
                elif acc.offense is Offense.BAD_CONTRIBUTION:
                    validator, target = self._validator_and_target(seed)
                    if accuser != validator or acc.accused != target or self.recompute is None:
                        convict(accuser, Offense.FALSE_ACCUSATION, [self.group_statement])
                    elif await self._contribution_holds(acc.accused, self.recompute):
                        convict(accuser, Offense.FALSE_ACCUSATION, [self.group_statement])
                    else:
                        convict(acc.accused, Offense.BAD_CONTRIBUTION, [self.group_statement])
        # silence: members that joined but never committed, or committed and never revealed or reported
        for peer in self.members:
            if peer not in self.commits or peer not in revealed or peer not in reports:
                convict(peer, Offense.WITHHELD, [self.group_statement])
        # disputes: what most members never got, its reducer withheld; what only a minority never got,
        # they could have taken from the others (relay), so they withhold their report. Parts of
        # reducers already found guilty (a crashed one is silent) settle nothing more.
        for part, disputers in self._claimants(reports, self._undelivered_of).items():
            reducer = self.members[part]
            if reducer in guilty:
                continue
            if 2 * len(disputers) > len(self.commits) - 1:
                convict(reducer, Offense.WITHHELD, [self.group_statement])
            else:
                for peer in disputers:
                    convict(peer, Offense.WITHHELD, [self.group_statement])
        # parts left out: who was late cannot be proven. A reducer that left out most members' parts, or
        # a member whose part most reducers left out, is the one that failed (an honest majority of
        # reducers counts every part that reached it in time, and honest members send theirs at once).
        # Otherwise the part is dropped and nobody is banned.
        for peer, (_, body) in reports.items():
            if self._left_out_by_most(peer, body):
                convict(peer, Offense.WITHHELD, [self.group_statement])
        for part, claimants in self._claimants(reports, self._left_out_claims).items():
            reducer = self.members[part]
            if reducer not in guilty and 2 * len(claimants) > len(self.commits) - 1:
                convict(reducer, Offense.LEFT_OUT, [self.group_statement])
        bad_parts = self._check_aggregates(seed, reports, output, corrected, guilty, convict)
        votes = [
            sign_statement(self.identity, "ban", b"", BanVote(accused=p, offense=o, round_id=self.round_id, evidence=e))
            for p, (o, e) in guilty.items()
        ]
        disputes = [signed for signed, body in reports.values() if body.undelivered or body.left_out]
        verdict = await self._vote(votes, bad_parts, disputes, self._disputed(reports))
        verdict.accusations = sum(len(items) for items in accusations.values())
        return verdict

    def _forwarded_disputes(self, forwarded: list[Signed]) -> set[int]:
        """Disputed parts in signed reports another member forwarded with its votes (each checked)."""
        parts: set[int] = set()
        for signed in forwarded:
            try:
                statement, body = open_statement(signed, ReportBody, kind="report", round_id=self.round_id)
            except PeerProtocolError:
                continue
            if statement.sender in self.commits and statement.sender not in self._equivocators:
                parts |= self._disputes_of(statement.sender, body)
        return parts

    async def _judge_false_report(self, seed, output, accuser, acc: Accusation, reports):
        """The true report if `acc.accused` lied about part `acc.part`; None if the accusation is false;
        DISMISSED if it says the accused never reported while we hold a true report of it (it kept
        its report from the accuser alone, which cannot be proven either way).
        Accusers are the part's reducer, and the round's validator about its target (with the report)."""
        part = acc.part
        if part < 0 or part >= len(self.members) or acc.accused not in self.commits:
            return None
        by_validator = (accuser, acc.accused) == self._validator_and_target(seed) and bool(acc.evidence)
        if self.members[part] != accuser and not by_validator:
            return None
        entry, unreported = None, not acc.evidence and acc.accused in reports
        if acc.evidence or unreported:  # the accused's signed report, or (it never reported to the accuser) ours
            try:
                signed = acc.evidence[0] if acc.evidence else reports[acc.accused][0]
                _, claimed = open_statement(signed, ReportBody, kind="report", round_id=self.round_id, sender=acc.accused)
            except PeerProtocolError:
                return None
            if part in claimed.undelivered:
                return DISMISSED if unreported else None  # a dispute, not a lie about a report
            entry = next((e for e in claimed.entries if e.part == part), None)
        a, b = self.bounds[part]
        try:
            data = await self.service.fetch_part(
                accuser, self.round_id, part, acc.accused, encoded_size_bound(b - a, self.codec), self.config.phase_timeout_s
            )
        except (CallFailed, RoundAbortedError, PeerProtocolError):
            return None  # the accuser cannot show what it claims to have received
        if part_hash(data) != self.commits[acc.accused][1].parts[part]:
            return None
        if part not in self.aggregates:
            return None  # we cannot judge a part whose aggregate we do not hold
        if entry is not None and entry.aggregate != self.aggregates[part][1].hash:
            if entry.aggregate in self.signed_aggregates.get(part, {}):
                return None  # the reducer signed another aggregate for it: the reducer equivocated, not the reporter
            entry = None  # a report against an aggregate nobody signed is no report
        true = self._true_report(seed, output, part, acc.accused, data)
        if entry is not None and report_matches((entry.s, entry.norm), true, self.config.tau):
            return DISMISSED if unreported else None
        return true

    def _check_aggregates(self, seed, reports, output, corrected, guilty, convict) -> set[int]:
        disputed = self._disputed(reports)
        bad: set[int] = set(disputed)
        for part in range(len(self.members)):
            reducer = self.members[part]
            if reducer in guilty:
                bad.add(part)
                continue
            if part in disputed:
                continue
            if part not in self.aggregates and part != self.me:
                continue  # not received: already a missing part
            contributors, entries = self._aggregate_reports(part, reports)
            values = []
            for peer, entry in zip(contributors, entries):
                entry = corrected.get((peer, part), entry)
                if entry is None:
                    break
                values.append(entry)
            if len(values) != len(contributors) or not values:
                # someone's report is missing (they are judged for silence), and its reducer did not show the
                # true one (an honest reducer accuses it, and the judges recompute it): unchecked, not applied
                bad.add(part)
                continue
            a, b = self.bounds[part]
            v = output[a:b]
            slack = rounding_bound(v, self.codec)  # what the codec may have moved the reducer's aggregate
            if not fixed_point_holds(values, [1.0] * len(values), self.config.tau, self.config.eps, float(v.norm()), b - a, slack):
                convict(reducer, Offense.WRONG_AGGREGATE, [self.group_statement])
                bad.add(part)
        return bad

    async def _vote(self, votes: list[Signed], bad_parts: set[int], disputes: list[Signed], disputed: set[int]) -> Verdict:
        """Exchange ban votes, and the disputes each member saw (`disputes`: the signed reports behind our
        `disputed` parts), so that a report sent to only some members still makes every member drop the
        same parts."""
        received = await self.service.exchange.all_to_all(
            self.round_id, "vote", pack(VoteList(votes=votes, disputes=disputes)), deadline=self._deadline(),
            expect=self.committed,
        )  # fmt: skip
        disputed = set(disputed)
        valid: list[Vote] = []
        signed_votes: list[Signed] = []
        for peer, raw in received.items():
            try:
                vote_list = unpack(raw, VoteList, peer=peer)
                for signed in vote_list.votes:
                    statement, body = open_statement(signed, BanVote, kind="ban", round_id=b"", sender=peer)
                    if body.round_id == self.round_id:
                        valid.append(Vote(peer, body))
                        signed_votes.append(signed)
            except PeerProtocolError:
                continue
            disputed |= self._forwarded_disputes(vote_list.disputes)
        out = banned(valid)
        for part, reducer in enumerate(self.members):
            if reducer in out:
                bad_parts.add(part)
        return Verdict(banned=out, bad_parts=bad_parts | disputed, votes=signed_votes, disputed=disputed)
